"""CPU backend: numpy arrays, BLAS GEMMs through numpy, Numba-parallel cell kernels."""
from __future__ import annotations

import contextlib
import threading

import llvmlite.binding as llvm
import numpy as np

from ..config import TORCH_CALLER, dtype_name
from . import jitcache, threads  # noqa: F401  (threads picks a thread-safe Numba layer first)

jitcache.install()   # before any kernel module: their cached kernels must see our locators
# isort: split
from . import fused, warm  # noqa: E402  (fused.TEAM read at each call: precompile swaps it)
from .cells import cell_kernels  # noqa: E402
from .firsttier import FirstTierBackend  # noqa: E402
from .fused import fused_layer, own_gemm  # noqa: E402
from .heap import raise_mmap_threshold  # noqa: E402
from .lowlevel import (  # noqa: E402
    CHUNK,
    HAS_BF16,
    ITEM_ROWS,
    PANEL,
    QUAD,
    interleave_rows,
    job_rows,
    narrow,
    narrow_f16,
    pack_k_pairs,
    pack_recurrent_rows,
    panels,
    products,
    project,
    project_bf16,
    round_rows,
    widen,
    widen_f16,
)

__all__ = ["CpuBackend", "BACKEND"]

# A training GEMM a @ b (dG @ W_x) of at least this many multiply-adds runs on the
# micro-kernel; smaller ones lose to packing b and to OpenBLAS's still-spinning threads.
# Measured: bench/results/cpu-kernel-notes.md#gemm-the-training-gemms
OWN_GEMM_WORK = 1 << 28
# astype's own conversions, (from, to) -> the kernel, which takes the half side as bits
_HALF_CONVERSIONS = {("bfloat16", "float32"): widen, ("float32", "bfloat16"): narrow,
                     ("float16", "float32"): widen_f16, ("float32", "float16"): narrow_f16}
# A torch program's float32 weight gradient a^T @ b with b this wide and this large runs as
# torch's transposing copy of a, then the micro-kernel (narrower ones gained nothing).
# Measured: bench/results/cpu-kernel-notes.md#gemm-the-training-gemms
OWN_GRADIENT_COLUMNS = 512
OWN_GRADIENT_WORK = 1 << 29
# A single step's backward products run together past STEP_PRODUCTS_WORK multiply-adds (a
# torch program's from any) to where BLAS in parts won, per CPU kind (step_products_most).
# Measured: bench/results/cpu-kernel-notes.md#batched-a-single-steps-backward-in-one-region,
# bench/results/cpu-kernel-notes.md#batched-on-256-bit-tiles-zen-3,
# bench/results/cpu-kernel-notes.md#batched-a-torch-programs-single-step,
# bench/results/cpu-kernel-notes.md#batched-no-upper-bound-on-zen-3
STEP_PRODUCTS_WORK = 1 << 21
STEP_PRODUCTS_MOST_BY_KIND = {"znver3": 1 << 62}


def step_products_most(kind):
    """STEP_PRODUCTS_MOST on a CPU of LLVM name `kind`."""
    return STEP_PRODUCTS_MOST_BY_KIND.get(kind, 1 << 28)


STEP_PRODUCTS_MOST = step_products_most(llvm.get_host_cpu_name())
# A longer sequence's (T*N rows): while an item's A and B strips fit `caches` cores' L2 and
# its largest GEMM has at most `most` multiply-adds, by program; on CPU kinds measured.
# Measured: bench/results/cpu-kernel-notes.md#batched-a-sequences-backward-in-one-region
SEQUENCE_PRODUCTS_BY_KIND = {"znver5": {"numpy": (2, 1 << 31), "torch": (1, 1 << 29)}}
APART = {"numpy": (0, 0), "torch": (0, 0)}   # program: (caches, most)


def sequence_products_bounds(kind):
    """SEQUENCE_PRODUCTS on a CPU of LLVM name `kind`."""
    return SEQUENCE_PRODUCTS_BY_KIND.get(kind, APART)


SEQUENCE_PRODUCTS = sequence_products_bounds(llvm.get_host_cpu_name())
ITEM_ROW_ELEMENTS = ITEM_ROWS + QUAD * PANEL   # an item's A rows and B columns, per row
L2_BYTES = fused.l2_bytes() or 1 << 20


def sequence_products_fit(program, rows, itemsize, work, l2=L2_BYTES):
    """Whether SEQUENCE_PRODUCTS's bounds of `program` hold at T*N `rows`."""
    caches, most = SEQUENCE_PRODUCTS[program]
    return rows * ITEM_ROW_ELEMENTS * itemsize <= caches * l2 and work <= most


# A GEMM this large or more runs in parts inside BLAS_IN_PARTS (smaller ones gained nothing).
# Measured: bench/results/cpu-kernel-notes.md#threads-the-training-gemms-in-parts
PARTS_WORK = 1 << 24
# Smaller outer products (a^T @ b over one row) run on numpy's multiply.
# Measured: bench/results/cpu-kernel-notes.md#gemm-an-outer-product
OUTER_OWN_ELEMENTS = 1 << 13
# An op with no GEMM or gemv past this enters no BLAS scope: OpenBLAS runs those on one thread.
# Measured: bench/results/cpu-kernel-notes.md#threads-no-blas-scope-for-the-smallest-ops
BLAS_SERIAL_WORK = 1 << 13
# A torch program's GEMMs of at most this many multiply-adds (gemvs: BLAS_SERIAL_WORK) run on
# numpy's BLAS, which keeps them on one thread (OpenBLAS's bounds), without torch's views.
# Measured: bench/results/cpu-kernel-notes.md#threads-a-torch-programs-small-gemms-on-numpy
HOST_GEMM_WORK = 1 << 18


def _own_product(a, b, out):
    """out = a @ b on the micro-kernel, b packed into panels first (all C-contiguous)."""
    spill = np.empty((-(-a.shape[0] // CHUNK), CHUNK, PANEL), out.dtype)
    return project(a, pack_recurrent_rows(b), out, spill)


_last_pairs = threading.local()   # _pair_product's last a, per thread


def _pair_product(a, b, out, transpose_a, pairs, a_paired=False):
    """out = a @ b, or a^T @ b, on bfloat16 pairs with float32 sums (bf16gemm.py); pairs:
    pair_scratch's uint32s, the first part already a's pairs where a_paired."""
    M, K = a.shape[::-1] if transpose_a else a.shape
    C, kp = b.shape[1], -(-K // 2)
    n_a, n_b = M * kp, panels(C) * kp * PANEL
    # a_paired holds only where this thread's last pair product made these same pairs
    mine = (a.ctypes.data, a.shape, a.strides, transpose_a, pairs.ctypes.data)
    if a_paired and getattr(_last_pairs, "a", None) == mine:
        a_pairs = pairs[:n_a].reshape((kp, M) if transpose_a else (M, kp))
    elif transpose_a:   # a^T by columns: a's rows interleaved in pairs, no transposing copy
        a_pairs = interleave_rows(a, pairs[:n_a].reshape(kp, M))
    else:
        a_pairs = round_rows(a, pairs[:n_a].view(np.uint16).reshape(M, 2 * kp)).view(np.uint32)
    _last_pairs.a = mine
    b_pairs = pack_k_pairs(b, pairs[n_a:n_a + n_b].reshape(-1, kp, PANEL))
    spill = pairs[n_a + n_b:n_a + n_b + -(-M // CHUNK) * CHUNK * PANEL].view(np.float32)
    return project_bf16(a_pairs, b_pairs, out, spill.reshape(-1, CHUNK, PANEL),
                        by_columns=transpose_a)


_NO_CONTEXT = contextlib.nullcontext()   # (reusable: one, not one a call)


class CpuBackend:
    name = "cpu"
    array_name = "numpy.ndarray"
    xp = np

    def for_call(self, config, seq_len, dtype):
        """This backend where the op's fused kernels are ready, else the first tier (warm.py)."""
        host = TORCH_CALLER.get()   # (a torch program that asked for deterministic results
        deterministic = host is not None and host.deterministic()   # gets them from call 1)
        if host is not None:   # (once a process: heap.py)
            raise_mmap_threshold()
        return self if warm.READY.fused(config, seq_len, dtype, deterministic) else FIRST_TIER

    @staticmethod
    def cell_kernels(mode, dtype):
        return cell_kernels(mode, dtype)

    @staticmethod
    def fused_layer(config, dtype, batch, storage=None):
        """The fused loop (fused.py) for every cell without a projection; None: the generic
        per-step path. storage: the data's dtype name where it differs (config.PRECISIONS):
        bfloat16 takes vdpbf16ps products where the CPU has them, else the widening layer."""
        if config.projection_size:
            return None
        bf16 = storage == "bfloat16" and HAS_BF16
        return fused_layer(config.mode, dtype, bf16=bf16,
                           widens=storage in ("float16", "bfloat16") and not bf16)

    @staticmethod
    def pair_projection(rows):
        """Never: fused layers project their own input; the step path's stays float32."""
        return False

    @staticmethod
    def blas_scope(config, seq_len, batch, own_gemms=False):
        """The context an op's numpy BLAS calls run in: none if no GEMM passes BLAS_SERIAL_WORK;
        one thread in a torch program's call (threads.BlasOneThread), and with own_gemms in
        every program; a fused layer's numpy program runs its large GEMMs in parts instead."""
        if own_gemms:
            return threads.BLAS_ONE_THREAD_ALWAYS
        widest = max([config.layer_input_size(layer) for layer in range(config.num_layers)]
                     + [config.recurrent_size, config.state_size])
        if seq_len * batch * config.directions * config.gate_rows * widest <= BLAS_SERIAL_WORK:
            return _NO_CONTEXT
        return threads.BLAS_ONE_THREAD if config.projection_size else threads.BLAS_IN_PARTS

    @staticmethod
    def pair_products(storage):
        """Whether the op's training GEMMs run on bfloat16 pairs (matmul's `pairs`) for data
        stored as `storage`: bfloat16, where the CPU has AVX512-BF16 (vdpbf16ps, float32
        sums), as the forward's products do.
        Measured: bench/results/cpu-kernel-notes.md#bf16-the-training-gemms"""
        return storage == "bfloat16" and HAS_BF16

    @staticmethod
    def pair_scratch(M, K, C):
        """uint32s that matmul(..., pairs=) needs for an (M, K) @ (K, C) product."""
        kp = -(-K // 2)
        return M * kp + panels(C) * kp * PANEL + -(-M // CHUNK) * CHUNK * PANEL

    @staticmethod
    def matmul(a, b, out, transpose_a=False, pairs=None, a_paired=False, half="bfloat16"):
        """out = a @ b, or a^T @ b: the op's large GEMMs. a @ b of OWN_GEMM_WORK or more
        multiply-adds on the micro-kernel where own_gemm; the rest on numpy's BLAS (in parts
        on helper threads in BLAS_IN_PARTS from PARTS_WORK), in a torch program past
        HOST_GEMM_WORK on torch's (OpenBLAS's spin took a core from its ops), a large float32
        a^T @ b (OWN_GRADIENT_*) on the micro-kernel after torch's transposing copy; an outer
        product (a^T @ b over one row) on it from OUTER_OWN_ELEMENTS, else numpy's multiply.
        `pairs` (pair_scratch's, where pair_products): on bfloat16 pairs, `a_paired`: a's.
        Measured: bench/results/cpu-kernel-notes.md#gemm-the-training-gemms,
        bench/results/cpu-kernel-notes.md#threads-blas-on-one-thread"""
        if pairs is not None and half != "bfloat16":
            raise ValueError(f"matmul: the CPU's pairs are bfloat16, got half={half!r}")
        M, K = a.shape[::-1] if transpose_a else a.shape
        C = b.shape[1]
        same = a.dtype == b.dtype == out.dtype
        # (on pairs b may also be bfloat16: a training's layer-0 data, read in place)
        if pairs is not None and a.dtype == out.dtype == np.float32 and \
                dtype_name(b.dtype) in ("float32", "bfloat16") and out.flags.c_contiguous and \
                a.strides[1] == 4 and b.strides[1] == b.itemsize:
            return _pair_product(a, b, out, transpose_a, pairs, a_paired)
        if not transpose_a and M * K * C >= OWN_GEMM_WORK and own_gemm(out.dtype) and same \
                and a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous:
            return _own_product(a, b, out)
        gemv = min(M, C) == 1 and K > 1
        host = TORCH_CALLER.get() if M * K * C > (
            BLAS_SERIAL_WORK if gemv else HOST_GEMM_WORK) else None
        if host is None and transpose_a and K == 1 and same and out.flags.c_contiguous and \
                out.dtype in (np.float32, np.float64):
            # (numpy's matmul runs it in a scalar loop of its own; torch's mm is quick)
            column, row = a.reshape(M, 1), b.reshape(1, C)
            if own_gemm(out.dtype) and M * C >= OUTER_OWN_ELEMENTS:
                return _own_product(np.ascontiguousarray(column), np.ascontiguousarray(row),
                                    out)
            return np.multiply(column, row, out=out)
        if host is None or not same or not all(
                x.flags.writeable and min(x.strides, default=0) >= 0 for x in (a, b, out)):
            parts = min(threads.blas_parts(), M * K * C // max(1, PARTS_WORK // 2))
            if parts > 1 and same and out.flags.c_contiguous:
                return threads.gemm_in_parts(a.T if transpose_a else a, b, out, parts)
            return np.matmul(a.T if transpose_a else a, b, out=out)
        if transpose_a and C >= OWN_GRADIENT_COLUMNS and M * K * C >= OWN_GRADIENT_WORK \
                and out.dtype == np.float32 and out.flags.c_contiguous:
            return _own_product(host.transpose(a, np.empty((M, K), out.dtype)),
                                np.ascontiguousarray(b), out)
        return host.matmul(a, b, out, transpose_a)

    @staticmethod
    def step_products(dtype, work):
        """Whether a single step's backward products (`work` multiply-adds) go to `products`
        together, by the bounds above (of a call it reads TORCH_CALLER alone: an op keeps its
        answers per program kind, RecurrentOp._together).
        Measured: bench/results/cpu-kernel-notes.md#batched-a-torch-programs-single-step"""
        low = STEP_PRODUCTS_WORK if TORCH_CALLER.get() is None else 0
        return low < work <= STEP_PRODUCTS_MOST and own_gemm(dtype) and \
            dtype in (np.float32, np.float64)

    @staticmethod
    def sequence_products(dtype, rows, work):
        """step_products at T > 1: `rows` T*N, `work` the layer's largest GEMM's."""
        program = "numpy" if TORCH_CALLER.get() is None else "torch"
        return own_gemm(dtype) and dtype in (np.float32, np.float64) and \
            sequence_products_fit(program, rows, dtype.itemsize, work)

    @staticmethod
    def products(jobs, dtype):
        """out = a @ b, or a^T @ b, for each (a, b, out, transpose_a) of `jobs`, in one
        region of the micro-kernel (lowlevel/batched.py): 2-D arrays of `dtype` with unit
        column strides, no out overlapping an input."""
        rows, items, work = job_rows(jobs, dtype)
        products(rows, items, dtype.type(0), work, fused.TEAM)

    @staticmethod
    def astype(array, dtype, out=None):
        """array converted to dtype, into `out` (of array's shape) or a new array. bfloat16
        and float16 <-> float32 run on Numba's threads (numpy's and ml_dtypes' casts are
        single-threaded); the rest is numpy's."""
        dtype = np.dtype(dtype)
        pair = (dtype_name(array.dtype), dtype_name(dtype))
        if out is None:
            out = np.empty(array.shape, dtype)
        elif not out.flags.c_contiguous:   # (a reshaped copy would drop the result)
            raise ValueError(f"astype: out must be C-contiguous, got strides {out.strides}")
        conversion = _HALF_CONVERSIONS.get(pair)
        if conversion is None:
            out[...] = array
            return out
        src = np.ascontiguousarray(array).reshape(-1)
        if pair[1] == "float32":
            conversion(src.view(np.uint16), out.reshape(-1))
        else:
            conversion(src, out.reshape(-1).view(np.uint16))
        return out

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
        return _NO_CONTEXT

    @staticmethod
    def follow(last_stream):
        """An op's calls are ordered by its lock alone here (GpuBackend.follow: streams)."""
        return None

    @staticmethod
    def random(seed):
        return np.random.default_rng(seed)


BACKEND = CpuBackend()
FIRST_TIER = FirstTierBackend(BACKEND)
