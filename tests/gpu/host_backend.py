"""The GPU backend's kernels built for the host (g++, host_harness.cpp) and wrapped as a
backend the shared recurrence can drive: the CPU backend's arrays, the GPU backend's
argument packing and launch wrappers. Used by test_host_emulation and test_persistent."""
import ctypes
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fusedrnn.config import CELLS, CallOptions, RNNConfig
from fusedrnn.cpu import BACKEND as CPU
from fusedrnn.cpu import FIRST_TIER
from fusedrnn.gpu import GpuBackend, build, halfgemm, kernels, persistent
from fusedrnn.recurrence import RecurrentOp

from conftest import POISONED_NUMPY


def build_harness(tmp_dir):
    """ctypes handle on host_harness.cpp built as a shared library."""
    cxx = shutil.which("g++")
    if cxx is None:
        if os.environ.get("CI") == "true":
            pytest.fail("g++ not found: CI must build the CUDA kernels for the host")
        pytest.skip("g++ not found")
    lib = Path(tmp_dir) / "libcells_host.so"
    # The harness instantiates its entries from this X-macro list: the modes of the table.
    cells = " ".join(f"X({mode}, {cell.cuda_cell})" for mode, cell in CELLS.items())
    subprocess.run([cxx, "-O1", "-std=c++14", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
                    f"-DFUSEDRNN_HOST_CELLS(X)={cells}", "-I", str(build.SOURCE_DIR),
                    str(Path(__file__).with_name("host_harness.cpp")), "-o", str(lib)],
                   check=True)
    return ctypes.CDLL(str(lib))


def _c_args(args):
    return [ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray)
            else ctypes.c_double(a) if isinstance(a, np.floating)
            else ctypes.c_longlong(int(a)) for a in args]


HALF_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def host_narrow(src, dst, storage):
    """halfgemm.cuh's narrow_rows on the host: src (rows, cols) float32, unit column
    stride, rounded to nearest even into the flat uint16 dst."""
    assert src.dtype == np.float32 and src.strides[1] == 4 and dst.dtype == np.uint16
    dst[:] = src.astype(HALF_DTYPES[storage]).view(np.uint16).ravel()


def host_gemm_ex(transa, transb, m, n, k, A, lda, B, ldb, C, ldc, storage):
    """cublasGemmEx as cuBLAS defines it, on the host: C (m x n, column-major, leading
    dimension ldc, float32) = op(A) op(B), A and B flat uint16 arrays of `storage` values
    read column-major with their leading dimensions (sums in float64). C is the row-major
    out array HalfGemm passes: out[j, i] is element (i, j)."""
    def column_major(bits, rows, cols, ld):
        assert ld >= rows and (cols - 1) * ld + rows <= bits.size, (rows, cols, ld, bits.size)
        values = bits.view(HALF_DTYPES[storage]).astype(np.float64)
        return np.lib.stride_tricks.as_strided(values, (rows, cols), (8, 8 * ld))
    op_a = column_major(A, m, k, lda) if transa == halfgemm.OP_N else column_major(A, k, m, lda).T
    op_b = column_major(B, k, n, ldb) if transb == halfgemm.OP_N else column_major(B, n, k, ldb).T
    assert C.dtype == np.float32 and C.shape == (n, m) and C.strides == (4 * ldc, 4)
    C[...] = (op_a @ op_b).T


def _cell_launcher(function):
    def launch(grid, block, args):
        assert grid[0] == kernels.grid_size(int(args[-2]) * int(args[-1]))
        function(*_c_args(args))
    return launch


def _persistent_launcher(function, launches):
    def launch(grid, block, args, shared_mem):
        launches.append((grid, block, shared_mem))
        status = function(ctypes.c_longlong(grid[0]), ctypes.c_longlong(block[0]),
                          ctypes.c_longlong(shared_mem), *_c_args(args))
        assert status == 0, "the tensor-core layout needs more shared memory than the plan's"
    return launch


class HostCudaBackend:
    """The CPU backend's arrays with the GPU backend's kernels, run on the host.

    persistent: None runs every step through the per-step kernels (as the GPU backend
    does by default); a fusedrnn.gpu.persistent.DeviceLimits runs layers that fit through
    the persistent kernels, planned for that device; `threads` and `chunk` override the
    plan's threads per block (fewer threads than tasks exercises the kernels' striding)
    and the backward's staged rows (several chunks, a partial last one); `tile` and
    `slices` go to persistent_plan (the forward's register tile and k-slices); half
    data runs the tensor-core products where `persistent` has compute capability 8.0 or
    later, with `mma_slices` slices (None: the plan's choice)."""
    name = "cuda-host-emulation"
    xp = POISONED_NUMPY
    random = staticmethod(CPU.random)
    blas_scope = staticmethod(CPU.blas_scope)
    astype = staticmethod(CPU.astype)
    pair_scratch = staticmethod(GpuBackend.pair_scratch)
    pair_projection = staticmethod(GpuBackend.pair_projection)
    step_products = staticmethod(GpuBackend.step_products)
    sequence_products = staticmethod(GpuBackend.sequence_products)

    def __init__(self, lib, persistent=None, threads=None, chunk=None, tile=1, slices=1,
                 mma_slices=None, half_gemms=False):
        self.lib, self.limits, self.threads, self.chunk = lib, persistent, threads, chunk
        self.tile, self.slices, self.mma_slices = tile, slices, mma_slices
        self.plans = []   # every persistent layer's plan, in order
        self.launches = []
        # half_gemms: the op's large GEMMs through halfgemm.HalfGemm on host_narrow and
        # host_gemm_ex (GpuBackend.pair_products: the half GEMMs, on by default)
        self.half_gemm = halfgemm.HalfGemm(host_narrow, host_gemm_ex) if half_gemms else None
        self.half_products = []   # (out's shape, transpose_a, half) of each

    def pair_products(self, storage):
        return self.half_gemm is not None and storage in halfgemm.HALF_TYPES

    def matmul(self, a, b, out, transpose_a=False, pairs=None, a_paired=False, half=None):
        """As the GPU backend's (cuBLAS there, numpy or host_gemm_ex here)."""
        if pairs is not None:
            self.half_products.append((out.shape, transpose_a, half))
            return self.half_gemm.matmul(a, b, out, transpose_a, pairs, half, a_paired)
        return self.xp.matmul(a.T if transpose_a else a, b, out=out)

    def fused_layer(self, config, dtype, batch, storage=None):
        if self.limits is None or config.projection_size:
            return None
        precision = persistent.product_precision(storage, self.limits)
        tile, slices = (1, self.mma_slices) if precision else (self.tile, self.slices)
        plan = persistent.persistent_plan(config.cell.gates, config.state_size, batch,
                                          np.dtype(dtype).itemsize, self.limits, tile, slices,
                                          precision)
        if plan is None:
            return None
        if self.threads:
            plan = replace(plan, threads=self.threads)
        if self.chunk:
            plan = replace(plan, chunk=self.chunk)
        self.plans.append(plan)
        suffix = f"{config.mode}_{build.C_TYPES[np.dtype(dtype)]}"
        return persistent.PersistentLayer(
            config.mode, plan, self.xp,
            _persistent_launcher(getattr(self.lib, f"persistent_forward_{suffix}"), self.launches),
            _persistent_launcher(getattr(self.lib, f"persistent_backward_{suffix}"), self.launches))

    def cell_kernels(self, mode, dtype):
        suffix = f"{mode}_{build.C_TYPES[np.dtype(dtype)]}"
        k = kernels.CellKernels(mode, _cell_launcher(getattr(self.lib, f"forward_{suffix}")),
                                _cell_launcher(getattr(self.lib, f"backward_{suffix}")))
        return k.forward_step, k.backward_step


def reference(dtype):
    """The CPU backend a harness result is compared with: float64 on the first tier (numpy,
    which tests/cpu/test_warm.py holds to the fused kernels: no float64 kernel of every
    mode to compile), other dtypes on the fused kernels."""
    return FIRST_TIER if np.dtype(dtype) == np.float64 else CPU


def run_training(backend, case, kw, heads, dtype, opts=CallOptions(), projection_size=None,
                 stored_as=None):
    """A training forward, its backward and an inference forward on one fresh op: every
    output and gradient, in order (stored_as: op.RNN's _stored_as)."""
    T, N, I = case["data"].shape
    cfg = RNNConfig(mode=kw["mode"], input_size=I, state_size=kw["state_size"],
                    num_layers=kw["num_layers"], bidirectional=kw["bidirectional"],
                    projection_size=projection_size)
    op = RecurrentOp(backend, cfg, T, N, np.dtype(dtype), stored_as)
    reserve = op.take_reserve()
    inputs = (case["data"], case["parameters"], case["state"], case["state_cell"], opts)
    outs = op.forward(*inputs, reserve)
    grads = op.backward(reserve, *inputs, heads["dout"], heads["dhy"], heads["dcy"])
    inference = op.forward(*inputs)
    return [a for a in (*outs, *grads, *inference) if a is not None]


def run_stored_as(backend, case, kw, heads, storage="bfloat16"):
    """run_training of float32 arrays holding `storage` values, the op told they stand for
    it (op.RNN's _stored_as: torch's CUDA bfloat16), and of the float64 CPU op on the same
    values: (got, want)."""
    half = HALF_DTYPES[storage]

    def values(tree, dtype):
        return {k: None if v is None else v.astype(half).astype(dtype) for k, v in tree.items()}
    got = run_training(backend, values(case, np.float32), kw, values(heads, np.float32),
                       np.float32, stored_as=storage)
    want = run_training(reference(np.float64), values(case, np.float64), kw,
                        values(heads, np.float64), np.float64)
    return got, want
