"""fusedrnn.cpu.team: the fused loops' regions on threads of our own in a numpy program.

(a) Every region a team runs (the T=1 step, the loops forward and backward, the input
    projection), at sizes forced past the serial bounds: results bitwise equal to the
    same calls on Numba's layer (a block's sums do not depend on who runs it), and the
    helper joined.
(b) A launch while another thread holds the team runs alone, with the same results; so
    does one whose helper sleeps (it joins late, or not at all), again and again.
(c) The choice: a numpy program has a team (its T=1 bound is the spinning layers'), a
    torch program (OpenMP) and FUSEDRNN_TEAM=0 have none.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np
import pytest

import fusedrnn
from fusedrnn.cpu import fused, team, threads
from fusedrnn.cpu.lowlevel import gemm, packing

pytestmark = pytest.mark.skipif(
    fused.TEAM is None or numba.config.NUMBA_NUM_THREADS < 2,
    reason="this process runs no team: a torch program's, FUSEDRNN_TEAM=0 (test (c) checks "
           "that) or one Numba thread")


@pytest.fixture
def parallel(monkeypatch):
    """Every bound at -1: the regions run on several workers, whatever their size."""
    for module, names in ((fused, ("SERIAL_WORK", "SERIAL_POINTWISE", "SERIAL_LOOP_WORK")),
                          (gemm, ("SERIAL_WORK",)), (packing, ("SERIAL_ELEMENTS",))):
        for name in names:
            monkeypatch.setattr(module, name, -1)


def _calls(dtype=np.float32):
    """Outputs and gradients of a loop (T=6, its projection past gemm's bound), a T=1
    step and its backward, for two modes."""
    rng, got = np.random.default_rng(3), []
    for mode, T, N, H in (("lstm", 6, 40, 37), ("gru", 1, 33, 64), ("rnn_tanh", 6, 17, 48)):
        kw = dict(mode=mode, state_size=H, num_layers=1, bidirectional=True)
        x = rng.standard_normal((T, N, H)).astype(dtype)
        p = (rng.standard_normal(fusedrnn.param_size(input_size=H, **kw)) * 0.2).astype(dtype)
        y, handle = fusedrnn.RNN(x, p, **kw, train=True)
        got += [y, *fusedrnn.rnn_backward(handle, np.ones_like(y))[:2]]
    return got


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_teams_regions_match_numbas_layer(parallel, monkeypatch, dtype):
    ours = fused.TEAM
    monkeypatch.setattr(fused, "TEAM", None)
    fusedrnn.clear_cache()
    want = _calls(dtype)
    monkeypatch.setattr(fused, "TEAM", ours)
    fusedrnn.clear_cache()
    joins = ours.joins
    for _ in range(200):   # (on a loaded machine the caller may finish before its helper runs)
        got = _calls(dtype)
        for a, b in zip(got, want, strict=True):
            assert np.array_equal(a, b)
        if ours.joins > joins:   # the helper took part
            break
    assert ours.joins > joins and not ours.errors


def test_a_held_team_or_a_sleeping_helper_leaves_the_caller_to_finish(parallel, monkeypatch):
    want = _calls()
    # another thread's launch holds the team: this one runs every share itself
    with fused.TEAM._lock:
        joins = fused.TEAM.joins
        assert all(np.array_equal(a, b) for a, b in zip(_calls(), want, strict=True))
        assert fused.TEAM.joins == joins
    # a team whose helper spins almost not at all: asleep at every launch, woken by it
    monkeypatch.setattr(team, "SPIN_SECONDS", 0.0)
    sleepy = team.Team()
    monkeypatch.setattr(fused, "TEAM", sleepy)
    asleep = 0
    for k in range(5):
        time.sleep(0.02)
        asleep += k > 0 and bool(sleepy._box[1, 1])   # its helper asleep as the call starts
        assert all(np.array_equal(a, b) for a, b in zip(_calls(), want, strict=True))
    assert asleep > 0 and not sleepy.errors


def test_who_has_a_team():
    assert fused.SERIAL_WORK == 1 << 20 and threads.SLEEPING_WORKERS
    root = str(Path(__file__).resolve().parents[2])
    probe = "from fusedrnn.cpu import fused; print(fused.TEAM is None, fused.SERIAL_WORK)"
    try:
        import numba.np.ufunc.omppool  # noqa: F401  (a torch program's layer)
        torch_case = [("import torch\n", {}, "True 524288")]
    except ImportError:
        torch_case = []
    for prefix, env, want in (*torch_case, ("", {"FUSEDRNN_TEAM": "0"}, "True 33554432")):
        environ = dict(os.environ, PYTHONPATH=root, **env)
        environ.pop("NUMBA_THREADING_LAYER", None)
        done = subprocess.run([sys.executable, "-c", prefix + probe], env=environ,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.split()[-2:] == want.split(), done.stderr
