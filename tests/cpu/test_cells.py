"""The CPU cell kernels on their own: one step against numpy, on strided views,
with the documented aliasing (dcarry_in is dcarry_out)."""
import numpy as np
import pytest

from conftest import MODES, rel_err
from fusedrnn.config import CELLS
from fusedrnn.cpu.cells import cell_kernels
from reference import cell as reference_cell


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
            c.astype(dtype) if lstm else empty, h_next, c_next if lstm else empty, y, saved)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for n in range(N):
        h_ref, c_ref = reference_cell(mode, x[n], h[n], c[n], wx, wh, bx, bh)
        assert rel_err(h_next[n], h_ref) <= tol
        if lstm:
            assert rel_err(c_next[n], c_ref) <= tol
    assert np.array_equal(y, h_next)
    assert not np.isnan(saved).any()


@pytest.mark.parametrize("mode", MODES)
def test_backward_step_allows_carry_aliasing(mode):
    """dcarry_out may be dcarry_in: same result as separate buffers."""
    rng = np.random.default_rng(5)
    N, H = 4, 3
    spec = CELLS[mode]
    GH = spec.gates * H
    _, backward = cell_kernels(mode, np.float64)
    arrays = [rng.uniform(0.1, 0.9, (N, H)) for _ in range(6)]  # dy, dh_rec, carry, h, c, c_t
    saved = rng.uniform(0.1, 0.9, (N, spec.saved * H))
    empty = np.empty((0, 0))
    results = []
    for alias in (False, True):
        dy, dh_rec, carry, h_prev, c_prev, c_t = (a.copy() for a in arrays)
        carry_out = carry if alias else np.empty_like(carry)
        dgx = np.full((N, GH), np.nan)
        dgh = np.full((N, GH), np.nan) if spec.split_gate_grads else empty
        backward(dy, dh_rec, carry if spec.carry else empty, saved, h_prev,
                 c_prev, c_t, dgx, dgh, carry_out if spec.carry else empty)
        assert not np.isnan(dgx).any() and not np.isnan(dgh).any()
        results.append((dgx, dgh, carry_out))
    (dgx0, dgh0, carry0), (dgx1, dgh1, carry1) = results
    assert np.array_equal(dgx0, dgx1) and np.array_equal(dgh0, dgh1)
    if spec.carry:
        assert np.array_equal(carry0, carry1)
