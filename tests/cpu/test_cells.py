"""The CPU cell kernels on their own: one step against numpy, on strided views,
with the documented aliasing (dcarry_in is dcarry_out)."""
import numpy as np
import pytest

from fusedrnn.config import CELLS
from fusedrnn.cpu.cells import cell_kernels

from conftest import MODES, rel_err
from reference import cell as reference_cell

ALL_ACTIVE = np.empty(0, np.int64)


def _strided(rng, rows, cols, dtype):
    """A (rows, cols) view with a row stride wider than cols, like a slice of a layer buffer."""
    return rng.standard_normal((rows, 2 * cols + 1)).astype(dtype)[:, 1:cols + 1]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("mode", MODES)
def test_one_forward_step_matches_reference_cell(mode, dtype):
    rng = np.random.default_rng(3)
    N, I, H = 3, 4, 5
    spec = CELLS[mode]
    G = spec.gates
    wx, wh = rng.standard_normal((G * H, I)), rng.standard_normal((G * H, H))
    bx, bh = rng.standard_normal(G * H), rng.standard_normal(G * H)
    x, h, c = rng.standard_normal((N, I)), rng.standard_normal((N, H)), rng.standard_normal((N, H))
    gx = _strided(rng, N, G * H, dtype)
    gx[...] = x @ wx.T
    gh = (h @ wh.T).astype(dtype)
    empty = np.empty((0, 0), dtype)
    lstm = spec.has_cell_state
    h_next, c_next = np.full((N, H), np.nan, dtype), np.full((N, H), np.nan, dtype)
    y = _strided(rng, N, H, dtype)
    saved = np.full((N, spec.saved * H), np.nan, dtype)
    forward, _ = cell_kernels(mode, dtype)
    forward(gx, gh, bx.astype(dtype), bh.astype(dtype), h.astype(dtype),
            c.astype(dtype) if lstm else empty, h_next, c_next if lstm else empty, y, saved,
            ALL_ACTIVE, 0, 0.0, 0.0, 0)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for n in range(N):
        h_ref, c_ref = reference_cell(mode, x[n], h[n], c[n], wx, wh, bx, bh)
        assert rel_err(h_next[n], h_ref) <= tol
        if lstm:
            assert rel_err(c_next[n], c_ref) <= tol
    assert np.array_equal(y, h_next)
    assert not np.isnan(saved).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", MODES)
def test_backward_step_allows_carry_aliasing(mode, dtype):
    """dh_carry_out / dc_carry_out may be dh_carry_in / dc_carry_in: same result as
    separate buffers."""
    rng = np.random.default_rng(5)
    N, H = 4, 3
    spec = CELLS[mode]
    GH = spec.gates * H
    _, backward = cell_kernels(mode, dtype)
    inputs = [rng.uniform(0.1, 0.9, (N, H)).astype(dtype) for _ in range(7)]  # dy .. c_t
    saved = rng.uniform(0.1, 0.9, (N, spec.saved * H)).astype(dtype)
    empty = np.empty((0, 0), dtype)
    lstm = spec.has_cell_state
    results = []
    for alias in (False, True):
        dy, dh_rec, h_carry, c_carry, h_prev, c_prev, c_t = (a.copy() for a in inputs)
        h_out = h_carry if alias else np.full_like(h_carry, np.nan)
        c_out = c_carry if alias else np.full_like(c_carry, np.nan)
        dgx = np.full((N, GH), np.nan, dtype)
        dgh = np.full((N, GH), np.nan, dtype) if spec.split_gate_grads else empty
        backward(dy, dh_rec, h_carry, c_carry if lstm else empty, saved, h_prev, c_prev, c_t,
                 dgx, dgh, h_out, c_out if lstm else empty, ALL_ACTIVE, 0, 0.0, 0.0, 0)
        results.append((dgx, dgh, h_out, c_out if lstm else empty))
    for a, b in zip(*results):
        assert not np.isnan(a).any()
        assert np.array_equal(a, b)
