"""How the benchmark measures: loop timing, each peer in its own process.

A user's loop (training, a decoder, a server) calls the op back to back, so every figure
is the time of a block of back-to-back calls divided by its calls: a block lasts at least
`block_s` (BLOCK_S by default), blocks of the peers take turns (A, B, A, B, ...), and a
case reports the median block with min-max. Nobody pauses before a call.

Each peer runs in a worker process of its own (`python -m fusedrnn.benchmark.worker`),
because on 2 cores a peer's idle threads tax whoever runs next: OpenBLAS's threads and
OpenMP pools spin for a while after a call. Across processes that spinning still overlaps
the next turn, so a peer's figure depended on which peers ran before it
(bench/results/cpu.md#peers-do-not-disturb-each-other). So a turn starts only once every
other worker has gone idle (Pool.wait_quiet: their threads' CPU time stops growing),
then runs untimed warm-in calls (WARM_S of them, at most a block) that wake its own
threads, then its timed block: the turn measures the steady loop, not the hand-over.

Train-step cases also time, after each step, the torch Linear + loss of peers.TrainStep:
the same torch ops in the process that trains fusedrnn.torch and in the one that trains
torch.nn, so their ratio is what fusedrnn's threads cost a program's other ops.
"""
from __future__ import annotations

import glob
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

BLOCK_S = 0.05   # a timed block lasts at least this long
WARM_S = 0.1     # untimed calls at the start of each turn (as long as OpenBLAS spins)
LONG_CALL_S = 1.0  # calls at least this long get no warm-in (see size_block)


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
            import numpy
            self.xp = numpy
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

    def sync(self):
        if self.name == "gpu":  # the whole device: torch's stream as well as CuPy's
            self.xp.cuda.runtime.deviceSynchronize()


def size_block(device, fn, block_s=BLOCK_S, warm_s=WARM_S):
    """(calls, warm): how many back-to-back calls of `fn`, already warmed up, make a block
    of at least `block_s`, and how many untimed calls start each turn."""
    calls, elapsed = 0, 0.0
    while elapsed < block_s / 2:  # calibrate on half a block (one call at least)
        elapsed += device.time(fn)
        calls += 1
    per_call = elapsed / calls
    calls = max(1, math.ceil(block_s / per_call))
    # Warm-in covers the last peer's spinning threads; past LONG_CALL_S the hand-over
    # is a tenth of one call at most, and a warm call would double a slow case's time.
    return calls, 0 if per_call >= LONG_CALL_S else min(calls, math.ceil(warm_s / per_call))


def time_block(device, fn, calls, warm):
    """Seconds per call of one turn: `warm` untimed calls, then `calls` timed back to back."""
    for _ in range(warm):
        fn()

    def block():
        for _ in range(calls):
            fn()
    return device.time(block) / calls


def torch_available(device):
    """None where torch can run on `device`, else the reason it cannot."""
    try:
        import torch
    except ImportError:
        return "torch: not installed, skipped (pip install fusedrnn[torch])"
    if device == "gpu" and not torch.cuda.is_available():
        return "torch: installed without CUDA, skipped on the GPU"
    return None


class Worker:
    """One peer's process: it builds a case's callable, calibrates the block, and runs
    blocks on request (worker.py holds the other side of this line protocol)."""

    def __init__(self, peer, device, kind):
        self.peer, self.kind = peer, kind
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fusedrnn.benchmark.worker", peer, device, kind],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            env=_child_env())

    def ask(self, **message):
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench worker {self.peer} ({self.kind}) exited with "
                               f"{self.proc.wait()}; its stderr is above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"bench worker {self.peer}: {reply['error']}")
        return reply

    def close(self):
        if self.proc.poll() is None:
            try:
                self.ask(action="quit")
            except (RuntimeError, OSError, ValueError):
                pass
        self.proc.wait(timeout=30)


def cpu_ns(pid):
    """CPU time so far of every thread of process `pid` (ns; Linux's schedstat), or None
    where the system does not tell."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:   # a thread that ended meanwhile
            continue
        except (OSError, ValueError, IndexError):
            return None
    return total if total else None


QUIET_WINDOW_S = 0.01   # others count as idle when, over this long,
QUIET_SHARE = 0.05      # their threads ran less than this share of it
QUIET_TIMEOUT_S = 2.0   # a peer that never idles (a busy machine) delays a turn this long


def wait_quiet(pids, window_s=QUIET_WINDOW_S, share=QUIET_SHARE, timeout_s=QUIET_TIMEOUT_S):
    """Waits until the processes `pids` have gone idle (their threads' CPU time grew by
    less than `share` of a window over one window) or `timeout_s` has passed; where /proc
    does not tell, waits one timeout's tenth instead. Returns the seconds waited."""
    start = time.perf_counter()
    before = [cpu_ns(pid) for pid in pids]
    if any(b is None for b in before):
        time.sleep(timeout_s / 10)
        return time.perf_counter() - start
    while time.perf_counter() - start < timeout_s:
        time.sleep(window_s)
        after = [cpu_ns(pid) or 0 for pid in pids]
        if sum(after) - sum(before) < share * window_s * 1e9:
            break
        before = after
    return time.perf_counter() - start


class Pool:
    """Worker processes by (peer, kind), started on first use: op cases and train steps
    get separate processes, so torch's thread pool, started by a train step, never idles
    beside a numpy user's op calls."""

    def __init__(self, device):
        self.device = device
        self.workers = {}

    def wait_quiet(self, worker):
        """Before `worker`'s turn: every other worker idle (module doc)."""
        others = [w.proc.pid for w in self.workers.values()
                  if w is not worker and w.proc.poll() is None]
        return wait_quiet(others) if others else 0.0

    def get(self, peer, kind):
        key = (peer, kind)
        if key not in self.workers:
            self.workers[key] = Worker(peer, self.device, kind)
        return self.workers[key]

    def close(self):
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()


def run_case(pool, case, dtype, peer_names, repeats, block_s=BLOCK_S):
    """{peer: [seconds per call, ...]} for one case (train steps add "PEER neighbour"
    entries); a peer without this mode is absent."""
    kind = "step" if case.model else "op"
    prepared = {}
    for name in peer_names:
        worker = pool.get(name, kind)
        pool.wait_quiet(worker)   # the block is sized on a quiet machine too
        reply = worker.ask(action="prepare", case=asdict(case), dtype=dtype, block_s=block_s,
                           warm_s=WARM_S)
        if not reply.get("skip"):
            prepared[name] = worker
    times = {}
    for _ in range(repeats):  # turns alternate, so drift on a shared machine hits all alike
        for name, worker in prepared.items():
            pool.wait_quiet(worker)
            reply = worker.ask(action="block")
            times.setdefault(name, []).append(reply["seconds"])
            if "neighbour" in reply:
                times.setdefault(f"{name} neighbour", []).append(reply["neighbour"])
    for worker in prepared.values():
        worker.ask(action="release")
    return times


def ceilings(pool, peer, dtypes):
    """The machine's GEMM ceilings in `dtypes` (worker.gemm_ceilings), measured in a process
    of their own, closed after: they import torch, which in `peer`'s op worker would have set
    fusedrnn's threading layer to a torch program's (cpu/threads.py) for the numpy
    program it times."""
    worker = pool.get(peer, "ceiling")
    try:
        return worker.ask(action="ceiling", dtypes=list(dtypes))["ceilings"]
    finally:
        pool.workers.pop((peer, "ceiling")).close()


def _child_env(first_tier=False):
    """A benchmark process's environment: this checkout first on its path; the fused
    kernels from its warm-up call (a loop's steady state), not behind the first tier
    (cpu/warm.py), unless `first_tier` (first use, as users get it)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1")
    if first_tier:
        env.pop("FUSEDRNN_FIRST_TIER", None)
    else:
        env["FUSEDRNN_FIRST_TIER"] = "0"
    return env


COLD_SCRIPT = """
import json, time
t0 = time.perf_counter()
import numpy as np
{imports}
t1 = time.perf_counter()
rng = np.random.default_rng(0)
x = rng.standard_normal(({T}, {N}, {I})).astype('{dtype}')
{setup}
t2 = time.perf_counter()
{infer}
{sync}
t3 = time.perf_counter()
{train}
{sync}
t4 = time.perf_counter()
{after}
print(json.dumps(dict(import_s=t1 - t0, infer_s=t3 - t2, train_s=t4 - t3)))
"""

_COLD = {
    "fusedrnn": dict(
        imports="import fusedrnn\n{arrays}",
        setup="n = fusedrnn.param_size(mode='{mode}', input_size={I}, state_size={H})\n"
              "p = xp.asarray(rng.uniform(-0.05, 0.05, n).astype('{dtype}'))\n"
              "x = xp.asarray(x)\n"
              "kw = dict(state_size={H}, num_layers=1, mode='{mode}')",
        infer="fusedrnn.RNN(x, p, **kw)",
        train="out, handle = fusedrnn.RNN(x, p, **kw, train=True)\n"
              "fusedrnn.rnn_backward(handle, xp.ones_like(out))",
        sync="{cupy_sync}",
        # (a user's background compile goes on; the next fresh process must not share
        # the cores with it)
        after="{stop_compiles}"),
    "torch": dict(
        imports="import torch\nfrom fusedrnn.benchmark.peers import torch_module",
        setup="m = torch_module('{mode}', {I}, {H}).to('{torch_device}', torch.{dtype})\n"
              "x = torch.from_numpy(x).to('{torch_device}')",
        infer="with torch.no_grad(): m(x)",
        train="m(x)[0].sum().backward()",
        sync="{torch_sync}", after=""),
}


def cold_start(case, device, dtype, repeats, peers):
    """{peer: [import + first inference + first training step, s], "PEER import": [...],
    "PEER infer": [...], "PEER train": [...]}, each run in a fresh process, as a user's
    first process runs (the CPU's first tier on). An "empty" case gives each process a
    new, empty kernel cache (NUMBA_CACHE_DIR); a "warm" one first fills the cache, untimed,
    with what the background compile would leave there for this kind of op."""
    gpu = device == "gpu"
    fill = dict(arrays="import cupy as xp" if gpu else "xp = np",
                cupy_sync="xp.cuda.runtime.deviceSynchronize()" if gpu else "",
                torch_sync="torch.cuda.synchronize()" if gpu else "",
                stop_compiles="" if gpu else "from fusedrnn.cpu import warm\nwarm.READY.stop()",
                mode=case.mode, I=case.I, H=case.H, T=case.T, N=case.N, dtype=dtype,
                torch_device="cuda" if gpu else "cpu")
    results = {}
    for peer in peers:
        parts = {k: v.format(**fill) for k, v in _COLD[peer].items()}
        script = COLD_SCRIPT.format(**dict(fill, **parts))
        runs = []
        if case.cache == "warm" and peer == "fusedrnn" and not gpu:
            kernels = {"mode": case.mode, "dtype": dtype, "form": "single" if case.T == 1
                       else "loop", "input_size": case.I, "state_size": case.H}
            subprocess.run([sys.executable, "-m", "fusedrnn.precompile", json.dumps(kernels)],
                           check=True, capture_output=True, env=_child_env())
        for i in range(repeats + (case.cache == "warm")):
            env = _child_env(first_tier=True)
            scratch = None
            if case.cache == "empty" and peer == "fusedrnn":
                scratch = tempfile.mkdtemp(prefix="fusedrnn-cold-")
                env["NUMBA_CACHE_DIR"] = scratch
            try:
                done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                      text=True, env=env)
            finally:
                if scratch:
                    shutil.rmtree(scratch, ignore_errors=True)
            if done.returncode:
                raise RuntimeError(f"cold start of {peer} failed:\n{done.stderr}")
            if case.cache == "warm" and i == 0:
                continue  # this process may have filled the kernel cache
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        results[peer] = [r["import_s"] + r["infer_s"] + r["train_s"] for r in runs]
        for part in ("import", "infer", "train"):
            results[f"{peer} {part}"] = [r[f"{part}_s"] for r in runs]
    return results


def summary(times):
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "runs": len(times)}
