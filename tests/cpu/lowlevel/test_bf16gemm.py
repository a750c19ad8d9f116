"""fusedrnn.cpu.lowlevel.bf16gemm: the bfloat16 rounding against ml_dtypes' (NaN, the
infinities, -0, overflow, ties, the odd-K pad), both packers against bf16.pack_pairs's
layout, and the input projection against float64 on the same bfloat16 values, serial and
parallel builds, with a partial last panel and several row chunks. The packers and the
rounding are plain Numba; the projection needs AVX512-BF16 (skipped, saying so, where the
CPU lacks it, as test_bf16.py's tile)."""
import ml_dtypes
import numpy as np
import pytest

from fusedrnn.cpu import lowlevel
from fusedrnn.cpu.lowlevel import CHUNK, PANEL

BF16 = np.dtype(ml_dtypes.bfloat16)
needs_bf16 = pytest.mark.skipif(not lowlevel.HAS_BF16, reason="the CPU has no AVX512-BF16")


def exact(shape, rng, scale=1.0):
    """float32 values that are exact bfloat16s."""
    return (scale * rng.standard_normal(shape)).astype(BF16).astype(np.float32)


@pytest.mark.parametrize("K", [1, 11, 12])
@pytest.mark.parametrize("M", [3, 700])   # serial and parallel builds
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
@pytest.mark.parametrize("M,K,C", [(5, 8, 16), (3 * CHUNK + 7, 64, 70), (2000, 800, 3200)])
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
