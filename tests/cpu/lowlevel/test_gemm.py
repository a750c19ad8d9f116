"""The input projection on Numba's threads (fusedrnn/cpu/lowlevel/gemm.py) against float64
numpy (its packer: test_packing.py)."""
import numpy as np
import pytest

from fusedrnn.cpu.lowlevel import CHUNK, PANEL, gemm, pack_input_weights, project

TOL = {np.float32: 1e-5, np.float64: 1e-12}


@pytest.fixture(params=["serial", "parallel"])
def build(request, monkeypatch):
    """Both builds, whatever the size picks (gemm.SERIAL_WORK)."""
    monkeypatch.setattr(gemm, "SERIAL_WORK", 1 << 62 if request.param == "serial" else -1)
    return request.param


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, k, blocks", [
    (1, 1, [1]),               # smallest: one partial panel, one partial chunk
    (CHUNK, 16, [16]),         # exact chunk and panel
    (CHUNK + 5, 37, [24, 24]), # two directions sharing a panel (24 + 24 = 3 panels)
    (300, 64, [80, 80]),       # two directions, whole panels
    (7, 200, [3 * 33]),        # a GRU-like odd gate count
])
def test_project_matches_float64_reference(build, dtype, rows, k, blocks):
    rng = np.random.default_rng(rows * 1000 + k)
    a = rng.standard_normal((rows, k)).astype(dtype)
    ws = [rng.standard_normal((n, k)).astype(dtype) for n in blocks]
    columns = sum(blocks)
    wpack = np.full((-(-columns // PANEL), k, PANEL), np.nan, dtype)   # poisoned
    c = np.full((rows, columns), np.nan, dtype)
    spill = np.full((-(-rows // CHUNK), CHUNK, PANEL), np.nan, dtype)
    pack_input_weights(ws, wpack)
    project(a, wpack, c, spill)
    want = a.astype(np.float64) @ np.concatenate(ws).astype(np.float64).T
    scale = np.abs(a).astype(np.float64) @ np.abs(np.concatenate(ws)).astype(np.float64).T
    assert np.isfinite(c).all()
    assert np.max(np.abs(c - want) / scale) <= TOL[dtype]


@pytest.mark.parametrize("rows, serial", [(512, True), (513, False)])
def test_the_product_size_picks_the_build(monkeypatch, rows, serial):
    """Up to SERIAL_WORK multiply-adds (M*K*C = rows*128*128 here) the serial build, at
    a bound set here (the shipped one depends on the threading layer)."""
    monkeypatch.setattr(gemm, "SERIAL_WORK", 1 << 23)
    launched = []
    for name in ("_project", "_project_serial"):
        real = getattr(gemm, name)
        monkeypatch.setattr(gemm, name, lambda *a, _r=real, _n=name:
                            launched.append(_n.endswith("_serial")) or _r(*a))
    a = np.zeros((rows, 128), np.float32)
    wpack = np.zeros((8, 128, PANEL), np.float32)
    project(a, wpack, np.empty((rows, 128), np.float32),
            np.empty((-(-rows // CHUNK), CHUNK, PANEL), np.float32))
    assert launched == [serial]
