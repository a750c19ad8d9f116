"""Moves of one block's row of up to 16 elements, as vector loads and stores.

The fused loops (fused.py) gather each step's inputs of a 16-unit block into its tile
and scatter the results back out: per sample, a handful of 16-element rows. Written
as Numba loops over u these compiled to scalar code (LLVM cannot prove that the tile
and the arrays do not overlap, so it neither vectorises nor reorders them), and cost
more than the cell math itself. Measured on the 2-core machine, T=300 N=20 I=H=800
float32, the forward loop without its gather and scatter against the whole: rnn_relu
59.7 against 109 ms, GRU 180 against 260 ms, LSTM 252 against 308 ms (the GEMM part
alone: 76, 200 ms for rnn_relu, LSTM). With these moves, the loops alone, element-wise
kernels against these in one process, median of 11 interleaved (bitwise equal results):
    forward, float32   rnn_relu 97.8 -> 84.3 ms, GRU 241 -> 226, LSTM 327 -> 316
      with the record  rnn_relu 110 -> 97, GRU 256 -> 242, LSTM 375 -> 314
    forward, float64   GRU 1787 -> 776 ms (1975 -> 876 with the record); LSTM, tanh level
    backward, float32  rnn_relu 127 -> 108 ms, GRU 238 -> 214, LSTM 312 -> 289
    backward, float64  level (LSTM 1157 / 1196, GRU 1032 / 1011)

Each move is one masked vector load per operand and one masked store (AVX2 vmaskmov):
lanes at or past `width` are neither read nor written, so a partial last block
(H % 16 != 0) needs no scalar tail and never touches memory past a row's end.

row_copy(dst, src, width, like)        dst[0:width] = src[0:width]
row_add(dst, a, b, width, like)        dst[0:width] = a[0:width] + b[0:width]
row_add3(dst, a, b, c, width, like)    dst[0:width] = a[0:width] + b[0:width] + c[0:width]
    dst, a, b, c   element addresses (integers) of 16-element rows, unit stride
    width          0..16: the elements moved
    like           any scalar of the data's dtype (float32 or float64): the precision
    All loads happen before the store, so dst may equal a source (an in-place add);
    partial overlap is not allowed.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["row_copy", "row_add", "row_add3"]

LANES = 16


def _emit(context, builder, signature, values):
    """The masked sum of rows values[1:-2] stored to values[0] (module docstring)."""
    single = signature.args[-1] == types.float32
    intp = context.get_value_type(types.intp)
    scalar = ir.FloatType() if single else ir.DoubleType()
    vec = ir.VectorType(scalar, LANES)
    ptr, mask_type = vec.as_pointer(), ir.VectorType(ir.IntType(1), LANES)
    name = f"v{LANES}{'f32' if single else 'f64'}"
    load = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vec, [ptr, ir.IntType(32), mask_type, vec]),
        f"llvm.masked.load.{name}.p0")
    store = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [vec, ptr, ir.IntType(32), mask_type]),
        f"llvm.masked.store.{name}.p0")
    address = [context.cast(builder, v, t, types.intp)
               for v, t in zip(values[:-2], signature.args[:-2])]
    width = context.cast(builder, values[-2], signature.args[-2], types.intp)
    lane_index = ir.Constant(ir.VectorType(intp, LANES), list(range(LANES)))
    splat = builder.insert_element(ir.Constant(ir.VectorType(intp, LANES), ir.Undefined),
                                   width, ir.Constant(ir.IntType(32), 0))
    splat = builder.shuffle_vector(splat, splat, ir.Constant(
        ir.VectorType(ir.IntType(32), LANES), [0] * LANES))
    mask = builder.icmp_unsigned("<", lane_index, splat)
    align, zero = ir.Constant(ir.IntType(32), 1), ir.Constant(vec, None)
    full = builder.icmp_unsigned(">=", width, ir.Constant(intp, LANES))
    with builder.if_else(full, likely=True) as (whole, partial):
        with whole:     # plain loads and stores: AMD's masked stores are microcoded
            total = None
            for a in address[1:]:
                value = builder.load(builder.inttoptr(a, ptr), align=1)
                total = value if total is None else builder.fadd(total, value)
            builder.store(total, builder.inttoptr(address[0], ptr), align=1)
        with partial:
            total = None
            for a in address[1:]:
                value = builder.call(load, [builder.inttoptr(a, ptr), align, mask, zero])
                total = value if total is None else builder.fadd(total, value)
            builder.call(store, [total, builder.inttoptr(address[0], ptr), align, mask])
    return context.get_dummy_value()


def _typed(args, like):
    """(signature, codegen) for integer addresses and width and a float `like`; None
    (no match) for anything else."""
    if like in (types.float32, types.float64) and all(
            isinstance(a, types.Integer) for a in args):
        return types.void(*args, like), _emit
    return None


@intrinsic
def row_copy(typingctx, dst, src, width, like):
    return _typed((dst, src, width), like)


@intrinsic
def row_add(typingctx, dst, a, b, width, like):
    return _typed((dst, a, b, width), like)


@intrinsic
def row_add3(typingctx, dst, a, b, c, width, like):
    return _typed((dst, a, b, c, width), like)
