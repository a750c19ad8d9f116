"""The GPU's two paths against each other, in seconds: the persistent kernels and the
per-step path on the same inputs, every mode, float32 and float64, forward and all
gradients. No CPU reference, so no Numba compile: the check to run on a lent GPU next to
a benchmark of a changed kernel when there is no time for the full suite
(tests/gpu/test_parity.py checks both paths against the CPU).

    PYTHONPATH=. python3 -m fusedrnn.benchmark.gpu_crosscheck   # exit status 1 on any mismatch
"""
import os
import sys

import cupy
import numpy as np

import fusedrnn
from fusedrnn.config import CELLS
from fusedrnn.gpu.persistent import ENV


def run(persistent, mode, dtype, T=24, N=20, I=37, H=203, L=2, D=2, seed=0):
    """Outputs and gradients of one training call (odd H: the remainder loops run)."""
    os.environ[ENV] = persistent
    fusedrnn.clear_cache()
    rng = np.random.default_rng(seed)
    kw = dict(mode=mode, state_size=H, num_layers=L, bidirectional=D == 2)
    size = fusedrnn.param_size(input_size=I, **kw)
    x = cupy.asarray(rng.standard_normal((T, N, I)), dtype)
    w = cupy.asarray(rng.uniform(-H ** -0.5, H ** -0.5, size), dtype)
    h0 = cupy.asarray(0.5 * rng.standard_normal((L * D, N, H)), dtype)
    c0 = (cupy.asarray(0.5 * rng.standard_normal((L * D, N, H)), dtype)
          if CELLS[mode].has_cell_state else None)
    *outs, handle = fusedrnn.RNN(x, w, h0, c0, **kw, state_outputs=True, train=True)
    dout = cupy.asarray(rng.standard_normal(outs[0].shape), dtype)
    grads = fusedrnn.rnn_backward(handle, dout)
    return [cupy.asnumpy(a) for a in (*outs, grads.data, grads.parameters, grads.state,
                                      grads.state_cell) if a is not None]


def main():
    worst = {}
    for dtype in (np.float32, np.float64):
        for mode in fusedrnn.MODES:
            pairs = zip(run("1", mode, dtype), run("0", mode, dtype), strict=True)
            err = max(np.max(np.abs(a - b)) / np.max(np.abs(b)) for a, b in pairs)
            worst[mode, np.dtype(dtype).name] = err
    bad = False
    for (mode, dtype), err in worst.items():
        tol = 1e-5 if dtype == "float32" else 1e-12
        ok = err <= tol   # NaN fails
        bad |= not ok
        print(f"{mode:9s} {dtype}: persistent vs per-step max rel err {err:.2e} "
              f"({'ok' if ok else 'MISMATCH'}, tol {tol:g})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
