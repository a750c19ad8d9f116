"""fusedrnn.cpu.lowlevel.bf16: the AVX512-BF16 tile (vdpbf16ps) against float64 on the
same bfloat16 inputs, for every row count up to two tiles and 20, 1-5 panels (groups of
up to four), odd and even K, with a row stride of A wider than its pairs and a
NaN-poisoned C whose padding columns must stay untouched; pack_pairs' layout; and the
instruction in the compiled code. On a CPU without AVX512-BF16 the tile cannot be
built: the tests say so by skipping, and the intrinsic refuses (NotImplementedError)."""
import functools

import numba as nb
import numpy as np
import pytest

from fusedrnn.cpu import lowlevel as bf16  # HAS_BF16, pack_pairs, panel_gemm_bf16
from fusedrnn.cpu.lowlevel import PANEL

needs_bf16 = pytest.mark.skipif(not bf16.HAS_BF16, reason="the CPU has no AVX512-BF16")
A_PAD, C_PAD = 3, 5   # extra uint32 pairs per row of A; extra columns of C


def to_bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), rounded to nearest even (no NaN inputs here)."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


@functools.cache
def driver(npanels):
    @nb.njit
    def run(a, lda, rows, panels, c):
        bf16.panel_gemm_bf16(a.ctypes.data, lda, rows, panels.ctypes.data,
                             panels.shape[1] * PANEL, npanels, c.ctypes.data, c.shape[1],
                             panels.shape[1])
    return run


@needs_bf16
@pytest.mark.parametrize("npanels", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("K", [1, 2, 7, 64])
@pytest.mark.parametrize("rows", [*range(1, 17), 20])
def test_bf16_tile_matches_float64(rows, K, npanels):
    rng = np.random.default_rng([rows, K, npanels])
    a_bits = to_bf16_bits(rng.standard_normal((rows, K)))
    b_bits = to_bf16_bits(rng.standard_normal((K, npanels * PANEL)))
    kp = -(-K // 2)
    a_rows = np.zeros((rows, 2 * (kp + A_PAD)), np.uint16)
    a_rows[:, :K] = a_bits
    a_rows[:, 2 * kp:] = 0x7FC0                      # NaN past the pairs: never read
    panels = bf16.pack_pairs(b_bits)
    c = np.full((rows, npanels * PANEL + C_PAD), np.nan, np.float32)
    driver(npanels)(a_rows.view(np.uint32), kp + A_PAD, rows, panels, c)
    want = from_bf16_bits(a_bits).astype(np.float64) @ from_bf16_bits(b_bits).astype(np.float64)
    # Products of bfloat16 values are exact in float32; only the float32 sums round.
    assert np.max(np.abs(c[:, :npanels * PANEL] - want)) <= 1e-6 * K * max(1, np.max(np.abs(want)))
    assert np.isnan(c[:, npanels * PANEL:]).all(), "padding columns of C were written"


@functools.cache
def biased_driver(npanels):
    @nb.njit
    def run(a, lda, rows, panels, c, bias):
        bf16.panel_gemm_bf16_bias(a.ctypes.data, lda, rows, panels.ctypes.data,
                                  panels.shape[1] * PANEL, npanels, c.ctypes.data, c.shape[1],
                                  panels.shape[1], bias.ctypes.data, bias.shape[1])
    return run


@needs_bf16
@pytest.mark.parametrize("npanels", [1, 2, 4, 5])
@pytest.mark.parametrize("rows", [1, 5, 7, 20])
def test_biased_tile_starts_from_each_panels_bias_row(rows, npanels):
    """panel_gemm_bf16_bias: C = A @ B + panel j's bias row (bias + j*bstride floats) on
    every row; bias rows here 24 floats apart, NaN between them (never read)."""
    K = 9
    rng = np.random.default_rng([rows, npanels, 7])
    a_bits = to_bf16_bits(rng.standard_normal((rows, K)))
    b_bits = to_bf16_bits(rng.standard_normal((K, npanels * PANEL)))
    kp = -(-K // 2)
    a_rows = np.zeros((rows, 2 * kp), np.uint16)
    a_rows[:, :K] = a_bits
    bias = np.full((npanels, PANEL + 8), np.nan, np.float32)
    bias[:, :PANEL] = rng.standard_normal((npanels, PANEL)) * 10
    c = np.full((rows, npanels * PANEL + C_PAD), np.nan, np.float32)
    biased_driver(npanels)(a_rows.view(np.uint32), kp, rows, bf16.pack_pairs(b_bits), c, bias)
    want = (from_bf16_bits(a_bits).astype(np.float64)
            @ from_bf16_bits(b_bits).astype(np.float64)) + bias[:, :PANEL].reshape(-1)
    assert np.max(np.abs(c[:, :npanels * PANEL] - want)) <= 1e-6 * K * np.max(np.abs(want))
    assert np.isnan(c[:, npanels * PANEL:]).all(), "padding columns of C were written"


def test_pack_pairs_layout():
    """Panel p, pair q, column j holds B[2q, 16p + j] (low half) and B[2q+1, 16p + j]
    (high half); an odd K and a partial last panel are zero-padded."""
    rng = np.random.default_rng(1)
    b = rng.integers(1, 1 << 16, (5, 20), dtype=np.uint16)
    panels = bf16.pack_pairs(b)
    assert panels.shape == (2, 3, PANEL) and panels.dtype == np.uint32
    low, high = panels & 0xFFFF, panels >> 16
    for p in range(2):
        for q in range(3):
            for j in range(PANEL):
                col = p * PANEL + j
                assert low[p, q, j] == (b[2 * q, col] if col < 20 else 0)
                assert high[p, q, j] == (b[2 * q + 1, col] if 2 * q + 1 < 5 and col < 20 else 0)


@needs_bf16
def test_the_tile_runs_vdpbf16ps():
    run = driver(4)
    if not run.signatures:
        run(np.zeros((1, 1), np.uint32), 1, 1, np.zeros((4, 1, PANEL), np.uint32),
            np.zeros((1, 4 * PANEL), np.float32))
    asm = run.inspect_asm(run.signatures[0])
    assert "vdpbf16ps" in asm and "zmm" in asm
