"""A bfloat16 register tile for AVX512-BF16: the building block of issue 25's CPU path.

`vdpbf16ps` adds the products of pairs of bfloat16 values to float32 lanes: twice a
float32 FMA's multiply-adds. llvmlite's IR has no bfloat type, so the intrinsic is reached
through a helper in LLVM's textual IR (_HELPER), linked into each module that asks.

Layouts (k counted in pairs, kp = ceil(K / 2); an odd K padded with a zero):
    A      (rows, kp) uint32, row stride lda (uint32s): A[r, 2p] in the low half of
           element (r, p), A[r, 2p+1] in the high half (a bfloat16 matrix (rows, 2kp)
           viewed as uint32, as it lies in memory)
    panel  (kp, 16) uint32: element (p, j) holds B[2p, j] (low) and B[2p+1, j] (high),
           16 columns of B (pack_pairs)
panel_gemm_bf16(a, lda, rows, panel, pstride, npanels, c, ldc, kp)  (Numba intrinsic)
    C (rows, npanels*16) float32, row stride ldc, overwritten with A @ [panel_0 ..];
    panel j at panel + j*pstride uint32s; npanels a constant; the float32 kernel's tiles.
    Addresses are integers; C must not overlap A or the panels.
panel_gemm_bf16_cols(...)  the same with A by columns: (kp, rows) uint32, pair p of row r
    at a + p*lda + r (dG^T from bf16gemm.interleave_rows: no transposing copy).
panel_gemm_bf16_cols_acc(...)  the by-columns product adding A @ B to C (K_BLOCK's blocks).
panel_gemm_bf16_bias(a, lda, rows, panel, pstride, npanels, c, ldc, kp, bias, bstride)
    C = A @ [panel_0 ..] + the panels' bias rows (panel j's 16 float32 at bias + j*bstride
    floats, padded, added to every row of C); no overlap with C. The fused loop's products.
Only where Numba's target has AVX512-BF16 (HAS_BF16): elsewhere LLVM cannot select it,
so callers must not compile this.
"""
from __future__ import annotations

import functools

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core import codegen as numba_codegen
from numba.core import config as numba_config
from numba.extending import intrinsic

from .microkernel import PANEL, _function, emit_tiled_product, k_split, panel_count

__all__ = ["HAS_BF16", "pack_pairs", "panel_gemm_bf16", "panel_gemm_bf16_bias",
           "panel_gemm_bf16_cols", "panel_gemm_bf16_cols_acc"]


def _has_bf16():
    features = numba_config.CPU_FEATURES
    if features is None:
        features = numba_codegen.get_host_cpu_features()
    return "+avx512bf16" in features.split(",")


HAS_BF16 = _has_bf16()

_HELPER = r"""
define <16 x float> @fusedrnn_dpbf16(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) alwaysinline {
  %a2 = bitcast <16 x i32> %a to <32 x bfloat>
  %b2 = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %a2, <32 x bfloat> %b2)
  ret <16 x float> %r
}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
"""
_helper_libraries = {}   # one parsed helper per Numba codegen


def _link_helper(context):
    """fusedrnn_dpbf16 available to the module being built (linked once per library)."""
    codegen = context.codegen()
    lib = _helper_libraries.get(id(codegen))
    if lib is None:
        lib = codegen.create_library("fusedrnn_bf16_helper")
        lib.add_llvm_module(llb.parse_assembly(_HELPER))
        lib.finalize()
        _helper_libraries[id(codegen)] = lib
    active = context.active_code_library
    if lib not in getattr(active, "_linking_libraries", ()):
        active.add_linking_library(lib)


def _emit_tile(builder, a, lda, panel, pstride, c, ldc, kp, *biased, rows, group, by_columns,
               accumulate):
    """C[rows, group*16] = A[rows, 2kp] @ B (module docstring), or with accumulate C +=
    A @ B; A by columns where by_columns; with `biased` (bias row address, stride between
    the panels' rows in floats) the sums start from panel j's bias row."""
    intp = a.type
    const = functools.partial(ir.Constant, intp)
    u32, f32 = ir.IntType(32), ir.FloatType()
    u32v, f32v = ir.VectorType(u32, 16), ir.VectorType(f32, 16)
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32v, [f32v, u32v, u32v]),
                                         "fusedrnn_dpbf16")
    a_ptr = builder.inttoptr(a, u32.as_pointer())
    b_ptr = builder.inttoptr(panel, u32.as_pointer())
    c_ptr = builder.inttoptr(c, f32.as_pointer())
    def c_at(r, j):
        at = builder.add(builder.mul(const(r), ldc), const(j * PANEL))
        return builder.bitcast(builder.gep(c_ptr, [at]), f32v.as_pointer())

    # A one-panel tile splits its sums (pairs p = s mod split) as the float32 tile does
    # (microkernel.k_split): 6 chains of vdpbf16ps could not cover its latency.
    # Measured: bench/results/cpu-kernel-notes.md#bf16-one-panel-tiles-split-their-sums
    split = k_split(rows, group, 1)
    start = [None] * group
    if biased:
        bias_ptr = builder.inttoptr(biased[0], f32.as_pointer())
        start = [builder.load(builder.bitcast(builder.gep(bias_ptr, [builder.mul(
            const(j), biased[1])]), f32v.as_pointer()), align=4) for j in range(group)]

    def first(r, j):
        value = builder.load(c_at(r, j), align=4) if accumulate else None
        if start[j] is not None:
            value = start[j] if value is None else builder.fadd(value, start[j])
        return ir.Constant(f32v, None) if value is None else value
    acc = [[[cgutils.alloca_once_value(builder, first(r, j) if s == 0
                                       else ir.Constant(f32v, None)) for s in range(split)]
            for j in range(group)] for r in range(rows)]
    splat = ir.Constant(ir.VectorType(u32, 16), [0] * 16)
    undef = ir.Constant(u32v, ir.Undefined)

    def step(p, s):
        """The products of pair p into the s-th partial sums."""
        b = [builder.load(builder.bitcast(builder.gep(b_ptr, [builder.add(
            builder.mul(p, const(PANEL)), builder.mul(const(j), pstride))]), u32v.as_pointer()),
            align=4) for j in range(group)]
        for r in range(rows):
            at = (builder.add(builder.mul(p, lda), const(r)) if by_columns else
                  builder.add(builder.mul(const(r), lda), p))
            pair = builder.load(builder.gep(a_ptr, [at]))
            a_vec = builder.shuffle_vector(
                builder.insert_element(undef, pair, ir.Constant(u32, 0)), undef, splat)
            for j in range(group):
                builder.store(builder.call(dot, [builder.load(acc[r][j][s]), a_vec, b[j]]),
                              acc[r][j][s])

    rounds = builder.udiv(kp, const(split))
    with cgutils.for_range(builder, rounds) as loop:
        for s in range(split):
            step(builder.add(builder.mul(loop.index, const(split)), const(s)), s)
    tail = builder.mul(rounds, const(split))       # the kp % split left over
    with cgutils.for_range(builder, builder.sub(kp, tail)) as loop:
        step(builder.add(tail, loop.index), 0)
    for r in range(rows):
        for j in range(group):
            total = builder.load(acc[r][j][0])
            for s in range(1, split):
                total = builder.fadd(total, builder.load(acc[r][j][s]))
            builder.store(total, c_at(r, j), align=4)


def _suffix(by_columns, accumulate, biased=False):
    return "_bf16" + ("c" if by_columns else "") + ("a" if accumulate else "") + (
        "b" if biased else "")


def _emit_gemm(builder, a, lda, rows, panel, pstride, c, ldc, kp, *biased, npanels,
               by_columns, accumulate):
    """microkernel.emit_tiled_product over the bfloat16 tiles (the float32 tiles' shapes,
    4-byte elements); `biased`: as _emit_tile's."""
    suffix = _suffix(by_columns, accumulate, bool(biased))

    def tile(h, group):
        return _function(builder.module, f"fusedrnn_tile{h}x{group}{suffix}", a.type,
                         7 + len(biased),
                         functools.partial(_emit_tile, rows=h, group=group,
                                           by_columns=by_columns, accumulate=accumulate))
    emit_tiled_product(builder, a, lda, rows, panel, pstride, c, ldc, kp, npanels=npanels,
                       dtype=np.float32, itemsize=4, transposed=False, tile=tile,
                       a_by_columns=by_columns, bias=biased or None)


def _panel_gemm(by_columns, accumulate=False, biased=False):
    name = "panel_gemm_bf16" + ("_cols" if by_columns else "") + (
        "_bias" if biased else "") + ("_acc" if accumulate else "")

    def typed(a, lda, rows, panel, pstride, npanels, c, ldc, kp, *bias):
        count = panel_count(name, (a, lda, rows, panel, pstride, c, ldc, kp) + bias, npanels)
        if count is None:
            return None
        if not HAS_BF16:
            raise NotImplementedError(f"{name}: this CPU has no AVX512-BF16")
        integer = [i for i in range(9 + len(bias)) if i != 5]   # all but npanels

        def codegen(context, builder, signature, args):
            _link_helper(context)
            ints = [context.cast(builder, args[i], signature.args[i], types.intp)
                    for i in integer]
            fn = _function(builder.module,
                           f"fusedrnn_gemm{count}{_suffix(by_columns, accumulate, biased)}",
                           ints[0].type, len(ints), functools.partial(
                               _emit_gemm, npanels=count, by_columns=by_columns,
                               accumulate=accumulate))
            builder.call(fn, ints)
            return context.get_dummy_value()

        return types.void(a, lda, rows, panel, pstride, npanels, c, ldc, kp, *bias), codegen

    # (Numba's intrinsics take no *args: one typer per arity)
    if biased:
        def typer(typingctx, a, lda, rows, panel, pstride, npanels, c, ldc, kp, bias, bstride):
            return typed(a, lda, rows, panel, pstride, npanels, c, ldc, kp, bias, bstride)
    else:
        def typer(typingctx, a, lda, rows, panel, pstride, npanels, c, ldc, kp):
            return typed(a, lda, rows, panel, pstride, npanels, c, ldc, kp)
    typer.__name__ = name
    return intrinsic(typer)


panel_gemm_bf16 = _panel_gemm(False)
panel_gemm_bf16_cols = _panel_gemm(True)
panel_gemm_bf16_cols_acc = _panel_gemm(True, accumulate=True)
panel_gemm_bf16_bias = _panel_gemm(False, biased=True)


def pack_pairs(b):
    """B (K, C) as bfloat16 bits (uint16, or ml_dtypes.bfloat16) -> zero-padded panels
    (ceil(C/16), ceil(K/2), 16) uint32 (module docstring's layout)."""
    bits = np.asarray(b).view(np.uint16)
    K, C = bits.shape
    kp, count = -(-K // 2), -(-C // PANEL)
    padded = np.zeros((2 * kp, count * PANEL), np.uint16)
    padded[:K, :C] = bits
    # (kp, 2, count, 16) -> (count, kp, 16, 2): the pair of k adjacent, low half first
    pairs = padded.reshape(kp, 2, count, PANEL).transpose(2, 0, 3, 1)
    return np.ascontiguousarray(pairs).view(np.uint32).reshape(count, kp, PANEL)
