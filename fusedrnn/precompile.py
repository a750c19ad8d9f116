"""Compiling the CPU's kernels ahead of their first call: the background compile that the
first tier starts (fusedrnn/cpu/warm.py: when, and why) and `python -m fusedrnn compile`.

A kernel set is compiled by replaying calls of its kind through the op, so that exactly
the kernels such an op launches reach Numba's disk cache, with the signatures its calls
give them; the set is then marked ready beside the cache. It sits above the op (it
drives it), where the backend's readiness check cannot import it: that one starts this
module as a process of its own (`python -m fusedrnn.precompile SPEC`).
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np

from .config import CELLS, MODES, PRECISIONS
from .cpu import _own_product, warm
from .cpu.fused import FUSED_INPUT_ROWS, own_gemm
from .layout import param_size
from .op import RNN, rnn_backward

# The serial/parallel bounds (cpu/fused.py, lowlevel): the replay sets them each way in turn.
_BOUNDS = (("fused", ("SERIAL_WORK", "SERIAL_LOOP_WORK", "SERIAL_LOOP_BYTES",
                      "SERIAL_POINTWISE")),
           ("lowlevel.gemm", ("SERIAL_WORK",)), ("lowlevel.packing", ("SERIAL_ELEMENTS",)))


_SHIPPED = {}


def _set_bounds(value):
    """Every bound to `value`; None: back to what the modules shipped with."""
    for module, names in _BOUNDS:
        module = importlib.import_module(f"fusedrnn.cpu.{module}")
        for name in names:
            _SHIPPED.setdefault((module.__name__, name), getattr(module, name))
            setattr(module, name, _SHIPPED[module.__name__, name] if value is None else value)


def replay(kernels: warm.KernelSet, write_marker=True):
    """Compile every kernel an op of `kernels` can launch into the disk cache (inference,
    training, lengths and clipping, a few batch sizes, each build, its own layers and two
    bidirectional ones, whose buffer views other stacks share); then mark it ready."""
    for layers, bidirectional in {(kernels.num_layers, kernels.bidirectional), (2, True)}:
        _replay_calls(kernels, layers, bidirectional)
    compute = PRECISIONS[kernels.dtype].compute
    if own_gemm(compute):   # the large products' own GEMM (CpuBackend.matmul)
        a, b = np.random.default_rng(1).standard_normal((2, 8, 8)).astype(compute)
        _own_product(a, b, np.empty((8, 8), compute))
    if write_marker:
        path = warm.READY.marker(kernels)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(kernels), f)
        os.replace(path + ".tmp", path)


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
    for bound in (-1, 1 << 62):   # every parallel build, then every serial one
        _set_bounds(bound)
        for N in (1, 2, FUSED_INPUT_ROWS):
            x = rng.standard_normal((T, N, kernels.input_size)).astype(dtype)
            lengths = np.maximum(1, T - np.arange(N) % T).astype(np.int64)
            for extra in ({}, dict(sequence_length=lengths, use_sequence_length=True, **clip)):
                RNN(x, params, **kw, **extra)
                out, *_, handle = RNN(x, params, **kw, **extra, train=True)
                rnn_backward(handle, np.ones_like(out))
    _set_bounds(None)


def compile_ahead(sets, jobs, force=False, say=print):
    """Replay each kernel set in a process of its own, `jobs` at a time (marked sets are
    skipped unless `force`). Returns the names of those that failed."""
    pending = [k for k in sets if force or not os.path.exists(warm.READY.marker(k))]
    for k in sets:
        if k not in pending:
            say(f"  {k.name}: ready")
    running, failed = {}, []
    env = dict(os.environ, **{warm.ENV: "0"})
    while pending or running:
        while pending and len(running) < jobs:
            k = pending.pop(0)
            running[k] = subprocess.Popen(
                [sys.executable, "-m", "fusedrnn.precompile", json.dumps(asdict(k))],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for k, child in list(running.items()):
            if child.poll() is None:
                continue
            del running[k]
            if child.returncode:
                failed.append(k.name)
                say(f"  {k.name}: FAILED\n{child.stdout.read()}")
            else:
                say(f"  {k.name}: compiled")
        time.sleep(0.05)
    return failed


def main(args):
    """`python -m fusedrnn compile`: the CPU kernels into Numba's disk cache, ahead."""
    modes = MODES if args.modes == "all" else tuple(args.modes.split(","))
    dtypes = tuple(args.dtypes.split(","))
    unknown = sorted(set(modes) - set(MODES)) + sorted(set(dtypes) - set(PRECISIONS))
    if unknown:
        print(f"compile: unknown modes or dtypes {unknown}; modes: {', '.join(MODES)}, "
              f"dtypes: {', '.join(PRECISIONS)}", file=sys.stderr)
        return 2
    sets = list(warm.sets_for(modes, dtypes))
    print(f"fusedrnn compile: {len(sets)} kernel sets into {warm.marker_dir()}, {args.jobs} at a "
          f"time")
    start = time.perf_counter()
    failed = compile_ahead(sets, args.jobs, args.force)
    print(f"done in {time.perf_counter() - start:.0f} s" +
          (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0




if __name__ == "__main__":   # the background compile (warm.Readiness._start)
    replay(warm.KernelSet(**json.loads(sys.argv[1])))
