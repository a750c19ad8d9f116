"""fusedrnn.cpu.lowlevel.workshare: how the fused loops' workers share each step's blocks.

(a) claim, driven serially and round-robin from compiled drivers: every block of every
    step is taken exactly once; each worker takes blocks of its own share first and in
    order (a worker done with its own share takes the others' remaining blocks); an
    exhausted step answers -1 to everyone (workers > blocks included).
(b) The fused loops with more workers than threads (1 Numba thread with 2 and 5
    workers: they run one after another; 2 threads with 5 workers: some in parallel,
    some after), forward and backward through the op, both dtypes, in a subprocess
    with a time limit so that a barrier that waits forever fails the test instead of
    hanging it: results bitwise equal to the normal run's (a block's arithmetic does
    not depend on who runs it).
    Every thread of that process has its affinity back afterwards: run one after
    another on one thread, later workers find an earlier one's CPU and leave it (spread).
(c) new_counters: zeroed, every row on a 64-byte line, the done count alone on the
    row's last line; after the steps' rows, the CPU slots' row and two rows per worker
    that each hold a cpu_set_t.
(d) spread and settle, driven on this thread: a second worker on the first one's CPU
    leaves it, with this thread's affinity narrowed by that CPU alone, and settle gives
    the affinity back; a lone worker, a thread allowed one CPU and a worker whose CPU no
    one holds stay. Off Linux spread never moves.
"""
import os
import platform
import subprocess
import sys
import textwrap

import numba as nb
import numpy as np
import pytest

from fusedrnn.cpu.lowlevel.workshare import (
    LINE,
    MASK_WORDS,
    _current_cpu,
    claim,
    new_counters,
    settle,
    spread,
)


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
    order = _serial(new_counters(3, workers), 3, workers, blocks)
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
    order = _round_robin(new_counters(1, workers), workers, blocks)
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
    import os
    import numba, numpy as np
    import fusedrnn
    from fusedrnn.cpu import fused
    from fusedrnn.layout import param_size

    def run(mode, dtype):
        rng = np.random.default_rng(7)
        T, N, I, H = 5, 3, 4, 37      # 3 blocks, the last partial
        n = param_size(mode=mode, input_size=I, state_size=H, num_layers=2,
                       bidirectional=True)
        p = (rng.standard_normal(n) * 0.3).astype(dtype)
        x = rng.standard_normal((T, N, I)).astype(dtype)
        dout = rng.standard_normal((T, N, 2 * H)).astype(dtype)
        kw = dict(state_size=H, num_layers=2, mode=mode, bidirectional=True)
        out, handle = fusedrnn.RNN(x, p, **kw, train=True)
        grads = fusedrnn.rnn_backward(handle, dout)
        one = fusedrnn.RNN(x[:1], p, **kw)    # T=1: the single-step form
        return [out, *grads[:2], one]

    def affinities():   # every thread of this process (Linux; elsewhere spread never moves)
        if not os.path.isdir("/proc/self/task"):
            return {}
        return {t: os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}

    original, threads = fused._workshare, numba.get_num_threads()
    # (T=1 and the small loops too on the parallel builds)
    fused.SERIAL_WORK = fused.SERIAL_POINTWISE = fused.SERIAL_LOOP_WORK = -1
    for mode, dtype in (("lstm", np.float64), ("gru", np.float32)):
        fusedrnn.clear_cache()
        want = run(mode, dtype)
        for numba_threads, workers in ((1, 2), (1, 5), (threads, 5)):
            numba.set_num_threads(numba_threads)
            fused._workshare = lambda steps, blocks, serial=False: (
                fused.new_counters(steps, workers), workers)
            fusedrnn.clear_cache()
            before = affinities()
            got = run(mode, dtype)
            assert affinities() == before, (mode, numba_threads, workers)
            for a, b in zip(got, want):
                assert np.array_equal(a, b), (mode, numba_threads, workers)
        fused._workshare = original
        numba.set_num_threads(threads)
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


@pytest.mark.parametrize("steps, workers", [(1, 1), (300, 2), (4, 8), (3, 9)])
def test_new_counters_layout(steps, workers):
    counters = new_counters(steps, workers)
    assert counters.dtype == np.int64 and counters.shape[0] == steps + 1 + 2 * workers
    assert not counters.any()
    stride = counters.shape[1]
    assert stride % LINE == 0 and stride - LINE >= workers   # claims, then the done line
    assert stride >= workers + 2 and stride >= MASK_WORDS   # the slots and lock; a mask
    assert counters.ctypes.data % 64 == 0 and counters.strides == (stride * 8, 8)


@nb.njit
def _spread_in_turn(counters, workers):
    """spread for workers 0..workers-1, one after another on this thread: (moved, CPU
    after) of each."""
    out = np.zeros((workers, 2), np.int64)
    for w in range(workers):
        out[w, 0] = spread(counters, w, workers)
        out[w, 1] = _current_cpu()
    return out


@nb.njit
def _settle(counters, worker, workers, moved):
    settle(counters, worker, workers, moved)


@nb.njit
def _cpu():
    return _current_cpu()


_LINUX = platform.system() == "Linux"


@pytest.fixture
def own_affinity():
    """This thread's affinity, given back after the test whatever it did."""
    allowed = os.sched_getaffinity(0) if _LINUX else None
    yield allowed
    if _LINUX:
        os.sched_setaffinity(0, allowed)


def test_a_second_worker_on_the_first_ones_cpu_leaves_it_for_the_region(own_affinity):
    steps, workers = 3, 2
    counters = new_counters(steps, workers)
    out = _spread_in_turn(counters, workers)
    first = out[0, 1]
    assert out[0, 0] == 0   # the first worker finds no one before it
    slots = counters[steps]
    assert slots[workers] == slots[workers + 1] == workers   # tickets taken, all served
    if not _LINUX:
        assert out[1, 0] == 0 and first == -1
        return
    assert first in own_affinity and slots[0] == first + 1
    if len(own_affinity) == 1:   # nowhere to go
        assert out[1, 0] == 0 and os.sched_getaffinity(0) == own_affinity
        return
    assert out[1, 0] == 1
    assert os.sched_getaffinity(0) == own_affinity - {first}
    assert out[1, 1] != first and slots[1] == out[1, 1] + 1
    kept = counters[steps + 1 + 2 * 1]   # worker 1's mask as it was
    assert {c for c in range(MASK_WORDS * 64) if kept[c // 64] >> (c % 64) & 1} == own_affinity
    _settle(counters, 1, workers, True)
    assert os.sched_getaffinity(0) == own_affinity


@nb.njit
def _spread_one(counters, worker, workers):
    return spread(counters, worker, workers)


def test_workers_that_stay(own_affinity):
    # a lone worker never looks
    counters = new_counters(2, 1)
    assert _spread_in_turn(counters, 1)[0, 0] == 0 and not counters[2].any()
    # a worker whose CPU the earlier one does not hold
    counters = new_counters(2, 2)
    counters[2, 0] = (_cpu() + 1) + 1   # worker 0 on the next CPU (slots hold CPU + 1)
    counters[2, 2] = counters[2, 3] = 1   # ... and through the lock: ticket 1 is served
    assert _spread_one(counters, 1, 2) == 0
    if not _LINUX:
        return
    assert os.sched_getaffinity(0) == own_affinity
    # a thread allowed one CPU has nowhere to go
    os.sched_setaffinity(0, {min(own_affinity)})
    counters = new_counters(2, 2)
    out = _spread_in_turn(counters, 2)
    assert out[1, 0] == 0 and out[0, 1] == out[1, 1] == min(own_affinity)
    assert os.sched_getaffinity(0) == {min(own_affinity)}
