"""fusedrnn.cpu.lowlevel.float16: the float16 <-> float32 conversions against numpy's
(every float16; float32s across the whole range, the rounding ties, the overflow
threshold, subnormals, NaN and the infinities), serial and parallel builds; and the
input projection that widens half-precision rows in place against float64 on the same
values (float16 and bfloat16 rows, several chunks, a partial last chunk and panel)."""
import ml_dtypes
import numpy as np
import pytest

from fusedrnn.cpu import lowlevel
from fusedrnn.cpu.lowlevel import CHUNK, PANEL

# every test on both builds of each kernel (conftest.lowlevel_builds)
pytestmark = pytest.mark.usefixtures("lowlevel_builds")

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_widen_is_exact_for_every_float16():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    for n in (1000, bits.size):
        got = np.full(n, np.nan, np.float32)
        lowlevel.widen_f16(bits[:n], got)
        want = bits[:n].view(np.float16).astype(np.float32)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
        assert np.array_equal(np.signbit(got[nan]), np.signbit(want[nan]))


def _specials():
    top = np.float32(65504.0)
    edges = [0.0, -0.0, np.inf, -np.inf, np.nan, top, np.nextafter(top, np.float32(np.inf)),
             65519.996, 65520.0, 65536.0, 3.4e38, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25,
             3 * 2.0 ** -26, np.nextafter(np.float32(2.0 ** -25), np.float32(1)), 1e-45,
             2.0 ** -14 - 2.0 ** -25, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -10,
             2049.0, 2051.0]
    values = np.array(edges, np.float32)
    return np.concatenate([values, -values])


@pytest.mark.parametrize("stride", [104729, 4099])
def test_narrow_rounds_as_numpy(stride):
    sample = np.arange(0, 1 << 32, stride, dtype=np.uint64).astype(np.uint32).view(np.float32)
    src = np.concatenate([_specials(), sample])
    got = np.full(src.size, 0x7777, np.uint16)
    lowlevel.narrow_f16(src, got)
    with np.errstate(over="ignore", invalid="ignore"):
        want = src.astype(np.float16).view(np.uint16)
    nan = np.isnan(src)
    assert np.array_equal(got[~nan], want[~nan])
    # a NaN stays a NaN (all-ones exponent, nonzero mantissa), its sign kept
    assert ((got[nan] & 0x7C00) == 0x7C00).all() and (got[nan] & 0x3FF).all()
    assert np.array_equal(got[nan] >> 15, np.signbit(src[nan]).astype(np.uint16))


def _project_case(M, K, C, half, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, K)).astype(half)
    w = rng.standard_normal((C, K)).astype(np.float32)
    wpack = np.full((-(-C // PANEL), K, PANEL), np.nan, np.float32)
    lowlevel.pack_input_weights([w], wpack)
    want = a.astype(np.float64) @ w.astype(np.float64).T
    return a, wpack, want


@pytest.mark.parametrize("half", [np.dtype(np.float16), BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("M,K,C,workers", [(7, 5, 20, 2), (CHUNK * 3 + 5, 33, 72, 2),
                                           (CHUNK * 5, 64, 256, 3), (CHUNK * 2, 130, 48, 1)])
def test_project_widened_against_float64(half, M, K, C, workers):
    a, wpack, want = _project_case(M, K, C, half, M + K + C)
    c = np.full((M, C), np.nan, np.float32)
    spill = np.full((-(-M // CHUNK), CHUNK, PANEL), np.nan, np.float32)
    block = np.full((workers, CHUNK, K), np.nan, np.float32)
    lowlevel.project_widened(np.ascontiguousarray(a).view(np.uint16), half == BF16, wpack, c,
                             spill, block)
    # float32 sums of exact products: K * 2^-24 relative to the sum of |terms|
    scale = np.abs(a.astype(np.float64)) @ np.abs(wpack_matrix(wpack, C, K)).T
    assert np.all(np.abs(c - want) <= K * 2.0 ** -24 * scale + 1e-30)


def wpack_matrix(wpack, C, K):
    return wpack.transpose(0, 2, 1).reshape(-1, K)[:C].astype(np.float64)


def test_project_widened_refuses_what_does_not_fit():
    a, wpack, _ = _project_case(10, 8, 16, np.dtype(np.float16), 0)
    c = np.empty((10, 16), np.float32)
    spill = np.empty((1, CHUNK, PANEL), np.float32)
    with pytest.raises(ValueError, match="block"):
        lowlevel.project_widened(a.view(np.uint16), False, wpack, c, spill,
                                 np.empty((2, CHUNK, 9), np.float32))
    with pytest.raises(ValueError, match="uint16"):
        lowlevel.project_widened(a.astype(np.float32), False, wpack, c, spill,
                                 np.empty((2, CHUNK, 8), np.float32))
