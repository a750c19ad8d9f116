"""GPU backend: CuPy arrays, cuBLAS GEMMs through CuPy, CUDA cell kernels (cells.cuh).

CuPy is imported only when a CuPy array reaches fusedrnn.RNN, so `import fusedrnn`
works without it. Everything runs on CuPy's current stream, on the device that holds
`data` (the other arrays must be on the same one).
"""
from __future__ import annotations

import contextlib

from .kernels import cupy_cell_kernels
from .persistent import cupy_persistent_layer

__all__ = ["GpuBackend", "backend"]


class GpuBackend:
    name = "cuda"
    array_name = "cupy.ndarray"

    def __init__(self, cupy):
        self.xp = cupy

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

    @staticmethod
    def pair_products(storage):
        """Half-precision training GEMMs (cuBLAS in half with float32 compute) are not
        built: every GEMM runs in the op's float32."""
        return False

    def matmul(self, a, b, out, transpose_a=False):
        """out = a @ b, or a^T @ b, by cuBLAS."""
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

    def random(self, seed):
        return self.xp.random.default_rng(seed)


_backend = None


def backend() -> GpuBackend:
    global _backend
    if _backend is None:
        import cupy
        _backend = GpuBackend(cupy)
    return _backend
