"""How the benchmark measures: interleaved repeats after a warm-up, medians with min-max,
a GEMM ceiling measured in the same run, and cold starts in fresh processes."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from . import peers as peer_lib

PEERS = ("fusedrnn", "torch", "naive", "naive-hoisted")


class Device:
    """The array module and clock of one device: a host clock on CPU, CUDA events on GPU
    (recorded on the current stream, which both CuPy and torch use by default)."""

    def __init__(self, name):
        self.name = name
        if name == "gpu":
            import cupy
            self.xp = cupy
            self.torch_device = "cuda"
        else:
            self.xp = np
            self.torch_device = "cpu"

    def time(self, fn):
        if self.name == "cpu":
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        start, end = self.xp.cuda.Event(), self.xp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return self.xp.cuda.get_elapsed_time(start, end) / 1e3


def gemm_ceiling(device, dtype, repeats=5):
    """The best GFLOP/s of a large square GEMM through the same BLAS the op uses."""
    n = 2048 if device.name == "cpu" else 8192
    rng = np.random.default_rng(1)
    a = device.xp.asarray(rng.standard_normal((n, n)).astype(dtype))
    b = device.xp.asarray(rng.standard_normal((n, n)).astype(dtype))
    out = device.xp.empty((n, n), dtype)
    device.xp.matmul(a, b, out=out)
    best = min(device.time(lambda: device.xp.matmul(a, b, out=out)) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def available_peers(device, wanted):
    """(peers that run, lines for those skipped)."""
    runnable, notes = [], []
    for name in wanted:
        if name == "torch":
            try:
                import torch
                if device.name == "gpu" and not torch.cuda.is_available():
                    notes.append("torch: installed without CUDA, skipped on the GPU")
                    continue
            except ImportError:
                notes.append("torch: not installed, skipped (pip install fusedrnn[torch])")
                continue
        runnable.append(name)
    return runnable, notes


def _make(name, inputs, device):
    if name == "fusedrnn":
        return peer_lib.fusedrnn_peer(inputs)
    if name == "torch":
        return peer_lib.torch_peer(inputs, device.torch_device)
    return peer_lib.naive_peer(inputs, hoisted=name == "naive-hoisted")


def run_case(case, device, dtype, peer_names, repeats):
    """{peer: [seconds per call, ...]} for one case; a peer without this mode is absent."""
    inputs = peer_lib.Inputs(case, device.xp, dtype)
    calls = {name: _make(name, inputs, device) for name in peer_names}
    calls = {name: fn for name, fn in calls.items() if fn is not None}
    for fn in calls.values():  # warm-up: compilation, allocation, caches
        device.time(fn)
    times = {name: [] for name in calls}
    for _ in range(repeats):  # interleaved, so drift on a shared machine hits all alike
        for name, fn in calls.items():
            _settle(device)
            times[name].append(device.time(_burst(fn, case.burst)) / case.burst)
    return times


def _burst(fn, calls):
    if calls == 1:
        return fn

    def run():
        for _ in range(calls):
            fn()
    return run


# On the CPU every timed call starts after a pause: OpenBLAS's threads spin for about
# 0.1 s after each call (THREAD_TIMEOUT, 2^28 cycles) and OpenMP pools spin too, so a
# peer timed right after another shares the 2 cores with those spinning threads and the
# interleaving order, not the code, decides who pays. Measured on the 2-core machine:
# fusedrnn's rnn_relu loop (T=300 N=20 H=800) took 210 ms right after an OpenBLAS GEMM
# and 143 ms when started 0.3 s later.
SETTLE_S = 0.3


def _settle(device):
    if device.name == "cpu":
        time.sleep(SETTLE_S)


COLD_SCRIPT = """
import time, json, sys
t0 = time.perf_counter()
import numpy as np
import fusedrnn
t1 = time.perf_counter()
{arrays}
n = fusedrnn.param_size(mode='{mode}', input_size={I}, state_size={H})
x = xp.asarray(np.random.default_rng(0).standard_normal(({T}, {N}, {I})).astype('{dtype}'))
p = xp.asarray(np.random.default_rng(1).uniform(-0.05, 0.05, n).astype('{dtype}'))
t2 = time.perf_counter()
out = fusedrnn.RNN(x, p, state_size={H}, num_layers=1, mode='{mode}')
{sync}
t3 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, first_call_s=t3 - t2)))
"""


def cold_start(case, device, dtype, repeats):
    """Seconds of import and of the first call, each in a fresh process (the Numba cache
    is warm after the first process ever; the warm-up process below makes sure of it)."""
    arrays, sync = ("import cupy as xp", "xp.cuda.runtime.deviceSynchronize()") if (
        device.name == "gpu") else ("xp = np", "")
    script = COLD_SCRIPT.format(arrays=arrays, sync=sync, mode=case.mode, I=case.I, H=case.H,
                                T=case.T, N=case.N, dtype=np.dtype(dtype).name)
    results = []
    for i in range(repeats + 1):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True, env=dict(os.environ))
        if i:  # the first process may fill the on-disk kernel cache
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"fusedrnn": [r["import_s"] + r["first_call_s"] for r in results],
            "import": [r["import_s"] for r in results]}


def summary(times):
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "runs": len(times)}
