"""fusedrnn.cpu.lowlevel.mathfn inside compiled code: fast_exp, sigmoid and tanh against float64
numpy over a dense grid and at special values (saturation, NaN, the clamp bounds), the
argument's precision kept (float32 in, float32 out), and a loop over a float32 array
compiled to packed SIMD instructions."""
import re

import llvmlite.binding as llvm
import numba as nb
import numpy as np
import pytest
from numba import types

from fusedrnn.cpu.lowlevel.mathfn import fast_exp, one_like, select, sigmoid, tanh, zero_like

# exp's documented normal range: 0 below LO, +inf above HI.
LO = {np.float32: np.float32(-87.3), np.float64: -708.0}
HI = {np.float32: np.float32(88.3), np.float64: 709.0}
# (exp's max relative error on its normal range, sigmoid's and tanh's max absolute error)
TOL = {np.float32: (2e-7, 2e-7), np.float64: (1e-15, 1e-15)}


def _apply(f):
    # error_model="numpy" as in the parallel kernels (Python's model tests each divisor).
    @nb.njit(error_model="numpy")
    def apply(x, out):
        for i in range(x.size):
            out[i] = f(x[i])
    return apply


APPLY = {f: _apply(f) for f in (fast_exp, sigmoid, tanh)}


def run(f, x):
    out = np.full_like(x, np.nan)
    APPLY[f](x, out)
    return out


def grid(dtype):
    lo, hi = float(LO[dtype]), float(HI[dtype])
    rng = np.random.default_rng(11)
    x = np.concatenate([
        np.linspace(-100, 100, 400_001), np.linspace(-1, 1, 200_001),
        rng.uniform(lo, hi, 200_000),            # the whole normal range of exp
        [np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30],
    ]).astype(dtype)
    # the clamp bounds and their neighbours on either side
    edges = [np.nextafter(dtype(b), dtype(s * np.inf)) for b in (lo, hi) for s in (-1, 1)]
    return np.concatenate([x, np.array(edges + [lo, hi], dtype)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_relative_error(dtype):
    x = grid(dtype)
    got, want = run(fast_exp, x).astype(np.float64), np.exp(x.astype(np.float64))
    for part in (np.abs(x) < 80, (x >= LO[dtype]) & (x <= HI[dtype])):  # and the whole range
        assert np.max(np.abs(got[part] - want[part]) / want[part]) <= TOL[dtype][0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("f, ref", [(sigmoid, lambda x: 1 / (1 + np.exp(-x))), (tanh, np.tanh)],
                         ids=["sigmoid", "tanh"])
def test_sigmoid_and_tanh_absolute_error(f, ref, dtype):
    x = grid(dtype)
    with np.errstate(over="ignore"):
        want = ref(x.astype(np.float64))
    assert np.max(np.abs(run(f, x).astype(np.float64) - want)) <= TOL[dtype][1]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_is_zero_below_and_inf_above_its_normal_range(dtype):
    lo, hi = LO[dtype], HI[dtype]
    below = np.array([np.nextafter(lo, dtype(-np.inf)), lo - 1, -1e4, -np.inf], dtype)
    above = np.array([np.nextafter(hi, dtype(np.inf)), hi + 1, 1e4, np.inf], dtype)
    assert np.array_equal(run(fast_exp, below), np.zeros_like(below))
    assert np.array_equal(run(fast_exp, above), np.full_like(above, np.inf))
    # (At lo and hi themselves exp is accurate: test_exp_relative_error's range.)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_saturation_and_special_values_are_exact(dtype):
    x = np.array([-np.inf, np.inf, 0.0, -0.0, np.nan], dtype)
    s, t, e = run(sigmoid, x), run(tanh, x), run(fast_exp, x)
    assert s[0] == 0 and s[1] == 1 and s[2] == s[3] == 0.5 and np.isnan(s[4])
    assert t[0] == -1 and t[1] == 1 and t[2] == t[3] == 0 and np.isnan(t[4])
    assert e[0] == 0 and e[1] == np.inf and e[2] == e[3] == 1 and np.isnan(e[4])
    # Far out the saturation is exact, not 1 - ulp: past the clamps (1e3), and where
    # the true value rounds to +-1 (tanh(100), exp(-200) inside float64's range).
    assert np.array_equal(run(sigmoid, np.array([-1e3, 1e3], dtype)), np.array([0, 1], dtype))
    assert np.array_equal(run(tanh, np.array([-1e3, 1e3, -100, 100], dtype)),
                          np.array([-1, 1, -1, 1], dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tanh_is_odd(dtype):
    x = np.linspace(0, 20, 10_001).astype(dtype)
    assert np.array_equal(run(tanh, -x), -run(tanh, x))


def _return_type(f, value):
    fn = nb.njit(lambda x: f(x))
    fn(value)
    (signature,) = fn.nopython_signatures
    return signature.return_type


@pytest.mark.parametrize("f", [fast_exp, sigmoid, tanh, one_like, zero_like])
@pytest.mark.parametrize("dtype, numba_type", [(np.float32, types.float32),
                                               (np.float64, types.float64)])
def test_result_keeps_the_arguments_precision(f, dtype, numba_type):
    assert _return_type(f, dtype(0.5)) == numba_type


@pytest.mark.parametrize("dtype, numba_type", [(np.float32, types.float32),
                                               (np.float64, types.float64)])
def test_zero_like_of_an_array_is_its_dtypes_zero(dtype, numba_type):
    assert _return_type(zero_like, np.ones(3, dtype)) == numba_type
    assert nb.njit(lambda x: zero_like(x))(np.ones(3, dtype)) == 0


def test_float32_expressions_stay_float32():
    """A float32 cell expression built with one_like keeps float32 (a bare 1.0 would
    promote it to float64)."""
    @nb.njit
    def cell(x):
        one = one_like(x)
        return (one - sigmoid(x)) * tanh(x) + zero_like(x)
    cell(np.float32(0.3))
    assert cell.nopython_signatures[0].return_type == types.float32


def _host_has_avx():
    # Numba compiles for the host CPU unless NUMBA_CPU_NAME names another one.
    if nb.config.CPU_NAME not in (None, "host"):
        return False
    llvm.initialize_native_target()
    return llvm.get_host_cpu_features().get("avx", False)


@pytest.mark.skipif(not _host_has_avx(), reason="packed-instruction check needs an AVX CPU "
                    "as the compile target")
@pytest.mark.parametrize("f", [tanh, sigmoid, fast_exp])
@pytest.mark.parametrize("dtype, suffix", [(np.float32, "ps"), (np.float64, "pd")])
def test_loop_over_array_vectorises(f, dtype, suffix):
    """floor (the range reduction) and, for tanh/sigmoid, the division appear as packed
    instructions: the loop vectoriser accepted the whole body (a scalar libm call or
    a branch it could not if-convert would leave only the ss/sd forms)."""
    fn = APPLY[f]
    x = np.linspace(-3, 3, 64).astype(dtype)
    run(f, x)
    (signature,) = [s for s in fn.signatures if s[0].dtype == nb.from_dtype(dtype)]
    asm = fn.inspect_asm(signature)
    # floor is round{suffix} with AVX/AVX2, rndscale{suffix} where LLVM targets AVX-512
    assert re.search(rf"\b(v?round|vrndscale){suffix}\b", asm), "floor not vectorised"
    if f is not fast_exp:
        assert re.search(rf"\bv?div{suffix}\b", asm), "division not vectorised"
    assert re.search(r"%[yz]mm\d|\b[yz]mm\d", asm), "no 256-bit (or wider) vectors"


@nb.njit
def _select_all(cond, a, b, out):
    for i in range(cond.size):
        out[i] = select(cond[i], a[i], b[i])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_select_is_the_conditional_expression(dtype):
    """select(c, a, b) == (a if c else b) element for element, NaN on either side kept,
    in the arguments' precision."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(64).astype(dtype)
    b = rng.standard_normal(64).astype(dtype)
    a[::7], b[3::5] = np.nan, np.nan
    cond = rng.random(64) < 0.5
    out = np.full(64, 7.0, dtype)
    _select_all(cond, a, b, out)
    want = np.array([x if c else y for c, x, y in zip(cond, a, b)], dtype)
    np.testing.assert_array_equal(out, want)   # NaN == NaN here


def test_select_of_two_precisions_is_float64_like_the_conditional():
    @nb.njit
    def pick(c, a, b):
        return select(c, a, b)
    assert pick(True, np.float32(1.5), 2.0) == 1.5 and pick(False, np.float32(1.5), 2.0) == 2.0
    pick(False, np.float32(1.5), np.float32(2.0))
    returns = {sig[1:]: pick.overloads[sig].signature.return_type for sig in pick.signatures}
    assert returns == {(types.float32, types.float64): types.float64,
                       (types.float32, types.float32): types.float32}
