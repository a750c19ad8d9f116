"""The packed GEMM micro-kernel against numpy's BLAS at the recurrent product's shape.

    python -m fusedrnn.benchmark.microkernel [--repeats 20] [--dtype float32|float64]

C = A @ W.T with A (20, 800), one step's h_{t-1} in the design-doc case, and W (cols, 800)
for cols = 3200 (an LSTM's 4H at H = 800) and 800, timed side by side in one run:
  numpy   np.matmul(A, W.T, out=C): OpenBLAS, which re-packs W on every call
  kernel  panel_gemm (fusedrnn/cpu/lowlevel/microkernel.py) over W packed once into 16-column
          panels (outside the timing), the panels split over Numba's threads by prange,
          as the fused layer loop does
Prints the median GFLOP/s (2*N*K*cols per call) of each and kernel/numpy.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numba as nb
import numpy as np
from numba import prange

from fusedrnn.cpu.lowlevel import PANEL, pack_input_weights, panel_gemm, panels

N, K, COLUMNS = 20, 800, (3200, 800)


def make_kernel(dtype):
    itemsize, zero = np.dtype(dtype).itemsize, np.dtype(dtype).type(0)   # zero: the precision

    @nb.njit(parallel=True, nogil=True)
    def kernel(a, wpack, c):
        quads = wpack.shape[0] // 4
        for q in prange(quads):      # four 16-column panels of C per iteration, as an
            p = 4 * q                # LSTM block's four gates are
            panel_gemm(a.ctypes.data, a.shape[1], a.shape[0], wpack[p].ctypes.data,
                       a.shape[1] * PANEL, 4, c.ctypes.data + p * PANEL * itemsize,
                       c.shape[1], a.shape[1], zero)
        for p in range(4 * quads, wpack.shape[0]):
            panel_gemm(a.ctypes.data, a.shape[1], a.shape[0], wpack[p].ctypes.data, 0, 1,
                       c.ctypes.data + p * PANEL * itemsize, c.shape[1], a.shape[1], zero)
    return kernel


def calls_per_sample(f, seconds=0.02):
    """Calls per timed sample, so that one sample lasts ~`seconds`: a single call is
    below the timer's useful resolution and its noise."""
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        f()
        calls += 1
    return calls


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=20, help="timed samples per method")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = p.parse_args()
    dtype = np.dtype(args.dtype)
    kernel = make_kernel(dtype)
    rng = np.random.default_rng(0)
    print(f"{dtype}, N={N}, K={K}, {nb.get_num_threads()} Numba threads; "
          f"median of {args.repeats} after a warm-up")
    print(f"{'cols':>6} {'numpy GFLOP/s':>14} {'kernel GFLOP/s':>15} {'kernel/numpy':>13}")
    for cols in COLUMNS:
        a = rng.standard_normal((N, K)).astype(dtype)
        w = rng.standard_normal((cols, K)).astype(dtype)
        wpack = pack_input_weights([w], np.empty((panels(cols), K, PANEL), dtype))  # not timed
        c_numpy, c_kernel = np.empty((N, cols), dtype), np.empty((N, cols), dtype)
        methods = {"numpy": lambda: np.matmul(a, w.T, out=c_numpy),  # noqa: B023  (called in this iteration)
                   "kernel": lambda: kernel(a, wpack, c_kernel)}  # noqa: B023  (called in this iteration)
        # Warm-up (compiles the kernel, spins up both thread pools), then a check: a fast
        # wrong answer is worth nothing.
        calls = {name: calls_per_sample(f) for name, f in methods.items()}
        tol = 1e-5 if dtype == np.float32 else 1e-12
        assert np.max(np.abs(c_kernel - c_numpy)) <= tol * np.max(np.abs(c_numpy))
        times = {name: [] for name in methods}
        for _ in range(args.repeats):        # interleaved: both see the same machine state
            for name, f in methods.items():
                t0 = time.perf_counter()
                for _ in range(calls[name]):
                    f()
                times[name].append((time.perf_counter() - t0) / calls[name])
        gflops = {name: 2 * N * K * cols / statistics.median(t) / 1e9 for name, t in times.items()}
        print(f"{cols:>6} {gflops['numpy']:>14.1f} {gflops['kernel']:>15.1f} "
              f"{gflops['kernel'] / gflops['numpy']:>13.2f}")


if __name__ == "__main__":
    main()
