"""Moves of one block's row of up to 16 elements, as vector loads and stores.

The fused loops (fused.py) gather each step's inputs of a 16-unit block into its tile
and scatter the results back out: per sample, a handful of 16-element rows. Written
as Numba loops over u these compiled to scalar code (LLVM cannot prove that the tile
and the arrays do not overlap, so it neither vectorises nor reorders them), and cost
more than the cell math itself; as vector moves they cost a fraction of it.
Measured: bench/results/cpu-kernel-notes.md#rows-vector-row-moves

A whole row (width 16) is one vector load per operand and one vector store. A partial
block's row (the last block when H % 16 != 0) goes lane by lane, and lanes at or past
`width` are neither read nor written, so nothing past a row's end is touched. (Masked
vector moves did that in one instruction, but AMD's masked stores are microcoded, and
LLVM changed those intrinsics' signature between the versions Numba builds on.)

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
from numba.extending import intrinsic

__all__ = ["row_copy", "row_add", "row_add3"]

LANES = 16


def _emit(context, builder, signature, values):
    """The sum of rows values[1:-2] stored to values[0] (module docstring)."""
    single = signature.args[-1] == types.float32
    intp = context.get_value_type(types.intp)
    scalar = ir.FloatType() if single else ir.DoubleType()
    vec = ir.VectorType(scalar, LANES)
    address = [context.cast(builder, v, t, types.intp)
               for v, t in zip(values[:-2], signature.args[:-2])]
    width = context.cast(builder, values[-2], signature.args[-2], types.intp)
    full = builder.icmp_unsigned(">=", width, ir.Constant(intp, LANES))
    with builder.if_else(full, likely=True) as (whole, partial):
        with whole:     # the whole row: one vector per operand
            total = None
            for a in address[1:]:
                value = builder.load(builder.inttoptr(a, vec.as_pointer()), align=1)
                total = value if total is None else builder.fadd(total, value)
            builder.store(total, builder.inttoptr(address[0], vec.as_pointer()), align=1)
        with partial:   # a partial block's row: lane by lane, only below width
            for lane in range(LANES - 1):
                inside = builder.icmp_unsigned("<", ir.Constant(intp, lane), width)
                with builder.if_then(inside):
                    at = [builder.inttoptr(builder.add(a, ir.Constant(
                        intp, lane * (4 if single else 8))), scalar.as_pointer())
                        for a in address]
                    total = None
                    for ptr in at[1:]:
                        value = builder.load(ptr)
                        total = value if total is None else builder.fadd(total, value)
                    builder.store(total, at[0])
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
