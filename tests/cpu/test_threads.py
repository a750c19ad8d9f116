"""fusedrnn.cpu.threads: concurrent calls from many Python threads (no abort, results
identical to serial), and the parallel and serial builds of one kernel."""
import threading

import numpy as np
from numba import prange

import fusedrnn
from conftest import MODES, make_case
from fusedrnn.cpu import threads


def test_threading_layer_is_guarded_when_not_threadsafe():
    if threads.LAYER == "workqueue":
        assert isinstance(threads.LAUNCH_LOCK, type(threading.Lock()))


def test_concurrent_calls_match_serial():
    """8 threads x 200 calls of mixed modes and shapes, training forward + backward."""
    cases = [make_case(mode, T=2 + i % 4, N=1 + i % 3, L=1 + i % 3, D=1 + i % 2, seed=i)
             for i, mode in enumerate(MODES * 3)]

    def run(case, kw, heads):
        *outs, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
        return outs, fusedrnn.rnn_backward(handle, **heads)

    serial = [run(*c) for c in cases]
    results, errors = {}, []

    def worker(w):
        try:
            for rep in range(200):
                i = (w * 7 + rep) % len(cases)
                results[(w, rep)] = (i, run(*cases[i]))
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors
    assert len(results) == 1600
    for i, (outs, grads) in results.values():
        want_outs, want_grads = serial[i]
        assert all(np.array_equal(a, b) for a, b in zip(outs, want_outs))
        assert all((a is None and b is None) or np.array_equal(a, b)
                   for a, b in zip(grads, want_grads))


def test_warns_when_numba_threads_started_first_on_a_spinning_layer():
    """If Numba's pool was started (OpenMP) before fusedrnn chose, fusedrnn keeps the
    running layer, takes no lock (OpenMP is thread-safe) and says why calls are slow."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = ("import warnings, numba\n"
            "numba.config.THREADING_LAYER = 'omp'\n"
            "numba.get_num_threads(); numba.config.THREADING_LAYER = 'default'\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    from fusedrnn.cpu import threads\n"
            "assert threads.LAYER == 'omp', threads.LAYER\n"
            "assert any('started (OpenMP layer)' in str(x.message) for x in w), w\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop("NUMBA_THREADING_LAYER", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def _doubled(x, out):
    for i in prange(x.shape[0]):
        out[i] = 2 * x[i]


def test_parallel_and_serial_builds_agree_and_are_cached_apart():
    """Numba's disk cache files a kernel under its function's name, not its flags: the
    serial twin must have its own name, or each build would evict (or be served) the
    other's machine code. The original function keeps its name."""
    parallel, serial = threads.parallel_and_serial(_doubled)
    x = np.arange(1000.0)
    outs = [np.full_like(x, np.nan), np.full_like(x, np.nan)]
    parallel(x, outs[0])
    serial(x, outs[1])
    assert np.array_equal(outs[0], 2 * x) and np.array_equal(outs[1], 2 * x)
    assert parallel.targetoptions.get("parallel") and not serial.targetoptions.get("parallel")
    assert _doubled.__qualname__ == "_doubled" and serial.py_func.__qualname__ == "_doubled_serial"
    names = {build._cache._impl._filename_base for build in (parallel, serial)}
    assert len(names) == 2
