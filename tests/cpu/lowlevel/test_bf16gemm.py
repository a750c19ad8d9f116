"""fusedrnn.cpu.lowlevel.bf16gemm: the bfloat16 rounding against ml_dtypes' (NaN, the
infinities, -0, overflow, ties, the odd-K pad), the packers against bf16.pack_pairs's
layout, and the input projection and the by-columns product (the weight gradients')
against float64 on the same bfloat16 values, serial and parallel builds, with a partial
last panel and several row chunks. The packers and the
rounding are plain Numba; the projection needs AVX512-BF16 (skipped, saying so, where the
CPU lacks it, as test_bf16.py's tile)."""
import ml_dtypes
import numpy as np
import pytest

from fusedrnn.cpu import lowlevel
from fusedrnn.cpu.lowlevel import CHUNK, PANEL
from fusedrnn.cpu.lowlevel.bf16gemm import K_BLOCK

# every test on both builds of each kernel (conftest.lowlevel_builds)
pytestmark = pytest.mark.usefixtures("lowlevel_builds")

BF16 = np.dtype(ml_dtypes.bfloat16)
needs_bf16 = pytest.mark.skipif(not lowlevel.HAS_BF16, reason="the CPU has no AVX512-BF16")


def exact(shape, rng, scale=1.0):
    """float32 values that are exact bfloat16s."""
    return (scale * rng.standard_normal(shape)).astype(BF16).astype(np.float32)


@pytest.mark.parametrize("K", [1, 11, 12])
@pytest.mark.parametrize("M", [3, 700])
def test_round_rows_equals_ml_dtypes(M, K):
    rng = np.random.default_rng(M + K)
    src = rng.standard_normal((M, K)).astype(np.float32) * 10.0 ** rng.integers(-40, 39, (M, K))
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 3.4e38, 1.0 + 2.0 ** -8,
                         1.0 + 3 * 2.0 ** -8, 1e-45], np.float32)
    src.reshape(-1)[:min(src.size, specials.size)] = specials[:src.size]
    dst = np.full((M, 2 * -(-K // 2)), 0x7777, np.uint16)
    lowlevel.round_rows(src, dst)
    want = src.astype(BF16)
    got = dst[:, :K].view(BF16)
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    assert (dst[:, K:] == 0).all()


def unpack(panels, rows):
    """(count, kp, 16) uint32 pairs -> the float32 matrix (2*kp, count*16) they hold."""
    count, kp, _ = panels.shape
    bits = panels.view(np.uint16).reshape(count, kp, PANEL, 2).transpose(1, 3, 0, 2)
    return (bits.reshape(2 * kp, count * PANEL).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("gates,H,K", [(4, 37, 23), (1, 16, 8), (3, 800, 801)])
def test_pack_recurrent_pairs(gates, H, K):
    rng = np.random.default_rng(H)
    w = exact((gates * H, K), rng)
    B, kp = -(-H // PANEL), -(-K // 2)
    out = np.full((B, gates, kp, PANEL), 0xDEADBEEF, np.uint32)
    lowlevel.pack_recurrent_pairs(w, gates, out)
    for g in range(gates):
        assert np.array_equal(out[:, g], lowlevel.pack_pairs(w[g * H:(g + 1) * H].T.astype(BF16)))
        got = unpack(out[:, g], H)
        assert np.array_equal(got[:K, :H], w[g * H:(g + 1) * H].T)
        assert (got[K:] == 0).all() and (got[:, H:] == 0).all()


@pytest.mark.parametrize("rows,K", [(37, 23), (800, 64)])
def test_pack_input_pairs_concatenates_directions(rows, K):
    rng = np.random.default_rng(rows)
    ws = [exact((rows, K), rng), exact((rows, K), rng)]
    P, kp = -(-2 * rows // PANEL), -(-K // 2)
    out = np.full((P, kp, PANEL), 0xDEADBEEF, np.uint32)
    lowlevel.pack_input_pairs(ws, out)
    assert np.array_equal(out, lowlevel.pack_pairs(np.concatenate(ws).T.astype(BF16)))
    with pytest.raises(ValueError, match="cannot hold"):
        lowlevel.pack_input_pairs(ws, out[:-1])


@needs_bf16
# (the last two: a k longer than the by-columns form's K_BLOCK, which A by rows takes in
# one pass)
@pytest.mark.parametrize("M,K,C", [(5, 8, 16), (3 * CHUNK + 7, 64, 70), (2000, 800, 3200),
                                   (3 * CHUNK + 7, 2 * 2 * K_BLOCK + 6, 70),
                                   (40, 2 * K_BLOCK + 2, 24)])
def test_project_bf16_against_float64(M, K, C):
    rng = np.random.default_rng(M)
    a = exact((M, K), rng).astype(BF16)
    w = exact((C, K), rng, 0.05)
    P = -(-C // PANEL)
    wpack = np.empty((P, K // 2, PANEL), np.uint32)
    lowlevel.pack_input_pairs([w], wpack)
    c = np.full((M, C), np.nan, np.float32)
    spill = np.empty((-(-M // CHUNK), CHUNK, PANEL), np.float32)
    lowlevel.project_bf16(a.view(np.uint32), wpack, c, spill)
    want = a.astype(np.float64) @ w.astype(np.float64).T
    # products of bfloat16s are exact in float32; only the float32 sums round
    assert np.max(np.abs(c - want)) <= 4 * K * 2.0 ** -24 * np.max(np.abs(a).astype(
        np.float64) @ np.abs(w).astype(np.float64).T)


def strided(values, rng):
    """`values` (K, M) as a column block of a wider array (unit column stride, a longer
    row stride), as the backward's dG columns of one direction arrive."""
    K, M = values.shape
    wide = rng.standard_normal((K, M + 5)).astype(np.float32)
    wide[:, 2:M + 2] = values
    return wide[:, 2:M + 2]


@pytest.mark.parametrize("K,M", [(7, 5), (6, 33), (1200, 700)])   # odd K
def test_interleave_rows_pairs_row_2p_with_2p_plus_1(K, M):
    rng = np.random.default_rng(K + M)
    src = strided(rng.standard_normal((K, M)).astype(np.float32), rng)
    kp = -(-K // 2)
    dst = np.full((kp, M), 0xDEADBEEF, np.uint32)
    lowlevel.interleave_rows(src, dst)
    halves = dst.view(np.uint16).reshape(kp, M, 2)          # (low, high) of each pair
    want = np.zeros((2 * kp, M), np.uint16)
    want[:K] = src.astype(BF16).view(np.uint16)
    assert np.array_equal(halves[:, :, 0], want[0::2]) and np.array_equal(halves[:, :, 1],
                                                                          want[1::2])
    with pytest.raises(ValueError, match="does not fit"):
        lowlevel.interleave_rows(src, dst[:, 1:])


@pytest.mark.parametrize("K,C", [(7, 5), (6, 33), (1200, 700)])
def test_pack_k_pairs_is_pack_pairs_of_the_rounded_matrix(K, C):
    rng = np.random.default_rng(K * C)
    src = strided(rng.standard_normal((K, C)).astype(np.float32), rng)
    out = np.full((-(-C // PANEL), -(-K // 2), PANEL), 0xDEADBEEF, np.uint32)
    lowlevel.pack_k_pairs(src, out)
    assert np.array_equal(out, lowlevel.pack_pairs(src.astype(BF16)))
    with pytest.raises(ValueError, match="does not fit"):
        lowlevel.pack_k_pairs(src, out[:, 1:])


@needs_bf16
@pytest.mark.parametrize("K,M,C", [(7, 5, 3), (301, 3 * CHUNK + 7, 70), (6000, 800, 256),
                                   # k in two K_BLOCKs and a bit, the later ones added
                                   # to C (the partial last panel's spill too)
                                   (4 * K_BLOCK + 1, 2 * CHUNK + 3, 40)])
def test_project_bf16_by_columns_is_a_transposed_product(K, M, C):
    """A^T @ B with A (K, M) interleaved by rows (the weight gradients' dG^T @ X)."""
    rng = np.random.default_rng(K + M + C)
    a, b = exact((K, M), rng), exact((K, C), rng, 0.05)
    kp = -(-K // 2)
    a_pairs = lowlevel.interleave_rows(a, np.empty((kp, M), np.uint32))
    b_pairs = lowlevel.pack_k_pairs(b, np.empty((-(-C // PANEL), kp, PANEL), np.uint32))
    c = np.full((M, C), np.nan, np.float32)
    spill = np.empty((-(-M // CHUNK), CHUNK, PANEL), np.float32)
    lowlevel.project_bf16(a_pairs, b_pairs, c, spill, by_columns=True)
    want = a.T.astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(c - want)) <= 4 * K * 2.0 ** -24 * np.max(
        np.abs(a.T).astype(np.float64) @ np.abs(b).astype(np.float64))
    with pytest.raises(ValueError, match="do not fit"):
        lowlevel.project_bf16(a_pairs, b_pairs, c[:-1], spill, by_columns=True)


def test_pack_k_pairs_takes_bfloat16_bits_as_they_are():
    """A bfloat16 src (a training's data, read in place) packs to the same pairs as its
    float32 values."""
    rng = np.random.default_rng(11)
    src = exact((9, 37), rng)
    want = lowlevel.pack_k_pairs(src, np.empty((3, 5, PANEL), np.uint32))
    got = lowlevel.pack_k_pairs(src.astype(BF16), np.full((3, 5, PANEL), 7, np.uint32))
    assert np.array_equal(got, want)
