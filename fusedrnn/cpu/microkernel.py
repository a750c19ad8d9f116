"""A register-tiled GEMM micro-kernel against pre-packed weights, for the fused CPU steps.

Why not numpy's BLAS per step: the recurrent product is (N, K) @ (K, G*H) with N small
(20 in the design-doc case), and OpenBLAS re-packs the whole weight matrix on every
call; measured on the 2-core machine at N=20 K=800 (float32), `np.matmul` runs at
48 GFLOP/s for G*H=3200 and 55 GFLOP/s for 800, a quarter of its 2048^3 rate. The
weights do not change during a call, so we pack them once into 16-column panels
and run this kernel over them; one core reaches 80-90 GFLOP/s with the operands in
L1-L3 (bench: `python bench/microkernel.py`).

Numba cannot keep a tile of accumulators in vector registers on its own (its loop
vectoriser vectorises the K reduction instead and spills), so the kernel is emitted
as LLVM IR through a Numba intrinsic: MR x (16 / lanes) vector accumulators, one
broadcast of A per row, `llvm.fmuladd` (an FMA where the CPU has one). With AVX2:
float32 6 rows x 2 ymm, float64 3 rows x 4 ymm; 12 accumulators + panel + broadcast
fit the 16 registers.

panel_gemm(a, lda, rows, panel, c, ldc, k)  (inline Numba function)
    a      address of A[0, 0]; A is (rows, k), row stride lda elements, unit column stride
    panel  address of one packed panel: (k, PANEL) contiguous, 16 columns of B
    c      address of C[0, 0]; C (rows, PANEL) with row stride ldc; overwritten with A @ B
    All three are of the same floating dtype; C must not overlap A or the panel.
"""
from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["PANEL", "ROWS", "panel_gemm_for", "pack_columns", "pack_rows"]

PANEL = 16                                        # columns per packed panel
ROWS = {np.dtype(np.float32): 6, np.dtype(np.float64): 3}   # MR: rows per register tile


def _tile_intrinsic(dtype, rows):
    """C[rows, PANEL] = A[rows, k] @ panel[k, PANEL], accumulators in registers."""
    lanes = 32 // np.dtype(dtype).itemsize            # one 256-bit vector
    vectors = PANEL // lanes

    @intrinsic
    def tile(typingctx, a, lda, panel, c, ldc, k):
        for arg in (a, lda, panel, c, ldc, k):
            if not isinstance(arg, types.Integer):
                return None

        def codegen(context, builder, signature, args):
            a, lda, panel, c, ldc, k = (context.cast(builder, v, t, types.intp)
                                        for v, t in zip(args, signature.args))
            intp = a.type
            scalar = ir.FloatType() if np.dtype(dtype) == np.float32 else ir.DoubleType()
            vec = ir.VectorType(scalar, lanes)
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                f"llvm.fmuladd.v{lanes}{'f32' if lanes == 8 else 'f64'}")
            a_ptr = builder.inttoptr(a, scalar.as_pointer())
            b_ptr = builder.inttoptr(panel, scalar.as_pointer())
            c_ptr = builder.inttoptr(c, scalar.as_pointer())
            # Allocas in the entry block: LLVM promotes them to registers (mem2reg).
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(vec, None))
                    for _ in range(vectors)] for _ in range(rows)]
            splat = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
            undef = ir.Constant(vec, ir.Undefined)
            with cgutils.for_range(builder, k) as loop:
                kk = loop.index
                row = builder.gep(b_ptr, [builder.mul(kk, ir.Constant(intp, PANEL))])
                b = [builder.load(builder.bitcast(
                    builder.gep(row, [ir.Constant(intp, v * lanes)]), vec.as_pointer()), align=1)
                    for v in range(vectors)]
                for r in range(rows):
                    a_rk = builder.load(builder.gep(
                        a_ptr, [builder.add(builder.mul(ir.Constant(intp, r), lda), kk)]))
                    a_vec = builder.shuffle_vector(
                        builder.insert_element(undef, a_rk, ir.Constant(ir.IntType(32), 0)),
                        undef, splat)
                    for v in range(vectors):
                        builder.store(builder.call(fma, [a_vec, b[v], builder.load(acc[r][v])]),
                                      acc[r][v])
            for r in range(rows):
                for v in range(vectors):
                    at = builder.add(builder.mul(ir.Constant(intp, r), ldc),
                                     ir.Constant(intp, v * lanes))
                    builder.store(builder.load(acc[r][v]),
                                  builder.bitcast(builder.gep(c_ptr, [at]), vec.as_pointer()),
                                  align=1)
            return context.get_dummy_value()

        return types.void(a, lda, panel, c, ldc, k), codegen

    return tile


_panel_gemms = {}


def panel_gemm_for(dtype):
    """The inline Numba function panel_gemm (module docstring) for `dtype`."""
    dtype = np.dtype(dtype)
    if dtype in _panel_gemms:
        return _panel_gemms[dtype]
    mr = ROWS[dtype]
    itemsize = dtype.itemsize
    tiles = tuple(_tile_intrinsic(dtype, r) for r in range(1, mr + 1))
    full = tiles[mr - 1]
    # Numba needs each intrinsic as a separate global to call it; bind them by rank.
    t1, t2, t3 = tiles[0], tiles[1], tiles[2]
    t4, t5 = (tiles[3], tiles[4]) if mr > 3 else (t3, t3)

    @nb.njit(inline="always")
    def panel_gemm(a, lda, rows, panel, c, ldc, k):
        # Balanced tiles (20 rows: 4 x 5, not 6+6+6+2): a thin tail tile does a third
        # of the FMAs per panel load of a full one.
        tiles = (rows + mr - 1) // mr
        r = 0
        for i in range(tiles):
            height = (rows - r) // (tiles - i)
            a_r, c_r = a + r * lda * itemsize, c + r * ldc * itemsize
            if height == mr:
                full(a_r, lda, panel, c_r, ldc, k)
            elif height == 1:
                t1(a_r, lda, panel, c_r, ldc, k)
            elif height == 2:
                t2(a_r, lda, panel, c_r, ldc, k)
            elif height == 3:
                t3(a_r, lda, panel, c_r, ldc, k)
            elif height == 4:
                t4(a_r, lda, panel, c_r, ldc, k)
            elif height == 5:
                t5(a_r, lda, panel, c_r, ldc, k)
            r += height

    _panel_gemms[dtype] = panel_gemm
    return panel_gemm


def pack_columns(w, gates, out=None):
    """Pack B = w.T for the forward product h @ w.T, where w (gates*H, K) holds `gates`
    row blocks of H. Returns (ceil(H/16), gates, K, 16): panel [b, g] holds gate g's
    units 16b..16b+15, so one block of units has all its gates' columns together.
    Units past H are zero."""
    GH, K = w.shape
    H = GH // gates
    blocks = -(-H // PANEL)
    if out is None:
        out = np.empty((blocks, gates, K, PANEL), dtype=w.dtype)
    padded = np.zeros((gates, blocks * PANEL, K), dtype=w.dtype)
    padded[:, :H] = w.reshape(gates, H, K)
    out[...] = padded.reshape(gates, blocks, PANEL, K).transpose(1, 0, 3, 2)
    return out


def pack_rows(w, out=None):
    """Pack B = w for the backward product dg @ w, w (GH, R). Returns (ceil(R/16), GH, 16):
    panel b holds columns 16b..16b+15 of w (output units), zero past R."""
    GH, R = w.shape
    blocks = -(-R // PANEL)
    if out is None:
        out = np.empty((blocks, GH, PANEL), dtype=w.dtype)
    padded = np.zeros((GH, blocks * PANEL), dtype=w.dtype)
    padded[:, :R] = w
    out[...] = padded.reshape(GH, blocks, PANEL).transpose(1, 0, 2)
    return out
