"""fusedrnn.cpu.workshare: how the fused loops' workers share each step's blocks.

(a) claim, driven serially and round-robin from compiled drivers: every block of every
    step is taken exactly once; each worker takes blocks of its own share first and in
    order (a worker done with its own share takes the others' remaining blocks); an
    exhausted step answers -1 to everyone (workers > blocks included).
(b) The fused loops with more workers than threads (1 Numba thread, 2 and 5 workers),
    forward and backward through the op, in a subprocess with a time limit so that a
    barrier that waits forever fails the test instead of hanging it: results bitwise
    equal to the normal run's (a block's arithmetic does not depend on who runs it).
"""
import os
import subprocess
import sys
import textwrap

import numba as nb
import numpy as np
import pytest

from fusedrnn.cpu.workshare import claim, counter_stride


@nb.njit
def _serial(counters, steps, workers, blocks):
    """Worker 0 claims until -1, then worker 1, ... (one thread running every worker)."""
    order = np.full((steps, workers, blocks + 1), -2, np.int64)
    for step in range(steps):
        for w in range(workers):
            k = 0
            while True:
                b = claim(counters, step, w, workers, blocks)
                order[step, w, k] = b
                k += 1
                if b < 0:
                    break
    return order


@nb.njit
def _round_robin(counters, workers, blocks):
    """Workers take one block each in turn until all have seen -1."""
    order = np.full((workers, blocks + 1), -2, np.int64)
    count = np.zeros(workers, np.int64)
    finished = np.zeros(workers, np.bool_)
    while not finished.all():
        for w in range(workers):
            if not finished[w]:
                b = claim(counters, 0, w, workers, blocks)
                order[w, count[w]] = b
                count[w] += 1
                finished[w] = b < 0
    return order


def _share(w, workers, blocks):
    return list(range(w * blocks // workers, (w + 1) * blocks // workers))


@pytest.mark.parametrize("workers, blocks", [(1, 5), (2, 50), (2, 7), (3, 10), (5, 3),
                                             (4, 1)])
def test_serial_workers_take_every_block_once(workers, blocks):
    order = _serial(np.zeros((3, counter_stride(workers)), np.int64), 3, workers, blocks)
    for step in range(3):
        taken = [b for w in range(workers) for b in order[step, w] if b >= 0]
        assert sorted(taken) == list(range(blocks))
        # The first worker to run takes its own share first, then the rest in share order.
        first = [b for b in order[step, 0] if b >= 0]
        assert first[:len(_share(0, workers, blocks))] == _share(0, workers, blocks)
        for w in range(1, workers):   # nothing left for those that run later
            assert order[step, w, 0] == -1


@pytest.mark.parametrize("workers, blocks", [(2, 50), (2, 7), (3, 10), (5, 3), (3, 1)])
def test_interleaved_workers_take_their_own_share_first(workers, blocks):
    order = _round_robin(np.zeros((1, counter_stride(workers)), np.int64), workers, blocks)
    taken = [b for w in range(workers) for b in order[w] if b >= 0]
    assert sorted(taken) == list(range(blocks))
    for w in range(workers):
        own = _share(w, workers, blocks)
        got = [b for b in order[w] if b >= 0]
        mine = sum(b in own for b in got)    # the rest of its share went to stealers
        assert got[:mine] == own[:mine], (w, got)
        if workers <= blocks:   # (else a worker with an empty share may steal it first)
            assert mine > 0, (w, got)


_OVERSUBSCRIBED = textwrap.dedent("""
    import numba, numpy as np
    import fusedrnn
    from fusedrnn.cpu import fused
    from fusedrnn.layout import param_size

    def run(mode):
        rng = np.random.default_rng(7)
        T, N, I, H = 5, 3, 4, 37      # 3 blocks, the last partial
        n = param_size(mode=mode, input_size=I, state_size=H, num_layers=2,
                       bidirectional=True)
        p = rng.standard_normal(n) * 0.3
        x = rng.standard_normal((T, N, I))
        dout = rng.standard_normal((T, N, 2 * H))
        kw = dict(state_size=H, num_layers=2, mode=mode, bidirectional=True)
        out, handle = fusedrnn.RNN(x, p, **kw, train=True)
        grads = fusedrnn.rnn_backward(handle, dout)
        one = fusedrnn.RNN(x[:1], p, **kw)    # T=1: the single-step form
        return [out, *grads[:2], one]

    original = fused._workshare
    for mode in ("lstm", "gru"):
        fusedrnn.clear_cache()
        want = run(mode)
        numba.set_num_threads(1)
        for workers in (2, 5):
            def forced(steps, blocks, workers=workers):
                counters, _ = original(steps, blocks)
                stride = fused.counter_stride(workers)
                return np.zeros((steps, stride), np.int64), workers
            fused._workshare = forced
            fusedrnn.clear_cache()
            got = run(mode)
            for a, b in zip(got, want):
                assert np.array_equal(a, b), (mode, workers)
        fused._workshare = original
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    print("ok")
""")


def test_more_workers_than_threads_neither_hangs_nor_changes_results():
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run([sys.executable, "-c", _OVERSUBSCRIBED], env=env, timeout=300,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail("the fused loops did not finish in 300 s with more workers than threads")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
