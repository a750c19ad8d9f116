"""fusedrnn.cpu.lowlevel.packing: each packer's layout against a plain numpy reference,
into NaN-poisoned buffers (every element must be written, padding as exact zeros)."""
import numba as nb
import numpy as np
import pytest

from fusedrnn.config import CELLS
from fusedrnn.cpu.lowlevel import (
    PANEL,
    pack_input_weights,
    pack_panel,
    pack_recurrent,
    pack_recurrent_rows,
    packing,
    panels,
)

DTYPES = [np.float32, np.float64]


@pytest.fixture(autouse=True, params=["serial", "parallel"])
def build(request, monkeypatch):
    """Every packer test on both builds, whatever its size picks (SERIAL_ELEMENTS)."""
    monkeypatch.setattr(packing, "SERIAL_ELEMENTS", 1 << 62 if request.param == "serial" else -1)
    return request.param


@pytest.mark.parametrize("packer, elements, serial", [
    ("pack_recurrent", 1 << 18, True), ("pack_recurrent", (1 << 18) + 4, False),
    ("pack_recurrent_rows", 1 << 18, True), ("pack_recurrent_rows", (1 << 18) + 4, False),
    ("pack_input_weights", 1 << 18, True), ("pack_input_weights", (1 << 18) + 4, False)])
def test_the_weights_size_picks_the_build(monkeypatch, packer, elements, serial):
    """Up to SERIAL_ELEMENTS weight elements the serial build, else the parallel one (at
    a bound set here: the shipped one depends on the threading layer)."""
    monkeypatch.setattr(packing, "SERIAL_ELEMENTS", 1 << 18)
    launched = []
    for name in ("_pack_recurrent", "_pack_recurrent_rows", "_pack_rows_at"):
        for twin in (name, name + "_serial"):
            real = getattr(packing, twin)
            monkeypatch.setattr(packing, twin, lambda *a, _r=real, _n=twin:
                                launched.append(_n.endswith("_serial")) or _r(*a))
    w = np.zeros((4, elements // 4), np.float32)
    if packer == "pack_recurrent":
        pack_recurrent(w, 4)
    elif packer == "pack_recurrent_rows":
        pack_recurrent_rows(w)
    else:
        pack_input_weights([w], np.empty((1, w.shape[1], PANEL), np.float32))
    assert launched == [serial]


def reference_columns(w, gates):
    """(B, G, K, 16): out[b, g, k, u] = w[g*H + 16b + u, k], 0 past H."""
    GH, K = w.shape
    H = GH // gates
    padded = np.zeros((gates, panels(H) * PANEL, K), w.dtype)
    padded[:, :H] = w.reshape(gates, H, K)
    return padded.reshape(gates, panels(H), PANEL, K).transpose(1, 0, 3, 2)


def reference_rows(w):
    """(B, GH, 16): out[b, k, u] = w[k, 16b + u], 0 past R."""
    GH, R = w.shape
    padded = np.zeros((GH, panels(R) * PANEL), w.dtype)
    padded[:, :R] = w
    return padded.reshape(GH, panels(R), PANEL).transpose(1, 0, 2)


def test_panels():
    assert [panels(n) for n in (1, 15, 16, 17, 32, 33)] == [1, 1, 1, 2, 2, 3]


# K: under one float32 vector (float64: one and a tail), whole vectors of either dtype,
# and vectors with a tail (rows.rows_to_columns moves whole panels' columns a vector at a time)
@pytest.mark.parametrize("K", [7, 16, 19])
@pytest.mark.parametrize("H", [1, 15, 16, 17, 40])
@pytest.mark.parametrize("mode", ["rnn_tanh", "gru", "lstm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_recurrent_layout(dtype, mode, H, K):
    G = CELLS[mode].gates
    w = np.random.default_rng([G, H]).standard_normal((G * H, K)).astype(dtype)
    out = np.full((panels(H), G, K, PANEL), np.nan, dtype)
    assert pack_recurrent(w, G, out) is out
    assert np.array_equal(out, reference_columns(w, G))
    for b, g, k, u in np.ndindex(out.shape):   # the docstring's formula, element by element
        j = PANEL * b + u
        assert out[b, g, k, u] == (w[g * H + j, k] if j < H else 0), (b, g, k, u)
    allocated = pack_recurrent(w, G)
    assert allocated.dtype == dtype and np.array_equal(allocated, out)


@pytest.mark.parametrize("R", [1, 15, 16, 17, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_recurrent_rows_layout(dtype, R):
    GH = 9
    w = np.random.default_rng(R).standard_normal((GH, R)).astype(dtype)
    out = np.full((panels(R), GH, PANEL), np.nan, dtype)
    assert pack_recurrent_rows(w, out) is out
    assert np.array_equal(out, reference_rows(w))
    for b, k, u in np.ndindex(out.shape):
        j = PANEL * b + u
        assert out[b, k, u] == (w[k, j] if j < R else 0), (b, k, u)
    allocated = pack_recurrent_rows(w)
    assert allocated.dtype == dtype and np.array_equal(allocated, out)


@pytest.mark.parametrize("K", [5, 16, 19])
@pytest.mark.parametrize("blocks", [[1], [16], [3, 3], [24, 24], [80, 80], [99]])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_input_weights_layout(dtype, blocks, K):
    """The directions' rows concatenated, no padding between them, zero past the end."""
    rng = np.random.default_rng(sum(blocks))
    ws = [rng.standard_normal((n, K)).astype(dtype) for n in blocks]
    out = np.full((panels(sum(blocks)), K, PANEL), np.nan, dtype)
    assert pack_input_weights(ws, out) is out
    assert np.array_equal(out, reference_columns(np.concatenate(ws), 1)[:, 0])


def test_pack_input_weights_pads_past_the_last_row_with_zeros():
    w = np.arange(3 * 5, dtype=np.float64).reshape(3, 5) + 1
    out = np.full((1, 5, PANEL), np.nan)
    pack_input_weights([w], out)
    np.testing.assert_array_equal(out[0, :, :3], w.T)
    np.testing.assert_array_equal(out[0, :, 3:], 0)


_REFUSED = {   # (w, out, what the message names)
    "float64 into float32": (lambda: np.ones((16, 8)), np.float32, "got float64"),
    "float16": (lambda: np.ones((16, 8), np.float16), np.float16, "got float16"),
    "a strided w": (lambda: np.ones((8, 16)).T, np.float64, "contiguous False")}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_the_packers_refuse_weights_they_cannot_move_as_vectors(case):
    """rows_to_columns reads w's rows and writes out's as one float dtype: another dtype,
    or a strided w, is refused rather than misread."""
    make, out_dtype, got = _REFUSED[case]
    w, out = make(), np.empty((1, 8, PANEL), out_dtype)
    with pytest.raises(ValueError, match=got):
        pack_input_weights([w], out)
    with pytest.raises(ValueError, match=got):
        pack_recurrent(w, 1, out.reshape(1, 1, 8, PANEL))


def test_pack_input_weights_refuses_a_too_small_buffer():
    with pytest.raises(ValueError, match="cannot hold 17 rows"):
        pack_input_weights([np.ones((17, 4))], np.empty((1, 4, PANEL)))


@nb.njit
def _pack_panels(w, out):
    """pack_panel over w's rows, 16 at a time, as the T=1 fused form calls it."""
    R = w.shape[0]
    for p in range(out.shape[0]):
        pack_panel(w, p * PANEL, min(PANEL, R - p * PANEL), out[p])


@pytest.mark.parametrize("R", [1, 15, 16, 17, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_panel_layout(dtype, R):
    w = np.random.default_rng(R).standard_normal((R, 6)).astype(dtype)
    out = np.full((panels(R), 6, PANEL), np.nan, dtype)
    _pack_panels(w, out)
    assert np.array_equal(out, reference_columns(w, 1)[:, 0])
