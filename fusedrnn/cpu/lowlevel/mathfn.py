"""exp, sigmoid and tanh that LLVM can vectorise, for the CPU cell kernels.

Numba lowers math.exp / math.tanh to scalar libm calls (no SVML in its builds), which stop
the loop vectoriser; these are arithmetic, a bit-cast and selects in the argument's precision:

    exp      Cody-Waite reduction x = n*ln2 + r, |r| <= ln2/2, a Taylor polynomial in r
             (degree 7 for float32, 12 for float64: truncation below half an ulp) on FMAs
             (_fma), scaled by 2**n from its exponent bits. float32's error: 0.91 ulp.
             Measured: bench/results/cpu-kernel-notes.md#cells-exp-on-fmas
    sigmoid  1 / (1 + exp(-x)): no cancellation, relative error ~2 ulp.
    tanh     sign(x) * (1 - e) / (1 + e), e = exp(-2|x|): absolute error ~2 ulp of 1
             (the cells' tolerances are absolute, as for every float32 tanh from exp).

Below exp's normal range (x < -87.3 in float32, -708 in float64) it is 0, above it (88.3,
709) +inf: sigmoid and tanh saturate exactly; NaN propagates. They inline at Numba's level
(inline="always"), so a cell loop holds the whole computation; select is a builtin.
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, lower_builtin, overload, type_callable

__all__ = ["fast_exp", "sigmoid", "tanh", "one_like", "select", "zero_like"]

_F32 = {
    "log2e": np.float32(1.4426950408889634), "ln2_hi": np.float32(0.693359375),
    "ln2_lo": np.float32(-2.12194440e-4), "lo": np.float32(-87.3), "hi": np.float32(88.3),
    "one": np.float32(1.0), "two": np.float32(2.0), "half": np.float32(0.5),
    "zero": np.float32(0.0), "inf": np.float32(np.inf),
}
_F64 = {
    "log2e": 1.4426950408889634, "ln2_hi": 0.6931471803691238,
    "ln2_lo": 1.9082149292705877e-10, "lo": -708.0, "hi": 709.0,
    "one": 1.0, "two": 2.0, "half": 0.5, "zero": 0.0, "inf": math.inf,
}
# 1/k! as each precision's constants, highest power first (Horner order).
_TAYLOR32 = tuple(np.float32(1.0 / math.factorial(k)) for k in range(7, -1, -1))
_TAYLOR64 = tuple(1.0 / math.factorial(k) for k in range(12, -1, -1))


@intrinsic
def _pow2(typingctx, n, like):
    """2.0**n for an integer-valued float n in the normal range, as like's type."""
    float_type = like

    def codegen(context, builder, signature, args):
        value = args[0]
        if float_type == types.float32:
            bits, mantissa, bias, out = ir.IntType(32), 23, 127, ir.FloatType()
        else:
            bits, mantissa, bias, out = ir.IntType(64), 52, 1023, ir.DoubleType()
        as_int = builder.fptosi(value, bits)
        biased = builder.add(as_int, ir.Constant(bits, bias))
        return builder.bitcast(builder.shl(biased, ir.Constant(bits, mantissa)), out)

    return float_type(n, like), codegen


def select(cond, a, b):
    """a if cond else b without a branch (a conditional's branches kept cell loops scalar).
    Measured: bench/results/cpu-kernel-notes.md#fused-vectorising-the-cell-loops"""
    return a if cond else b


def _select_type(cond, a, b):
    """select's result type: the wider of two floats, as Python's conditional; else None."""
    floats = (types.float32, types.float64)
    if not (isinstance(cond, types.Boolean) and a in floats and b in floats):
        return None
    return types.float64 if types.float64 in (a, b) else types.float32


@type_callable(select)   # bench/results/cpu-kernel-notes.md#first-use-select-as-a-builtin
def _select_typer(context):
    return _select_type


@lower_builtin(select, types.Boolean, types.Float, types.Float)
def _select_lower(context, builder, signature, args):
    result = signature.return_type
    a_value = context.cast(builder, args[1], signature.args[1], result)
    b_value = context.cast(builder, args[2], signature.args[2], result)
    return builder.select(args[0], a_value, b_value)


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c as `llvm.fmuladd`: an FMA where the CPU has one (Numba itself emits two)."""
    if not (a == b == c and a in (types.float32, types.float64)):
        return None

    def codegen(context, builder, signature, args):
        t = args[0].type
        name = "llvm.fmuladd.f32" if a == types.float32 else "llvm.fmuladd.f64"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t, t]), name)
        return builder.call(fn, list(args))

    return a(a, b, c), codegen


def _make_exp(c, taylor):
    log2e, ln2_hi, ln2_lo, lo, hi, half, zero, inf = (
        c[k] for k in ("log2e", "ln2_hi", "ln2_lo", "lo", "hi", "half", "zero", "inf"))
    ln2_hi, ln2_lo = -ln2_hi, -ln2_lo   # (negated here: r = x - n*ln2 as two FMAs)

    def exp_impl(x):
        # NaN fails every comparison and flows through the arithmetic.
        xc = select(x < lo, lo, select(x > hi, hi, x))
        n = np.floor(_fma(xc, log2e, half))
        r = _fma(n, ln2_lo, _fma(n, ln2_hi, xc))
        p = taylor[0]
        for k in nb.literal_unroll(taylor[1:]):
            p = _fma(p, r, k)
        y = p * _pow2(n, xc)
        return select(x < lo, zero, select(x > hi, inf, y))
    return exp_impl


def fast_exp(x):
    """exp(x) (Python fallback; compiled code uses the overload below)."""
    return math.exp(x)


@overload(fast_exp, inline="always")
def _fast_exp_overload(x):
    if x == types.float32:
        return _make_exp(_F32, _TAYLOR32)
    if x == types.float64:
        return _make_exp(_F64, _TAYLOR64)
    return None


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


@overload(sigmoid, inline="always")
def _sigmoid_overload(x):
    if x not in (types.float32, types.float64):
        return None
    one = _F32["one"] if x == types.float32 else 1.0

    def impl(x):
        return one / (one + fast_exp(-x))
    return impl


def tanh(x):
    return math.tanh(x)


@overload(tanh, inline="always")
def _tanh_overload(x):
    if x not in (types.float32, types.float64):
        return None
    c = _F32 if x == types.float32 else _F64
    one, two, zero = c["one"], c["two"], c["zero"]

    def impl(x):
        e = fast_exp(-two * abs(x))
        t = (one - e) / (one + e)
        return select(x < zero, -t, t)
    return impl


def one_like(x):
    """1 in x's precision (a bare literal 1 would promote float32 arithmetic to float64)."""
    return 1.0


@overload(one_like)
def _one_like_overload(x):
    one = _F32["one"] if x == types.float32 else 1.0
    return lambda x: one


def zero_like(x):
    """0 in x's precision (x a float, or an array: its dtype's)."""
    return 0.0


@overload(zero_like)
def _zero_like_overload(x):
    kind = x.dtype if isinstance(x, types.Array) else x
    zero = _F32["zero"] if kind == types.float32 else 0.0
    return lambda x: zero
