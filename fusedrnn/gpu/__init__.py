"""GPU backend: CuPy arrays, cuBLAS GEMMs through CuPy, CUDA cell kernels (cells.cuh).

CuPy is imported only when a CuPy array reaches fusedrnn.RNN, so `import fusedrnn`
works without it. Everything runs on CuPy's current stream, on the device that holds
`data` (the other arrays must be on the same one).
"""
from __future__ import annotations

import contextlib

from . import halfgemm
from .kernels import cupy_cell_kernels
from .persistent import cupy_persistent_layer

__all__ = ["GpuBackend", "backend"]


class GpuBackend:
    name = "cuda"
    array_name = "cupy.ndarray"

    def __init__(self, cupy):
        self.xp = cupy
        self._half_gemm = None

    def for_call(self, config, seq_len, dtype):
        """The backend an op of this kind runs on: this one (NVRTC's compiles are short and
        CuPy caches them on disk; the CPU's first tier has no GPU counterpart)."""
        return self

    def cell_kernels(self, mode, dtype):
        return cupy_cell_kernels(self.xp, mode, dtype)

    def fused_layer(self, config, dtype, batch, storage=None):
        """The persistent kernels where they fit on chip (persistent.py: the rule;
        FUSEDRNN_GPU_PERSISTENT=0 turns them off), else None: the per-step path. Half
        `storage` runs their products on tensor cores where the device has them."""
        return cupy_persistent_layer(self.xp, config, dtype, batch, storage)

    @staticmethod
    def blas_scope(config, seq_len, batch, own_gemms=False):
        """cuBLAS runs on the device: nothing to cap on the host."""
        return contextlib.nullcontext()

    def pair_products(self, storage):
        """Whether the op's large GEMMs (the input projection, the input and weight
        gradients) of data stored as `storage` run in half (matmul's `pairs`: halfgemm.py,
        cuBLAS with float32 sums): float16 or bfloat16 from compute capability 8.0 (the
        rounding kernel's cvt.rn.bf16.f32; tensorcore.cuh's to_half traps before it),
        unless FUSEDRNN_GPU_HALF_GEMMS=0 (halfgemm.py: the measurement behind the
        default). Else they run in the op's float32."""
        if storage not in halfgemm.HALF_TYPES or not halfgemm.half_gemms_enabled():
            return False
        return int(self.xp.cuda.Device().compute_capability) >= 80

    @staticmethod
    def step_products(dtype, work):
        """Never: a single step's backward GEMMs stay cuBLAS calls one by one (the CPU
        backend's `products` runs them in one region)."""
        return False

    @staticmethod
    def sequence_products(dtype, rows, work):
        """Never, as step_products."""
        return False

    @staticmethod
    def pair_projection(rows):
        """Whether the op's input projection of `rows` (T*N) rows runs through matmul's
        `pairs` too, where pair_products holds: from halfgemm.MIN_PROJECTION_ROWS (the
        rule and why there)."""
        return rows >= halfgemm.MIN_PROJECTION_ROWS

    @staticmethod
    def pair_scratch(M, K, C):
        """4-byte elements matmul(..., pairs=) needs for an (M, K) @ (K, C) product."""
        return halfgemm.scratch_size(M, K, C)

    def matmul(self, a, b, out, transpose_a=False, pairs=None, a_paired=False, half=None):
        """out = a @ b, or a^T @ b, by cuBLAS: in float32, or with `pairs` (a scratch of
        pair_scratch(M, K, C); only where pair_products said so) from a and b rounded to
        `half` ("float16" or "bfloat16"), float32 sums. a_paired: `pairs` still holds this
        a's copy from the call before (halfgemm.HalfGemm.matmul)."""
        if pairs is not None:
            if self._half_gemm is None:
                self._half_gemm = halfgemm.cupy_half_gemm(self.xp)
            return self._half_gemm.matmul(a, b, out, transpose_a, pairs, half, a_paired)
        return self.xp.matmul(a.T if transpose_a else a, b, out=out)

    def astype(self, array, dtype, out=None):
        """array converted to dtype, into `out` or a new array: the op's half-precision
        edges."""
        if out is None:
            return array.astype(dtype)
        self.xp.copyto(out, array, casting="unsafe")
        return out

    def is_array(self, value):
        return isinstance(value, self.xp.ndarray)

    def contiguous(self, array):
        return self.xp.ascontiguousarray(array)

    @staticmethod
    def device_key(array):
        return ("cuda", array.device.id)

    @staticmethod
    def device_context(array):
        return array.device  # a cupy.cuda.Device: makes it current inside `with`

    def follow(self, last_stream):
        """Order an op's call after its last one (under the op's lock): where that ran on
        another stream (a training handle's backward in another thread, on that thread's
        stream), the current stream first waits for all that stream holds now - the two
        calls share the op's scratch. Returns the current stream, the next call's
        `last_stream`."""
        stream = self.xp.cuda.get_current_stream()
        if last_stream is not None and last_stream.ptr != stream.ptr:
            event = self.xp.cuda.Event(disable_timing=True)
            event.record(last_stream)
            stream.wait_event(event)
        return stream

    def random(self, seed):
        return self.xp.random.default_rng(seed)


_backend = None


def backend() -> GpuBackend:
    global _backend
    if _backend is None:
        import cupy
        _backend = GpuBackend(cupy)
    return _backend
