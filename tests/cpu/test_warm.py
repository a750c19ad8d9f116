"""The CPU's first tier and the background compile (fusedrnn/cpu/firsttier.py, warm.py).

The first tier computes what the fused kernels compute (every mode, layers, directions,
lengths, clipping, projection, each dtype, forward and backward); a new process's first
call runs it and compiles nothing, and once the background compile has put the kernels
in the cache, the calls run fused; `python -m fusedrnn compile` leaves nothing for a
later process to compile."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fusedrnn
from fusedrnn.config import CallOptions, RNNConfig
from fusedrnn.cpu import BACKEND, FIRST_TIER, warm
from fusedrnn.recurrence import RecurrentOp

from conftest import CELLS, MODES, make_case, rel_err, tolerance

ROOT = Path(__file__).resolve().parents[2]


def _run(backend, case, kw, heads, dtype, opts, projection_size=None):
    """A training forward and its backward, then an inference forward, on one fresh op:
    every output and gradient."""
    T, N, I = case["data"].shape
    cfg = RNNConfig(mode=kw["mode"], input_size=I, state_size=kw["state_size"],
                    num_layers=kw["num_layers"], bidirectional=kw["bidirectional"],
                    projection_size=projection_size)
    op = RecurrentOp(backend, cfg, T, N, np.dtype(dtype))
    args = (case["data"], case["parameters"], case["state"], case["state_cell"], opts)
    reserve = op.take_reserve()
    trained = op.forward(*args, reserve)
    grads = op.backward(reserve, *args, heads["dout"], heads["dhy"], heads["dcy"])
    inferred = op.forward(*args)
    return [a for a in (*trained, *grads, *inferred) if a is not None]


CLIPPED = CallOptions(clip_lo=-0.4, clip_hi=0.3, clip_flags=3)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("L, D", [(1, 1), (2, 2), (3, 1)])
@pytest.mark.parametrize("mode", MODES)
def test_the_first_tier_computes_what_the_fused_kernels_do(mode, L, D, dtype):
    """Sequence lengths (a sample of one step, one of all), and clipping for LSTM: the
    first tier against the fused path, at the precision's tolerance."""
    case, kw, heads = make_case(mode, T=5, N=3, I=4, H=6, L=L, D=D, dtype=dtype, seed=L + D)
    opts = CallOptions(lengths=np.array([5, 1, 3], np.int64))
    if CELLS[mode].state_clip:
        opts = CallOptions(lengths=opts.lengths, clip_lo=-0.4, clip_hi=0.3, clip_flags=3)
    for T1 in (False, True):   # the T=1 form too (the fused layer's single step)
        if T1:
            case["data"], heads["dout"] = case["data"][:1], heads["dout"][:1]
            opts = CallOptions(clip_lo=opts.clip_lo, clip_hi=opts.clip_hi,
                               clip_flags=opts.clip_flags)
        got = _run(FIRST_TIER, case, kw, heads, dtype, opts)
        want = _run(BACKEND, case, kw, heads, dtype, opts)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert rel_err(a, b) <= tolerance(dtype), (T1, rel_err(a, b))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_first_tier_projects_as_the_fused_path_does(dtype):
    case, kw, heads = make_case("lstm", T=4, N=3, I=5, H=6, L=2, D=2, dtype=dtype, seed=7)
    P = 3
    rng = np.random.default_rng(8)
    case["parameters"] = rng.uniform(-0.4, 0.4, fusedrnn.param_size(
        input_size=5, projection_size=P, **kw)).astype(dtype)
    case["state"] = case["state"][..., :P].copy()
    heads["dout"], heads["dhy"] = heads["dout"][..., :2 * P].copy(), heads["dhy"][..., :P].copy()
    opts = CallOptions(lengths=np.array([4, 2, 1], np.int64))
    got = _run(FIRST_TIER, case, kw, heads, dtype, opts, projection_size=P)
    want = _run(BACKEND, case, kw, heads, dtype, opts, projection_size=P)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tolerance(dtype)


def _gradients(backend, case, kw, heads, opts, P=None):
    """(g_data, g_params, g_h0, g_c0) of a training forward and backward on a fresh op."""
    T, N, I = case["data"].shape
    cfg = RNNConfig(mode=kw["mode"], input_size=I, state_size=kw["state_size"],
                    num_layers=kw["num_layers"], bidirectional=kw["bidirectional"],
                    projection_size=P)
    op = RecurrentOp(backend, cfg, T, N, case["data"].dtype)
    args = (case["data"], case["parameters"], case["state"], case["state_cell"], opts)
    reserve = op.take_reserve()
    op.forward(*args, reserve)
    return op.backward(reserve, *args, heads["dout"], heads["dhy"], heads["dcy"])


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("mode, P", [(mode, None) for mode in MODES] + [("lstm", 3)])
@pytest.mark.parametrize("backend", ["first tier", "fused"])
def test_without_initial_states_the_gradients_are_a_zero_states(backend, mode, P, T):
    """Without initial states the backward skips their products (the step-by-step driver
    its first step's, on the first tier and for the projected LSTM): the data and parameter
    gradients are an explicit zero state's, with sequence lengths, both directions."""
    backend = FIRST_TIER if backend == "first tier" else BACKEND
    case, kw, heads = make_case(mode, T=T, N=3, I=5, H=6, L=2, D=2, seed=11)
    R = P or 6
    if P:
        case["parameters"] = np.random.default_rng(12).uniform(-0.4, 0.4, fusedrnn.param_size(
            input_size=5, projection_size=P, **kw))
        heads["dout"], heads["dhy"] = heads["dout"][..., :2 * R].copy(), heads["dhy"][..., :R]
    opts = CallOptions(lengths=np.array([T, 1, max(1, T - 1)], np.int64))
    zero = dict(case, state=np.zeros((4, 3, R)),
                state_cell=np.zeros((4, 3, 6)) if CELLS[mode].has_cell_state else None)
    want = _gradients(backend, zero, kw, heads, opts, P)
    got = _gradients(backend, dict(case, state=None, state_cell=None), kw, heads, opts, P)
    assert got[2] is None and want[2] is not None
    for a, b in zip(got[:2], want[:2]):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_the_first_tier_in_half_precision(mode, half):
    """Half data: the first tier's results are the float32 computation on the widened
    data, rounded; the fused path's differ from those by its products' own rounding
    (bfloat16 pairs): both within the half precision's bound of each other."""
    dtype = np.dtype(ml_dtypes.bfloat16) if half == "bfloat16" else np.dtype(np.float16)
    case, kw, heads = make_case(mode, T=4, N=3, I=5, H=6, L=2, D=2, dtype=np.float32, seed=3)
    narrow = {k: None if v is None else v.astype(dtype) for k, v in case.items()}
    narrow_heads = {k: None if v is None else v.astype(dtype) for k, v in heads.items()}
    wide = {k: None if v is None else v.astype(np.float32) for k, v in narrow.items()}
    wide_heads = {k: None if v is None else v.astype(np.float32)
                  for k, v in narrow_heads.items()}
    got = _run(FIRST_TIER, narrow, kw, narrow_heads, dtype, CallOptions())
    exact = _run(BACKEND, wide, kw, wide_heads, np.float32, CallOptions())
    fused = _run(BACKEND, narrow, kw, narrow_heads, dtype, CallOptions())
    unit = 2.0 ** -8 if half == "bfloat16" else 2.0 ** -11
    for a, b, c in zip(got, exact, fused):
        assert a.dtype == dtype
        assert rel_err(a, b.astype(dtype)) <= 2 * unit     # rounding of the same values
        assert rel_err(a, c) <= 16 * unit


def test_the_tier_follows_the_switch(monkeypatch):
    """FUSEDRNN_FIRST_TIER=0 (the suite's setting, conftest): the fused backend always."""
    cfg = RNNConfig(mode="gru", input_size=3, state_size=4, num_layers=1, bidirectional=False)
    monkeypatch.setenv(warm.ENV, "0")
    assert BACKEND.for_call(cfg, 5, np.dtype(np.float32)) is BACKEND


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_deterministic_torch_program_runs_fused_from_its_first_call(monkeypatch,
                                                                       deterministic):
    """torch.use_deterministic_algorithms(True) (what TORCH_CALLER's deterministic() reads):
    no first tier, whose switch's timing would change results between runs."""
    from types import SimpleNamespace

    from fusedrnn.config import TORCH_CALLER
    monkeypatch.setenv(warm.ENV, "1")
    readiness = warm.Readiness()
    monkeypatch.setattr(readiness, "ready", lambda kernels: False)   # (still compiling)
    monkeypatch.setattr(warm, "READY", readiness)
    cfg = RNNConfig(mode="gru", input_size=3, state_size=4, num_layers=1, bidirectional=False)
    token = TORCH_CALLER.set(SimpleNamespace(deterministic=lambda: deterministic))
    try:
        got = BACKEND.for_call(cfg, 5, np.dtype(np.float32))
    finally:
        TORCH_CALLER.reset(token)
    assert got is (BACKEND if deterministic else FIRST_TIER)


def test_kernel_sets_by_form():
    cfg = RNNConfig(mode="lstm", input_size=3, state_size=4, num_layers=2, bidirectional=True)
    assert warm.KernelSet.of(cfg, 7, np.dtype(np.float32)).name == "lstm-float32-loop"
    assert warm.KernelSet.of(cfg, 1, np.dtype(np.float64)).name == "lstm-float64-single"
    projected = RNNConfig(mode="lstm", input_size=3, state_size=4, num_layers=1,
                          bidirectional=False, projection_size=2)
    assert warm.KernelSet.of(projected, 1, np.dtype(np.float32)).name == \
        "lstm-float32-projected"
    assert [k.name for k in warm.sets_for(("gru", "lstm"), ("float32",))] == [
        "gru-float32-loop", "gru-float32-single", "lstm-float32-loop", "lstm-float32-single",
        "lstm-float32-projected"]


@pytest.mark.parametrize("own", [True, False])
def test_a_replay_runs_a_teams_shares_even_where_the_process_has_no_team(monkeypatch, own):
    """The replay's passes: Numba's parallel builds (no team), a team's shares, the serial
    builds. A process without a team (FUSEDRNN_TEAM=0) replays the shares on one of its
    own, so the cache it fills also serves the processes that have one."""
    from fusedrnn import precompile
    from fusedrnn.cpu import fused
    from fusedrnn.cpu.team import Team
    team = Team() if own else None
    monkeypatch.setattr(fused, "TEAM", team)
    passes = []
    monkeypatch.setattr(precompile, "_replay_calls",
                        lambda *args: passes.append((fused.SERIAL_WORK, fused.TEAM)))
    cfg = RNNConfig(mode="gru", input_size=3, state_size=4, num_layers=1)
    precompile.replay(warm.KernelSet.of(cfg, 1, np.dtype(np.float32)))
    (_, first), (bound, second), (_, third) = passes[::2]   # (two stacks a pass)
    assert first is None and isinstance(second, Team) and bound == -1 and third is team
    assert second is team if own else second is precompile._own_team()
    assert fused.TEAM is team   # (restored)


def test_a_background_compile_that_fails_leaves_the_op_to_compile_here(monkeypatch, tmp_path):
    """A replay that ends without its marker: the next call runs fused (compiling in this
    process, as without the first tier), not the first tier forever."""
    readiness = warm.Readiness()
    monkeypatch.setattr(readiness, "marker", lambda k: str(tmp_path / "never"))
    monkeypatch.setattr(readiness, "_start", lambda k: subprocess.Popen(
        [sys.executable, "-c", "raise SystemExit(3)"]))
    kernels = warm.KernelSet("gru", "float32", "loop", 3, 4)
    assert not readiness.ready(kernels)          # started
    readiness._waiting[kernels.name][0].wait()
    assert readiness.ready(kernels)              # ended without a marker


def test_compile_refuses_unknown_modes():
    done = subprocess.run([sys.executable, "-m", "fusedrnn", "compile", "--modes", "nope"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "--modes: expected some of" in done.stderr


# A fresh process: which tier each call ran (the op cache's backends), and whether Numba
# compiled anything during the first.
_FIRST_USE = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from numba.core import event
    compiled = []
    class Compiles(event.Listener):
        def on_start(self, ev): compiled.append(1)
        def on_end(self, ev): pass
    event.register("numba:compile", Compiles())
    import fusedrnn
    rng = np.random.default_rng(0)
    mode, wait = sys.argv[1], float(sys.argv[2])
    kw = dict(mode=mode, state_size=8, num_layers=1)
    x = rng.standard_normal((6, 3, 5)).astype(np.float32)
    p = rng.uniform(-0.3, 0.3, fusedrnn.param_size(input_size=5, **kw)).astype(np.float32)
    def step():
        out, handle = fusedrnn.RNN(x, p, **kw, train=True)
        return out, fusedrnn.rnn_backward(handle, np.ones_like(out)).data
    first = step()
    report = dict(first=dict(fusedrnn.cache_info().backends), first_compiles=len(compiled))
    deadline = time.time() + wait
    while time.time() < deadline and "cpu" not in fusedrnn.cache_info().backends:
        time.sleep(0.5)
        later = step()
    if wait:
        report.update(later=dict(fusedrnn.cache_info().backends),
                      agree=max(float(np.abs(a - b).max()) for a, b in zip(first, later)))
    else:   # (a user's would go on filling the cache after the program ends)
        from fusedrnn.cpu import warm
        warm.READY.stop()
    print(json.dumps(report))
""")


def _first_use(tmp_path, mode, wait, cache=None):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache or tmp_path / "cache"),
               FUSEDRNN_FIRST_TIER="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _FIRST_USE, mode, str(wait)], env=env,
                          capture_output=True, text=True, timeout=wait + 120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_first_call_compiles_nothing(tmp_path):
    """An empty kernel cache: the first training step runs the first tier, Numba compiles
    nothing in the caller's process, and the background compile is started."""
    report = _first_use(tmp_path, "rnn_tanh", 0)
    assert report == {"first": {"cpu-first-tier": 1}, "first_compiles": 0}
    logs = list((tmp_path / "cache").rglob("rnn_tanh-float32-loop.log"))
    assert len(logs) == 1   # the background compile's log, beside the kernel cache


@pytest.mark.exhaustive
def test_the_background_compile_then_compile_ahead_leave_nothing_to_compile(tmp_path):
    """... and once the background compile has finished, the calls run the fused kernels,
    with the first tier's results (within float32's tolerance); a second process runs
    fused from its first call, compiling nothing. Then `python -m fusedrnn compile --modes
    lstm` into the same cache builds the sets the background left (one compile of each set
    in all: the loop set's is the background's): a later process's LSTM calls at other
    sizes, layers, directions, lengths and T=1 (a step's products together too), in a
    numpy program and in a torch one, compile nothing. (One cache for both halves: a set
    compile is the same replay (precompile.replay) whichever starts it, and its kernels'
    signatures do not depend on the sizes it replays.)"""
    report = _first_use(tmp_path, "lstm", 300)
    assert report["first"] == {"cpu-first-tier": 1} and report["first_compiles"] == 0
    assert report["later"].get("cpu") == 1, report
    assert report["agree"] <= 1e-5
    again = _first_use(tmp_path, "lstm", 0)
    assert again == {"first": {"cpu": 1}, "first_compiles": 0}

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "fusedrnn", "compile", "--modes", "lstm"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lstm-float32-loop: ready" in done.stdout, done.stdout
    assert done.stdout.count(": compiled") == 2, done.stdout   # single, projected
    check = textwrap.dedent("""
        import sys
        import numpy as np
        if sys.argv[1] == "torch":
            import torch  # noqa: F401  (a torch program: Numba's OpenMP layer)
        from numba.core import event
        compiled = []
        class Compiles(event.Listener):
            def on_start(self, ev): compiled.append(ev.data["dispatcher"].py_func.__name__)
            def on_end(self, ev): pass
        event.register("numba:compile", Compiles())
        import fusedrnn
        rng = np.random.default_rng(1)
        for T, N, L, D, I, H, P in ((1, 1, 1, False, 5, 16, None), (7, 3, 2, True, 24, 40, None),
                                    (40, 8, 3, False, 9, 32, None), (1, 33, 2, True, 7, 16, None),
                                    (6, 4, 2, True, 5, 8, 3), (1, 2, 1, False, 5, 8, 3),
                                    (1, 64, 1, False, 256, 256, None)):   # (products together)
            kw = dict(mode="lstm", state_size=H, num_layers=L, bidirectional=D,
                      projection_size=P)
            x = rng.standard_normal((T, N, I)).astype(np.float32)
            p = rng.uniform(-.2, .2, fusedrnn.param_size(input_size=I, **kw)).astype(np.float32)
            fusedrnn.RNN(x, p, **kw)
            out, handle = fusedrnn.RNN(x, p, **kw, train=True, sequence_length=np.full(N, T),
                                       use_sequence_length=True, lstm_state_clip_min=-1.0,
                                       lstm_state_clip_max=1.0)
            fusedrnn.rnn_backward(handle, np.ones_like(out))
        assert fusedrnn.cache_info().backends == {"cpu": 7}, fusedrnn.cache_info()
        assert not compiled, compiled
    """)
    for program in ("numpy", "torch"):
        done = subprocess.run([sys.executable, "-c", check, program],
                              env=dict(env, FUSEDRNN_FIRST_TIER="1"), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (program, done.stderr)


@pytest.mark.parametrize("failure", ["no cache directory", "no process"])
def test_without_a_cache_or_a_process_the_op_compiles_here(monkeypatch, failure):
    """Where Numba has no writable cache directory (so a background compile would fill
    nothing), or the compile process cannot start: the op runs fused at once."""
    readiness = warm.Readiness()
    if failure == "no cache directory":
        def no_dir():
            raise RuntimeError("fusedrnn: no writable cache directory for Numba's kernels")
        monkeypatch.setattr(warm, "marker_dir", no_dir)
    else:
        monkeypatch.setattr(readiness, "marker", lambda k: "/nonexistent/marker")

        def no_process(kernels):
            raise OSError("no python")
        monkeypatch.setattr(readiness, "_start", no_process)
    assert readiness.ready(warm.KernelSet("gru", "float32", "loop", 3, 4))


_HOLDER = """
import fcntl, sys, time
lock = open(sys.argv[1] + ".lock", "a")
fcntl.flock(lock, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_a_forked_process_waits_for_the_compile_its_parent_started(monkeypatch, tmp_path):
    """The set's compile holds its lock: a process forked from the program (a DataLoader
    worker, a Pool) sees it under way and stays on the first tier, not compiling the set
    again itself; once it ends without a marker, the op compiles in the caller."""
    marker = str(tmp_path / "set-marker")
    readiness = warm.Readiness()
    monkeypatch.setattr(readiness, "marker", lambda k: marker)
    holder = []

    def start(kernels):
        holder.append(subprocess.Popen([sys.executable, "-c", _HOLDER, marker],
                                       stdout=subprocess.PIPE, text=True))
        assert holder[0].stdout.readline() == "held\n"
        return holder[0]
    monkeypatch.setattr(readiness, "_start", start)
    kernels = warm.KernelSet("gru", "float32", "loop", 3, 4)
    try:
        assert not readiness.ready(kernels)            # started, in the parent
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:   # the forked child: the parent's compile is not its own child
            readiness.forget_children()
            answers = [readiness.ready(kernels), readiness.ready(kernels)]
            os.write(write, json.dumps(answers).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        assert json.loads(os.read(read, 100)) == [False, False]
    finally:
        for p in holder:
            p.kill()
            p.wait()
    assert readiness.ready(kernels)   # ended without its marker: compile here
