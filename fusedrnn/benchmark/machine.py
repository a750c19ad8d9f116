"""The machine constants that the CPU's serial/parallel bounds depend on, measured here.

    python -m fusedrnn.benchmark.machine [--repeats 300] [--json FILE]

- launch_us: one empty parallel region (two iterations of a prange) under each of Numba's
  threading layers, each in a process of its own (Numba fixes one layer per process), no
  torch: calls back to back, and each after IDLE_S idle (the workers asleep, or the CPU
  halted under a hypervisor). OpenMP spins as fusedrnn sets it in torch programs.
  Median and tenth percentile, microseconds.
- core_gflops: one thread's float32 rate on a single step's product, N=128 samples by
  W (512 x 512): the T=1 micro-kernel (panel_gemm_t over 16-sample column panels) and
  numpy's BLAS capped at one thread.
- l2_bytes: one core's L2, from Linux's sysfs (None elsewhere), as fused.l2_bytes reads it
  for the loops' weight bound (SERIAL_LOOP_BYTES, printed beside it).
- serial_bound: the multiply-adds below which one core beats two workers that split the
  work evenly but pay one launch: 2 * launch * (one core's multiply-adds per second), for
  each layer, beside the bound fused.py uses today (SERIAL_WORK).

Prints one line per constant and writes them as JSON. Of these only the L2 sets a rule
today; the others are the inputs a derived rule would take
(bench/results/cpu-kernel-notes.md#machine-constants).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

LAYERS = ("workqueue", "omp")
IDLE_S = 1e-3
BLOCK_S = 0.02
N, K, ROWS = 128, 512, 512   # one step of N samples by W (ROWS, K)

_LAUNCH_PROBE = """
import json, sys, time
import numba as nb
import numpy as np
from numba import prange

@nb.njit(parallel=True)
def region(a):
    for i in prange(2):
        a[i * 8] += 1.0

a = np.zeros(16)
for _ in range(50):
    region(a)
out = {}
for name, idle in (("back_to_back", 0.0), ("after_idle", float(sys.argv[2]))):
    times = []
    for _ in range(int(sys.argv[1])):
        if idle:
            time.sleep(idle)
        t0 = time.perf_counter()
        region(a)
        times.append(time.perf_counter() - t0)
    times.sort()
    out[name] = {"median": times[len(times) // 2] * 1e6, "p10": times[len(times) // 10] * 1e6}
out["layer"] = nb.threading_layer()
print(json.dumps(out))
"""


def launch_us(layer, repeats):
    """{back_to_back, after_idle: {median, p10}, layer} for one threading layer, measured
    in a fresh process; None where the layer cannot start (no OpenMP runtime, say). OpenMP
    with the short spin fusedrnn gives it in torch programs (threads.OPENMP_SPIN)."""
    from fusedrnn.cpu.threads import OPENMP_SPIN
    env = dict(os.environ, NUMBA_THREADING_LAYER=layer, NUMBA_NUM_THREADS="2",
               GOMP_SPINCOUNT=os.environ.get("GOMP_SPINCOUNT", OPENMP_SPIN))
    run = subprocess.run([sys.executable, "-c", _LAUNCH_PROBE, str(repeats), str(IDLE_S)],
                         env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


def _best_seconds(f, repeats):
    """The least of `repeats` timed blocks (BLOCK_S each) of back-to-back calls, per call."""
    f()
    best = float("inf")
    for _ in range(repeats):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < BLOCK_S:
            f()
            calls += 1
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def core_gflops(repeats):
    """{"microkernel", "numpy"}: one thread's GFLOP/s on the single step's product."""
    import numba as nb
    import threadpoolctl

    from fusedrnn.cpu.lowlevel import PANEL, panel_gemm_t

    @nb.njit
    def product(w, cols, c):
        K = w.shape[1]
        for b in range(w.shape[0] // PANEL):   # PANEL weight rows at a time, in place
            panel_gemm_t(w.ctypes.data + np.uint64(b * PANEL * K * 4), K, PANEL,
                         cols.ctypes.data, K * PANEL, cols.shape[0],
                         c.ctypes.data + np.uint64(b * PANEL * 4), c.shape[1], K,
                         np.float32(0))

    rng = np.random.default_rng(0)
    w = rng.standard_normal((ROWS, K), dtype=np.float32)
    x = rng.standard_normal((N, K), dtype=np.float32)
    cols = np.ascontiguousarray(x.reshape(N // PANEL, PANEL, K).transpose(0, 2, 1))
    c, ref = np.empty((N, ROWS), np.float32), np.empty((N, ROWS), np.float32)
    flops = 2.0 * N * K * ROWS
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        numpy_s = _best_seconds(lambda: np.matmul(x, w.T, out=ref), repeats)
        product(w, cols, c)
        # a fast wrong answer is worth nothing
        if not np.allclose(c, ref, rtol=1e-4, atol=1e-3):
            raise AssertionError("panel_gemm_t's product differs from numpy's")
        kernel_s = _best_seconds(lambda: product(w, cols, c), repeats)
    return {"microkernel": flops / kernel_s / 1e9, "numpy": flops / numpy_s / 1e9}


def measure(repeats):
    from fusedrnn.benchmark import cpu_info
    from fusedrnn.cpu.fused import SERIAL_LOOP_BYTES, SERIAL_WORK, l2_bytes
    launches = {layer: launch_us(layer, repeats) for layer in LAYERS}
    rates = core_gflops(max(3, repeats // 50))
    macs_per_s = rates["microkernel"] / 2 * 1e9
    return {"cpu": cpu_info(), "launch_us": launches, "core_gflops": rates,
            "l2_bytes": l2_bytes(),
            "serial_bound": {layer: (None if got is None else
                                     int(2 * got["back_to_back"]["median"] * 1e-6 * macs_per_s))
                             for layer, got in launches.items()},
            "serial_work_today": SERIAL_WORK, "serial_loop_bytes": SERIAL_LOOP_BYTES}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=300,
                        help="launches timed per layer and idle setting")
    parser.add_argument("--json", default="fusedrnn-machine.json")
    args = parser.parse_args(argv)
    got = measure(args.repeats)
    print(f"machine: {got['cpu']['name']}")
    for layer, t in got["launch_us"].items():
        if t is None:
            print(f"launch {layer}: not available")
            continue
        print(f"launch {layer}: back to back {t['back_to_back']['median']:.1f} us "
              f"(p10 {t['back_to_back']['p10']:.1f}), after {IDLE_S * 1e3:g} ms idle "
              f"{t['after_idle']['median']:.1f} us (p10 {t['after_idle']['p10']:.1f}); "
              f"serial bound {got['serial_bound'][layer]:.3g} multiply-adds")
    r = got["core_gflops"]
    print(f"one core, N={N} x W ({ROWS}, {K}): micro-kernel {r['microkernel']:.0f} GFLOP/s, "
          f"numpy {r['numpy']:.0f}")
    print(f"L2 per core: {got['l2_bytes']} bytes (SERIAL_LOOP_BYTES {got['serial_loop_bytes']}); "
          f"SERIAL_WORK today {got['serial_work_today']:.3g}")
    with open(args.json, "w") as f:
        json.dump(got, f, indent=1)
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
