"""Compiling the CPU's kernels ahead of their first call: the background compile that the
first tier starts (fusedrnn/cpu/warm.py: when, and why) and `python -m fusedrnn compile`.

A kernel set is compiled by replaying calls of its kind through the op, so that exactly
the kernels such an op launches reach Numba's disk cache, with the signatures its calls
give them; the set is then marked ready beside the cache. It sits above the op (it
drives it), where the backend's readiness check cannot import it: that one starts this
module as a process of its own (`python -m fusedrnn.precompile SPEC`).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import numpy as np

from . import cpu
from .config import CELLS, MODES, PRECISIONS
from .cpu import _own_product, fused, warm
from .cpu.fused import FUSED_INPUT_ROWS, own_gemm
from .cpu.warm import fcntl
from .layout import param_size
from .op import RNN, rnn_backward

# The serial/parallel bounds (cpu/fused.py, lowlevel): the replay sets them each way in turn.
_BOUNDS = (("fused", ("SERIAL_WORK", "SERIAL_LOOP_WORK", "SERIAL_LOOP_BYTES",
                      "SERIAL_POINTWISE")),
           ("lowlevel.gemm", ("SERIAL_WORK",)), ("lowlevel.packing", ("SERIAL_ELEMENTS",)),
           ("lowlevel.batched", ("SERIAL_WORK",)))
# (a single step's products go together at every size in the replay: its small calls too)
_TOGETHER = {"STEP_PRODUCTS_WORK": -1, "STEP_PRODUCTS_MOST": 1 << 62}


_SHIPPED = {}


def _set_bounds(value):
    """Every bound to `value`; None: back to what the modules shipped with."""
    for module, names in _BOUNDS:
        module = importlib.import_module(f"fusedrnn.cpu.{module}")
        for name in names:
            _SHIPPED.setdefault((module.__name__, name), getattr(module, name))
            setattr(module, name, _SHIPPED[module.__name__, name] if value is None else value)


def replay(kernels: warm.KernelSet):
    """Compile every kernel an op of `kernels` can launch into the disk cache (inference,
    training, lengths and clipping, read-only inputs, a few batch sizes, each build, its
    own layers and two bidirectional ones, whose buffer views other stacks share)."""
    _set_bounds(None)   # (what the modules shipped with, recorded before any change)
    team = fused.TEAM
    # (a process without a team, FUSEDRNN_TEAM=0, fills the cache for those with one too)
    shares = team if team is not None else _own_team()
    shipped = {name: getattr(cpu, name) for name in _TOGETHER}
    for name, value in _TOGETHER.items():
        setattr(cpu, name, value)
    try:
        # every parallel build (Numba's layer, then a team's shares: a torch program
        # launches the former), then every serial one
        for bound, fused.TEAM in ((-1, None), (-1, shares), (1 << 62, team)):
            _set_bounds(bound)
            for layers, bidirectional in {(kernels.num_layers, kernels.bidirectional),
                                          (2, True)}:
                _replay_calls(kernels, layers, bidirectional)
            compute = PRECISIONS[kernels.dtype].compute
            if own_gemm(compute):   # the large products' own GEMM (CpuBackend.matmul)
                a, b = np.random.default_rng(1).standard_normal((2, 8, 8)).astype(compute)
                _own_product(a, b, np.empty((8, 8), compute))
    finally:
        _set_bounds(None)
        fused.TEAM = team
        for name, value in shipped.items():
            setattr(cpu, name, value)


@functools.cache
def _own_team():
    from .cpu.team import Team
    return Team()


def _replay_calls(kernels, num_layers, bidirectional):
    dtype = warm.numpy_dtype(kernels.dtype)
    rng = np.random.default_rng(0)
    kw = dict(mode=kernels.mode, state_size=kernels.state_size, num_layers=num_layers,
              bidirectional=bidirectional,
              projection_size=kernels.projection_size, state_outputs=True)
    n = param_size(input_size=kernels.input_size, **{
        k: kw[k] for k in ("mode", "state_size", "num_layers", "bidirectional",
                           "projection_size")})
    params = rng.uniform(-0.3, 0.3, n).astype(dtype)
    T = 1 if kernels.form == "single" else 3
    clip = {"lstm_state_clip_min": -2.0, "lstm_state_clip_max": 2.0} \
        if CELLS[kernels.mode].state_clip else {}
    for N in (1, 2, FUSED_INPUT_ROWS):
        x = rng.standard_normal((T, N, kernels.input_size)).astype(dtype)
        lengths = np.maximum(1, T - np.arange(N) % T).astype(np.int64)
        for extra in ({}, dict(sequence_length=lengths, use_sequence_length=True, **clip)):
            RNN(x, params, **kw, **extra)
            out, *_, handle = RNN(x, params, **kw, **extra, train=True)
            rnn_backward(handle, np.ones_like(out))
    x.setflags(write=False)   # read-only arrays (a memory map, np.frombuffer) type apart
    fixed = params.copy()
    fixed.setflags(write=False)
    out, *_, handle = RNN(x, fixed, **kw, train=True)
    rnn_backward(handle, np.ones_like(out))


def mark_ready(kernels):
    path = warm.READY.marker(kernels)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(asdict(kernels), f)
    os.replace(temporary, path)


def compile_set(kernels):
    """The background compile of one set (warm.Readiness starts it as a process): at a
    lower priority than the program that waits, under the set's lock (one compile of a set
    at a time, every process); nothing to do where another has marked it meanwhile."""
    try:
        os.nice(5)
    except OSError:
        pass
    marker = warm.READY.marker(kernels)
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    with open(marker + ".lock", "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(marker):
            replay(kernels)
            mark_ready(kernels)


def compile_ahead(sets, jobs, force=False, say=print):
    """Each kernel set compiled in a process of its own, `jobs` at a time (sets already
    marked are skipped unless `force`). Returns the names of those that failed."""
    pending = [k for k in sets if force or not os.path.exists(warm.READY.marker(k))]
    for k in sets:
        if k not in pending:
            say(f"  {k.name}: ready")
    if force:
        for k in pending:
            with contextlib.suppress(FileNotFoundError):
                os.remove(warm.READY.marker(k))
    running, failed = {}, []
    env = dict(os.environ, **{warm.ENV: "0"})
    with tempfile.TemporaryDirectory() as logs:
        while pending or running:
            while pending and len(running) < jobs:
                k = pending.pop(0)
                log = open(os.path.join(logs, k.name), "w+")
                running[k] = (subprocess.Popen(
                    [sys.executable, "-m", "fusedrnn.precompile", json.dumps(asdict(k))],
                    stdout=log, stderr=subprocess.STDOUT, env=env), log)
            for k, (child, log) in list(running.items()):
                if child.poll() is None:
                    continue
                del running[k]
                if child.returncode:
                    failed.append(k.name)
                    log.seek(0)
                    say(f"  {k.name}: FAILED\n{log.read()}")
                else:
                    say(f"  {k.name}: compiled")
                log.close()
            time.sleep(0.05)
    return failed


def main(args):
    """`python -m fusedrnn compile`: the CPU kernels into Numba's disk cache, ahead."""
    modes = MODES if args.modes == "all" else tuple(args.modes.split(","))
    dtypes = tuple(args.dtypes.split(","))
    for name, given, known in (("--modes", modes, MODES), ("--dtypes", dtypes, PRECISIONS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            print(f"compile: {name}: expected some of {', '.join(known)}, got {unknown}",
                  file=sys.stderr)
            return 2
    if args.jobs < 1:
        print(f"compile: --jobs: expected a positive count, got {args.jobs}", file=sys.stderr)
        return 2
    sets = list(warm.sets_for(modes, dtypes))
    print(f"fusedrnn compile: {len(sets)} kernel sets into {warm.marker_dir()}, {args.jobs} at "
          f"a time")
    start = time.perf_counter()
    failed = compile_ahead(sets, args.jobs, args.force)
    print(f"done in {time.perf_counter() - start:.0f} s" +
          (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":   # one set's background compile (warm.Readiness._start)
    compile_set(warm.KernelSet(**json.loads(sys.argv[1])))
