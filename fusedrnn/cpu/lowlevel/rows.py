"""Moves of one block's row of up to 16 elements, and 16 rows' columns transposed (for the
packers), as vector loads and stores.

The fused loops (fused.py) gather a block's inputs into its tile and scatter results
out; as Numba loops these stayed scalar (LLVM cannot rule out overlap), dearer than the cell.
Measured: bench/results/cpu-kernel-notes.md#rows-vector-row-moves

A whole row is one vector load per operand and one store; a partial row (H % 16 != 0)
goes lane by lane, nothing past `width` touched (not masked: AMD microcodes those stores).

row_copy(dst, src, width, like)        dst[0:width] = src[0:width]
row_zero(dst, width, like)             dst[0:width] = 0
row_add(dst, a, b, width, like)        dst[0:width] = a[0:width] + b[0:width]
row_add3(dst, a, b, c, width, like)    dst[0:width] = a[0:width] + b[0:width] + c[0:width]
    dst, a, b, c   element addresses (integers) of 16-element rows, unit stride
    width          0..16: the elements moved
    like           any scalar of the data's dtype (float32 or float64): the precision;
                   row_copy and row_zero also move uint16 rows (bfloat16/float16 bits)
    All loads happen before the store, so dst may equal a source (an in-place add);
    partial overlap is not allowed.
row_round(dst, src, width)             dst[0:width] = src[0:width] rounded to bfloat16
    dst            address of a uint16 row (bfloat16 bits); src of a float32 row
    width          0..16
    Rounds as bf16gemm.bf16_bits (nearest even, NaN quiet): the bf16 layer's h_t, dg rows.
    Measured: bench/results/cpu-kernel-notes.md#bf16-rows-rounded-as-vectors
rows_to_columns(dst, ldd, src, lds, like)   dst[k * ldd + u] = src[u * lds + k]
    for u < 16, k < BLOCK_COLUMNS[itemsize] (a 256-bit vector of each row), float32 or
    float64 as `like`; ldd, lds row strides in elements; dst must not overlap src.
    Measured: bench/results/cpu-kernel-notes.md#packing-transposed-in-vectors
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["BLOCK_COLUMNS", "VECTOR_BYTES", "row_copy", "row_add", "row_add3", "row_round",
           "row_zero", "rows_to_columns"]

LANES = 16


def _element(like):
    """(LLVM element type, bytes) of the rows a `like` of this Numba type moves."""
    if like in (types.float32, types.float64):
        return (ir.FloatType() if like == types.float32 else ir.DoubleType()), like.bitwidth // 8
    if like in (types.uint16, types.int16):   # bfloat16/float16 bits (row_copy, row_zero)
        return ir.IntType(16), 2
    return None


def _emit(context, builder, signature, values):
    """The sum of rows values[1:-2] stored to values[0]; with no source (row_zero), zeros."""
    scalar, size = _element(signature.args[-1])
    intp = context.get_value_type(types.intp)
    vec = ir.VectorType(scalar, LANES)
    address = [context.cast(builder, v, t, types.intp)
               for v, t in zip(values[:-2], signature.args[:-2], strict=True)]
    width = context.cast(builder, values[-2], signature.args[-2], types.intp)

    def total(loads):
        out = None
        for value in loads:
            out = value if out is None else builder.fadd(out, value)
        return out
    full = builder.icmp_unsigned(">=", width, ir.Constant(intp, LANES))
    with builder.if_else(full, likely=True) as (whole, partial):
        with whole:     # the whole row: one vector per operand
            value = total(builder.load(builder.inttoptr(a, vec.as_pointer()), align=1)
                          for a in address[1:]) or ir.Constant(vec, None)
            builder.store(value, builder.inttoptr(address[0], vec.as_pointer()), align=1)
        with partial:   # a partial block's row: lane by lane, only below width
            for lane in range(LANES - 1):
                inside = builder.icmp_unsigned("<", ir.Constant(intp, lane), width)
                with builder.if_then(inside):
                    at = [builder.inttoptr(builder.add(a, ir.Constant(intp, lane * size)),
                                           scalar.as_pointer()) for a in address]
                    value = total(builder.load(ptr) for ptr in at[1:]) or ir.Constant(scalar,
                                                                                       None)
                    builder.store(value, at[0])
    return context.get_dummy_value()


def _typed(args, like, sums=True):
    """(signature, codegen) for integer addresses and width and a `like` these moves take
    (a float where they add); None for anything else."""
    if _element(like) is not None and (like in (types.float32, types.float64) or not sums) \
            and all(isinstance(a, types.Integer) for a in args):
        return types.void(*args, like), _emit
    return None


@intrinsic
def row_copy(typingctx, dst, src, width, like):
    return _typed((dst, src, width), like, sums=False)


@intrinsic
def row_zero(typingctx, dst, width, like):
    return _typed((dst, width), like, sums=False)


@intrinsic
def row_add(typingctx, dst, a, b, width, like):
    return _typed((dst, a, b, width), like)


@intrinsic
def row_add3(typingctx, dst, a, b, c, width, like):
    return _typed((dst, a, b, c, width), like)


def _bf16_bits(builder, bits, like):
    """bf16gemm.bf16_bits on i32 bits (a scalar, or a vector shaped as `like`)."""
    def const(value):
        i32 = ir.IntType(32)
        if isinstance(like, ir.VectorType):
            return ir.Constant(like, [value] * like.count)
        return ir.Constant(i32, value)
    high = builder.lshr(bits, const(16))
    nan = builder.icmp_unsigned(">", builder.and_(bits, const(0x7FFFFFFF)), const(0x7F800000))
    rounding = builder.add(const(0x7FFF), builder.and_(high, const(1)))
    rounded = builder.lshr(builder.add(bits, rounding), const(16))
    return builder.select(nan, builder.or_(high, const(0x40)), rounded)


def _emit_round(context, builder, signature, values):
    intp = context.get_value_type(types.intp)
    dst, src = (context.cast(builder, v, t, types.intp)
                for v, t in zip(values[:2], signature.args[:2], strict=True))
    width = context.cast(builder, values[2], signature.args[2], types.intp)
    i16, i32 = ir.IntType(16), ir.IntType(32)
    full = builder.icmp_unsigned(">=", width, ir.Constant(intp, LANES))
    with builder.if_else(full, likely=True) as (whole, partial):
        with whole:
            vec = ir.VectorType(i32, LANES)
            bits = builder.load(builder.inttoptr(src, vec.as_pointer()), align=1)
            out = builder.trunc(_bf16_bits(builder, bits, vec), ir.VectorType(i16, LANES))
            builder.store(out, builder.inttoptr(dst, ir.VectorType(i16, LANES).as_pointer()),
                          align=1)
        with partial:   # lane by lane, only below width (module docstring)
            for lane in range(LANES - 1):
                inside = builder.icmp_unsigned("<", ir.Constant(intp, lane), width)
                with builder.if_then(inside):
                    bits = builder.load(builder.inttoptr(
                        builder.add(src, ir.Constant(intp, 4 * lane)), i32.as_pointer()))
                    builder.store(builder.trunc(_bf16_bits(builder, bits, i32), i16),
                                  builder.inttoptr(builder.add(dst, ir.Constant(intp, 2 * lane)),
                                                   i16.as_pointer()))
    return context.get_dummy_value()


@intrinsic
def row_round(typingctx, dst, src, width):
    if all(isinstance(a, types.Integer) for a in (dst, src, width)):
        return types.void(dst, src, width), _emit_round
    return None


# Columns rows_to_columns moves per call, by element size: one 256-bit vector of each row.
VECTOR_BYTES = 32
BLOCK_COLUMNS = {size: VECTOR_BYTES // size for size in (4, 8)}


def _interleave(builder, a, b, high):
    """a's and b's lanes alternating, from their low (or high) halves."""
    lanes = a.type.count
    base = lanes // 2 if high else 0
    mask = [lane for i in range(lanes // 2) for lane in (base + i, lanes + base + i)]
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                                                    mask))


def _emit_transpose(context, builder, signature, values):
    scalar, size = _element(signature.args[-1])
    lanes = BLOCK_COLUMNS[size]
    vec = ir.VectorType(scalar, lanes)
    dst, ldd, src, lds = (context.cast(builder, v, t, types.intp)
                          for v, t in zip(values[:4], signature.args[:4], strict=True))
    intp = dst.type

    def address(base, row, stride, column):
        at = builder.add(builder.mul(ir.Constant(intp, row), stride), ir.Constant(intp, column))
        return builder.inttoptr(builder.add(base, builder.mul(at, ir.Constant(intp, size))),
                                vec.as_pointer())
    for first in range(0, LANES, lanes):   # a square of `lanes` rows at a time
        rows = [builder.load(address(src, first + i, lds, 0), align=1) for i in range(lanes)]
        # log2(lanes) rounds of pairing row i with row i + lanes/2 transpose the square
        for _ in range(lanes.bit_length() - 1):
            half = lanes // 2
            rows = [_interleave(builder, rows[i], rows[i + half], high)
                    for i in range(half) for high in (False, True)]
        for k in range(lanes):
            builder.store(rows[k], address(dst, k, ldd, first), align=1)
    return context.get_dummy_value()


@intrinsic
def rows_to_columns(typingctx, dst, ldd, src, lds, like):
    if like in (types.float32, types.float64) and all(
            isinstance(a, types.Integer) for a in (dst, ldd, src, lds)):
        return types.void(dst, ldd, src, lds, like), _emit_transpose
    return None
