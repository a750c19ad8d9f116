"""One peer's benchmark process: `python -m fusedrnn.benchmark.worker PEER DEVICE KIND`.

It reads one JSON request a line on stdin and answers one JSON line on stdout (anything
else the process prints goes to stderr):
  {"action": "prepare", "case": {...}, "dtype": "float32", "block_s": .05, "warm_s": .1}
      builds the case's callable and warms it up (compilation, allocation), then sizes a
      block: {"calls": n} with n calls lasting at least block_s, or {"skip": true} where
      the peer has no such mode
  {"action": "block"}     warm-in calls, then n timed back-to-back calls:
                          {"seconds": per call} (+ "neighbour": per call, train steps)
  {"action": "release"}   drops the callable and its arrays
  {"action": "ceiling", "dtypes": [...]}   {"ceilings": gemm_ceilings(dtypes=...)}
  {"action": "quit"}
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

from .cases import Case
from .peers import make
from .runner import Device, size_block, time_block


class Session:
    def __init__(self, peer, device, kind):
        self.peer, self.kind = peer, kind
        self.device = Device(device)
        self.fn = None

    def prepare(self, case, dtype, block_s, warm_s):
        case = Case(**case)
        self.fn = make(self.peer, case, self.device.xp, dtype, self.device.torch_device)
        if self.fn is None:
            return {"skip": True}
        self.device.time(self.fn)  # compilation, allocation, caches
        self.calls, self.warm = size_block(self.device, self.fn, block_s, warm_s)
        return {"calls": self.calls}

    def block(self):
        fn = self.fn
        neighbour = getattr(fn, "neighbour", None)
        if neighbour is None:
            return {"seconds": time_block(self.device, fn, self.calls, self.warm)}
        for _ in range(self.warm):
            fn()
        # A train step, then the program's own torch ops, each timed by itself.
        step_s = other_s = 0.0
        clock, sync = time.perf_counter, self.device.sync
        for _ in range(self.calls):
            t0 = clock()
            fn()
            sync()
            t1 = clock()
            neighbour()
            sync()
            step_s += t1 - t0
            other_s += clock() - t1
        return {"seconds": step_s / self.calls, "neighbour": other_s / self.calls}

    def release(self):
        self.fn = None
        return {}

    def handle(self, msg):
        action = msg.pop("action")
        if action == "prepare":
            return self.prepare(**msg)
        if action == "block":
            return self.block()
        if action == "release":
            return self.release()
        if action == "ceiling":
            return {"ceilings": gemm_ceilings(self.device, dtypes=msg.get("dtypes", DTYPES))}
        raise ValueError(f"unknown action {action!r}")


# The ceilings' dtypes; a library as slow as torch's bfloat16 mm without AVX512-BF16 is timed
# by its first call alone: it is far from any ceiling, and repeats would only delay the run.
DTYPES = ("float32", "float64", "bfloat16")
SLOW_S = 2.0


def gemm_ceilings(device, repeats=5, n=None, dtypes=DTYPES):
    """{dtype: {"best": GFLOP/s, "by": library, library: GFLOP/s, ...}}: the fastest GEMM
    this process can reach in each of `dtypes`. On the CPU the float32 and bfloat16 ceilings
    are usually oneDNN's (torch's mkldnn Linear; on Zen 4 and 5 about twice MKL's torch.mm
    and numpy's OpenBLAS, which are listed beside it); float64 has no oneDNN path, so
    numpy's and torch.mm's. On the GPU, cuBLAS through torch (TF32 off) and CuPy. A library
    that cannot run a dtype on this CPU is listed under "unavailable" with its error's last
    line (oneDNN's bfloat16 without AVX-512); where none could, best and by are None."""
    import numpy as np
    n = n or (2048 if device.name == "cpu" else 8192)
    rng = np.random.default_rng(1)
    flops = 2 * n ** 3
    found = {}

    def best(name, dtype, fn):
        try:
            first = device.time(fn)   # (the warm-up too)
        except RuntimeError as error:   # (oneDNN's bfloat16 needs AVX-512 or AVX-NE-CONVERT)
            lines = str(error).strip().splitlines() or [type(error).__name__]
            found.setdefault(dtype, {}).setdefault("unavailable", {})[name] = lines[-1]
            return
        seconds = first if first >= SLOW_S else min(device.time(fn) for _ in range(repeats))
        found.setdefault(dtype, {})[name] = flops / seconds / 1e9

    for dtype in [d for d in ("float32", "float64") if d in dtypes]:
        a = device.xp.asarray(rng.standard_normal((n, n)).astype(dtype))
        best("numpy" if device.name == "cpu" else "cupy", dtype, lambda: a @ a)  # noqa: B023  (called in this iteration)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        dev = device.torch_device
        for dtype in [d for d in DTYPES if d in dtypes]:
            a = torch.randn(n, n, dtype=getattr(torch, dtype), device=dev)
            with torch.no_grad():
                best("torch.mm", dtype, lambda: torch.mm(a, a))  # noqa: B023  (called in this iteration)
                if device.name == "cpu" and dtype != "float64":
                    import torch.utils.mkldnn
                    linear = torch.nn.Linear(n, n, bias=False).to(getattr(torch, dtype))
                    linear = torch.utils.mkldnn.to_mkldnn(linear.eval(), getattr(torch, dtype))
                    x = a.to_mkldnn()
                    best("oneDNN", dtype, lambda: linear(x))  # noqa: B023  (called in this iteration)
    for by_lib in found.values():
        timed = [k for k in by_lib if k != "unavailable"]
        name = max(timed, key=by_lib.get) if timed else None
        by_lib["best"], by_lib["by"] = (by_lib[name] if timed else None), name
    return found


def main(argv):
    peer, device, kind = argv
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints must not reach the protocol
    session = Session(peer, device, kind)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("action") == "quit":
            protocol.write("{}\n")
            break
        try:
            reply = session.handle(msg)
        except Exception:  # noqa: BLE001  (the coordinator reports it)
            reply = {"error": traceback.format_exc()}
        protocol.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
