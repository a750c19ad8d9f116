"""The op's large GEMMs in half precision on the GPU (issue 25): the input projection, the
input gradient and the weight gradients of float16 and bfloat16 data through cuBLAS with
float16/bfloat16 operands and float32 sums (cublasGemmEx, CUBLAS_COMPUTE_32F), where the
float32 GEMMs ran before. The op's arrays stay float32 (config.PRECISIONS): each operand
is rounded into a contiguous half copy first (halfgemm.cuh's narrow_rows), in the op's
`pairs` scratch, as the CPU's bfloat16 pair products round theirs (cpu/lowlevel/
bf16gemm.py); the product goes straight into the float32 output.

Like persistent.py this needs no CuPy: HalfGemm takes a `narrow` and a `gemm_ex`
callable, CuPy's (cupy_half_gemm) on a GPU and numpy stand-ins in tests/gpu, so the
row-major to column-major mapping (gemm_ex_operands) is tested without a device.

float16's range ends at 65504: a gate gradient above it (a loss scaled by 2^16, say)
rounds to inf here where the float32 GEMM kept it; the output then overflows too, and
torch's GradScaler skips the step as for cuDNN's float16.

Checked on the host (tests/gpu/test_half_gemm.py) and on an H200, where with the
tensor-core products it made the half training step faster than the float32 kernels and
GEMMs: on by default for half data; FUSEDRNN_GPU_HALF_GEMMS=0 keeps the float32 GEMMs.
Measured: bench/results/gpu.md#half-precision-on-the-gpu-the-first-lease
"""
from __future__ import annotations

import os
import threading

import numpy as np

from .build import OPTIONS, source_text

__all__ = ["HALF_GEMMS_ENV", "HALF_TYPES", "NARROW_KERNELS", "MIN_PROJECTION_ROWS",
           "half_gemms_enabled",
           "scratch_size", "gemm_ex_operands", "HalfGemm", "cupy_half_gemm"]

HALF_GEMMS_ENV = "FUSEDRNN_GPU_HALF_GEMMS"
# cudaDataType (library_types.h) of each half storage; tensorcore.cuh's ProductPrecision
# of the rounding kernel
HALF_TYPES = {"float16": 2, "bfloat16": 14}        # CUDA_R_16F, CUDA_R_16BF
_PRECISION = {"float16": 1, "bfloat16": 2}         # kProductF16, kProductBF16
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F = 68     # (CuPy's gemmEx takes >= CUBLAS_COMPUTE_16F as the v11 enum)
CUBLAS_GEMM_DEFAULT = -1
OP_N, OP_T = 0, 1
NARROW_KERNELS = {name: f"fusedrnn::narrow_rows<{p}>" for name, p in _PRECISION.items()}
ALIGN = 8   # halves: each copy starts 16-byte aligned (cuBLAS's tensor-op alignment)
# The input projection goes through the half GEMM from this many rows (T*N) on: below
# it the product is bound by reading W_x, which the rounding copy reads and writes once
# more (twice the float32 GEMM's traffic) - a decoder's T=1 step stays float32. The
# threshold itself is not measured yet (the H200 lease timed the design size only).
MIN_PROJECTION_ROWS = 128


def half_gemms_enabled(environ=os.environ):
    """Whether half data's large GEMMs may run in half: unless FUSEDRNN_GPU_HALF_GEMMS=0
    (module docstring: the measurement behind the default)."""
    return environ.get(HALF_GEMMS_ENV, "1") != "0"


def _round_up(n, to=ALIGN):
    return -(-n // to) * to


def scratch_size(M, K, C):
    """4-byte elements HalfGemm.matmul needs for an (M, K) @ (K, C) product: the half
    copies of a (first) and b, and the slack to start them 16-byte aligned."""
    return -(-(ALIGN + _round_up(M * K) + K * C) // 2)


def gemm_ex_operands(M, K, C, transpose_a, b_transposed, ldc):
    """cublasGemmEx's (transa, transb, m, n, k, lda, ldb) for the row-major
    out (M, C) = op(a) @ op(b) from the contiguous half copies of a and b.

    cuBLAS is column-major: it sees a row-major (r, c) array as its transpose (c x r), so
    it computes out^T (C x M) = op(b)^T op(a)^T with b's copy as its A and a's as its B.
      b's copy: (K, C), or (C, K) where b came transposed (b_transposed: b = w.T)
      a's copy: (M, K), or (K, M) where transpose_a
    """
    if ldc < C:
        raise ValueError(f"gemm_ex_operands: ldc {ldc} < C {C}")
    transa, lda = (OP_T, K) if b_transposed else (OP_N, C)
    transb, ldb = (OP_T, M) if transpose_a else (OP_N, K)
    return transa, transb, C, M, K, lda, ldb


class HalfGemm:
    """out (float32) = a @ b or a^T @ b from half copies of a and b.

    narrow(src, dst, storage): src (rows, cols) float32 with unit column stride -> dst,
        a flat contiguous uint16 array of rows*cols, rounded to nearest even to `storage`.
    gemm_ex(transa, transb, m, n, k, A, lda, B, ldb, C, ldc, storage): cuBLAS's
        C = op(A) op(B), column-major, A and B uint16 arrays of `storage` values, C float32.
    """

    def __init__(self, narrow, gemm_ex):
        self.narrow, self.gemm_ex = narrow, gemm_ex
        self._last = threading.local()   # which a the scratch holds, per thread

    def matmul(self, a, b, out, transpose_a, scratch, storage, a_paired=False):
        """scratch: at least scratch_size(M, K, C) 4-byte elements (any dtype of that size);
        a_paired: the scratch still holds this a's copy from this thread's call before (the
        two weight gradients of a GRU or RNN share dG), honoured only where that call took
        this same a into this same scratch."""
        if storage not in HALF_TYPES:
            raise ValueError(f"HalfGemm: storage must be one of {sorted(HALF_TYPES)}, "
                             f"got {storage!r}")
        M, K = a.shape[::-1] if transpose_a else a.shape
        C = b.shape[1]
        item = out.itemsize
        if out.dtype != np.float32 or out.shape != (M, C) or out.strides[1] != item or \
                b.shape[0] != K:
            raise ValueError(f"HalfGemm: out {out.dtype} {out.shape} (strides {out.strides}) "
                             f"does not fit a {a.shape} and b {b.shape} (float32 out wanted)")
        # b = w.T (the projection's W_x^T): w is copied as it lies, cuBLAS transposes it
        b_transposed = b.strides[0] == b.itemsize and b.strides[1] != b.itemsize
        halves = scratch.view(np.uint16)
        if halves.size < 2 * scratch_size(M, K, C):
            raise ValueError(f"HalfGemm: scratch of {scratch.size} 4-byte elements, "
                             f"{scratch_size(M, K, C)} needed")
        # the scratch's own start is 4-byte aligned (the op carves it among other buffers)
        first = (-_address(halves) // 2) % ALIGN
        at_b = first + _round_up(M * K)
        a_half, b_half = halves[first:first + M * K], halves[at_b:at_b + K * C]
        mine = (_address(a), a.shape, a.strides, transpose_a, storage, _address(halves))
        if not (a_paired and getattr(self._last, "a", None) == mine):
            self.narrow(a, a_half, storage)
        self._last.a = mine
        self.narrow(b.T if b_transposed else b, b_half, storage)
        transa, transb, m, n, k, lda, ldb = gemm_ex_operands(
            M, K, C, transpose_a, b_transposed, out.strides[0] // item)
        self.gemm_ex(transa, transb, m, n, k, b_half, lda, a_half, ldb, out,
                     out.strides[0] // item, storage)
        return out


def _address(array):
    """The first element's address: a CuPy array's data.ptr, a numpy array's (the host
    tests') from its array interface."""
    pointer = getattr(getattr(array, "data", None), "ptr", None)
    return pointer if pointer is not None else array.__array_interface__["data"][0]


def cupy_half_gemm(cupy, cublas=None):
    """HalfGemm on CuPy: narrow_rows compiled by NVRTC once per process, the product by
    the current device's cuBLAS handle on the current stream (cublas: CuPy's binding,
    cupy_backends.cuda.libs.cublas; a stand-in in the host tests)."""
    if cublas is None:
        from cupy_backends.cuda.libs import cublas
    module = _module(cupy)
    kernels = {s: module.get_function(name) for s, name in NARROW_KERNELS.items()}
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)

    def narrow(src, dst, storage):
        rows, cols = src.shape
        if src.strides[1] != src.itemsize or src.dtype != np.float32:
            raise ValueError(f"narrow: expected float32 rows with unit column stride, got "
                             f"{src.dtype} strides {src.strides}")
        n = rows * cols
        if n:
            kernels[storage]((min(-(-n // 256), 4096),), (256,),
                             (src, np.int64(rows), np.int64(cols),
                              np.int64(src.strides[0] // src.itemsize), dst))

    def gemm_ex(transa, transb, m, n, k, A, lda, B, ldb, C, ldc, storage):
        handle = cupy.cuda.device.get_cublas_handle()
        mode = cublas.getPointerMode(handle)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        try:
            half = HALF_TYPES[storage]
            cublas.gemmEx(handle, transa, transb, m, n, k, one.ctypes.data, _address(A), half,
                          lda, _address(B), half, ldb, zero.ctypes.data, _address(C),
                          CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        finally:
            cublas.setPointerMode(handle, mode)

    return HalfGemm(narrow, gemm_ex)


_modules, _lock = {}, threading.Lock()


def _module(cupy):
    with _lock:
        if "module" not in _modules:
            _modules["module"] = cupy.RawModule(code=source_text("halfgemm.cuh"),
                                                options=OPTIONS,
                                                name_expressions=list(NARROW_KERNELS.values()))
        return _modules["module"]
