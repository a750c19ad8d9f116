"""CPU backend: numpy arrays, BLAS GEMMs through numpy, Numba-parallel cell kernels."""
from __future__ import annotations

import contextlib

import numpy as np

from ..config import TORCH_CALLER
from . import jitcache, threads  # noqa: F401  (threads picks a thread-safe Numba layer first)

jitcache.install()   # before any kernel module: their cached kernels must see our locators
from .cells import cell_kernels
from .fused import fused_layer, own_gemm
from .lowlevel import CHUNK, PANEL, pack_recurrent_rows, project

__all__ = ["CpuBackend", "BACKEND"]

# A training GEMM a @ b (the input gradient dG @ W_x) of at least this many multiply-adds
# runs on the micro-kernel: at T=300 N=20 I=H=800 (LSTM) 481 GFLOP/s against numpy's 242.
# Smaller ones lose more than they gain to packing b and to OpenBLAS's threads, still
# spinning from the weight-gradient GEMMs beside them (LSTM T=20 N=32 H=256 training, a
# 1.7e8 product: 0.90x). The weight gradients (a^T @ b, K = T*N long) stay on numpy's,
# or in a torch program on torch's (CpuBackend.matmul).
# Measured: bench/results/cpu-kernel-notes.md#gemm-the-training-gemms
OWN_GEMM_WORK = 1 << 28


class CpuBackend:
    name = "cpu"
    array_name = "numpy.ndarray"
    xp = np

    @staticmethod
    def cell_kernels(mode, dtype):
        return cell_kernels(mode, dtype)

    @staticmethod
    def fused_layer(config, dtype, batch):
        """The whole-layer fused loop (fused.py) where it applies: every cell without
        a projection, any batch. None sends the driver down the generic per-step path."""
        if config.projection_size:
            return None
        return fused_layer(config.mode, dtype)

    @staticmethod
    def blas_scope(config, seq_len, batch):
        """The context an op's numpy BLAS calls run in: one thread for a torch program's
        call (threads.BlasOneThread says why and when), whatever the op's size."""
        return threads.BLAS_ONE_THREAD

    @staticmethod
    def matmul(a, b, out, transpose_a=False):
        """out = a @ b, or a^T @ b (the op's large GEMMs: the input projection where the
        fused layer does not run it, the input and weight gradients).
        a @ b of at least OWN_GEMM_WORK multiply-adds runs on the micro-kernel and
        Numba's threads (lowlevel.gemm, b packed into panels first) wherever the input
        projection does (FusedLayer.projects_input's rule). The rest runs on numpy's
        BLAS, or in a torch program (config.TORCH_CALLER) on torch's GEMM and thread
        pool: there OpenBLAS's threads, spinning after each GEMM, took a core from the
        program's own ops (a torch Linear beside a training step 2.3x slower) and on
        one thread the GEMMs are slow (the acoustic model's step: numpy's BLAS on one
        thread 534 ms, torch's 438 ms).
        Measured: bench/results/cpu-kernel-notes.md#gemm-the-training-gemms and
        #threads-blas-on-one-thread"""
        M, K = a.shape[::-1] if transpose_a else a.shape
        own = not transpose_a and M * K * b.shape[1] >= OWN_GEMM_WORK and \
            own_gemm(out.dtype) and a.flags.c_contiguous and \
            b.flags.c_contiguous and out.flags.c_contiguous and \
            a.dtype == b.dtype == out.dtype
        if own:
            spill = np.empty((-(-M // CHUNK), CHUNK, PANEL), out.dtype)
            return project(a, pack_recurrent_rows(b), out, spill)
        torch_gemm = TORCH_CALLER.get()
        if torch_gemm is not None and a.dtype == b.dtype == out.dtype and \
                all(x.flags.writeable and min(x.strides, default=0) >= 0 for x in (a, b, out)):
            return torch_gemm(a, b, out, transpose_a)
        return np.matmul(a.T if transpose_a else a, b, out=out)

    @staticmethod
    def is_array(value):
        return isinstance(value, np.ndarray)

    @staticmethod
    def contiguous(array):
        return np.ascontiguousarray(array)

    @staticmethod
    def device_key(array):
        return ("cpu",)

    @staticmethod
    def device_context(array):
        return contextlib.nullcontext()

    @staticmethod
    def random(seed):
        return np.random.default_rng(seed)


BACKEND = CpuBackend()
