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
    Every thread of that process has its affinity back afterwards (spread, settle).
(c) new_counters: zeroed, every row on a 64-byte line, the done count alone on the
    row's last line; after the steps' rows, the held CPUs' set, the launching thread's
    id, and room for two cpu sets per worker.
(d) spread and settle, driven on this thread: a worker whose CPU another holds moves to
    a CPU no one holds, with this thread's affinity narrowed by the held set, and settle
    gives the CPU and the affinity back; a worker on a CPU of its own, a lone worker, a
    thread allowed only held CPUs and the launching thread stay; a launcher that runs a
    share takes its CPU before the region (hold_launcher). Off Linux neither looks. The other workers' CPUs are set in the held set by hand, so the test does not
    depend on where the scheduler puts this thread.
(e) A team's mailbox (team_wait, team_arrive, team_leave): a helper joins only a region
    posted to it whose caller has arrived, and is idle again at its next wait; leaving
    withdraws posts no helper took and waits for the helpers that joined.
"""
import os
import platform
import subprocess
import sys
import textwrap
import threading
import time

import numba as nb
import numpy as np
import pytest

from fusedrnn.cpu.lowlevel.workshare import (
    IDLE,
    JOINED,
    LINE,
    MASK_WORDS,
    POSTED,
    claim,
    hold_launcher,
    new_counters,
    settle,
    spread,
    team_arrive,
    team_leave,
    team_wait,
)
from fusedrnn.cpu.threads import SLEEPING_WORKERS


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

    original, threads = fused._workers, numba.get_num_threads()
    # (T=1 and the small loops too on the parallel builds)
    fused.SERIAL_WORK = fused.SERIAL_POINTWISE = fused.SERIAL_LOOP_WORK = -1
    for mode, dtype in (("lstm", np.float64), ("gru", np.float32)):
        fusedrnn.clear_cache()
        want = run(mode, dtype)
        for numba_threads, workers in ((1, 2), (1, 5), (threads, 5)):
            numba.set_num_threads(numba_threads)
            fused._workers = lambda blocks, serial=False: workers
            fusedrnn.clear_cache()
            before = affinities()
            got = run(mode, dtype)
            assert affinities() == before, (mode, numba_threads, workers)
            for a, b in zip(got, want):
                assert np.array_equal(a, b), (mode, numba_threads, workers)
        fused._workers = original
        numba.set_num_threads(threads)
    print("ok")
""")


@pytest.mark.parametrize("team", ["1", "0"])   # (shares on a team; on Numba's workqueue)
def test_more_workers_than_threads_neither_hangs_nor_changes_results(team):
    env = dict(os.environ, FUSEDRNN_TEAM=team,
               PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run([sys.executable, "-c", _OVERSUBSCRIBED], env=env, timeout=300,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail("the fused loops did not finish in 300 s with more workers than threads")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("steps, workers", [(1, 1), (300, 2), (4, 8), (3, 9), (2, 64)])
def test_new_counters_layout(steps, workers):
    counters = new_counters(steps, workers)
    stride = counters.shape[1]
    assert counters.dtype == np.int64
    assert counters.shape[0] == steps + 2 + -(-2 * workers * MASK_WORDS // stride)
    assert counters[steps + 1, 0] == _as_int64(threading.get_ident())
    assert counters[steps + 1, 1] == (not SLEEPING_WORKERS)   # the launcher works too
    counters[steps + 1, :2] = 0
    assert not counters.any()   # (no team's mailbox: column 2)
    box = np.zeros((3, LINE), np.int64)
    counters = new_counters(steps, workers, box, 2)   # a team's: the launcher works
    assert counters[steps + 1, 1] == 1 and tuple(counters[steps + 1, 2:4]) == (
        box.ctypes.data, 2)
    assert stride % LINE == 0 and stride - LINE >= workers   # claims, then the done line
    assert stride >= MASK_WORDS   # row T: a cpu set
    assert counters.ctypes.data % 64 == 0 and counters.strides == (stride * 8, 8)


def _as_int64(ident):
    return ident - (1 << 64) if ident >= 1 << 63 else ident


@nb.njit
def _spread(counters, worker, workers):
    return spread(counters, worker, workers)


@nb.njit
def _hold_launcher(counters, workers, me=0):
    return hold_launcher(counters, workers, me)


@nb.njit
def _settle(counters, worker, workers, held):
    settle(counters, worker, workers, held)


_LINUX = platform.system() == "Linux"


def _cpus(words):
    return {c for c in range(MASK_WORDS * 64) if int(words[c // 64]) >> (c % 64) & 1}


def _hold(counters, steps, cpus):
    for c in cpus:
        counters[steps, c // 64] |= np.int64(1) << np.int64(c % 64)


@pytest.fixture
def own_affinity():
    """This thread's affinity, given back after the test whatever it did."""
    allowed = os.sched_getaffinity(0) if _LINUX else None
    yield allowed
    if _LINUX:
        os.sched_setaffinity(0, allowed)


def _not_launcher(counters, steps):
    counters[steps + 1, 0] = 0   # as if a pool thread, not this one, ran the region


def test_a_worker_whose_cpu_is_held_moves_to_a_free_one(own_affinity):
    if not _LINUX:
        assert _spread(new_counters(1, 2), 1, 2) == (0, False)
        return
    if len(own_affinity) < 2:
        pytest.fail("needs a thread allowed two CPUs (CI has two)")
    free = max(own_affinity)
    steps, workers = 3, 2
    counters = new_counters(steps, workers)
    _not_launcher(counters, steps)
    _hold(counters, steps, own_affinity - {free})   # the others hold all CPUs but one
    os.sched_setaffinity(0, {min(own_affinity)})   # start on a held CPU: widening the
    os.sched_setaffinity(0, own_affinity)          # affinity leaves the thread where it is
    held = _spread(counters, 1, workers)
    stayed = held == (free + 1, False)   # it ran on the free CPU already
    assert stayed or held == (free + 1, True), held
    assert _cpus(counters[steps]) == own_affinity   # ... and took it
    if not stayed:
        assert os.sched_getaffinity(0) == {free}
        sets = counters[steps + 2:].reshape(-1)[2 * MASK_WORDS:4 * MASK_WORDS]
        assert _cpus(sets[:MASK_WORDS]) == own_affinity and _cpus(sets[MASK_WORDS:]) == {free}
    _settle(counters, 1, workers, held)
    assert os.sched_getaffinity(0) == own_affinity
    assert _cpus(counters[steps]) == own_affinity - {free}   # its CPU given back


def test_workers_that_stay(own_affinity):
    steps = 2
    # a lone worker never looks
    counters = new_counters(steps, 1)
    assert _spread(counters, 0, 1) == (0, False) and not counters[steps].any()
    if not _LINUX:
        return
    # a worker on a CPU no one holds takes it
    counters = new_counters(steps, 2)
    _not_launcher(counters, steps)
    cpu, moved = _spread(counters, 1, 2)
    assert not moved and cpu - 1 in own_affinity and _cpus(counters[steps]) == {cpu - 1}
    _settle(counters, 1, 2, (cpu, moved))
    assert not counters[steps].any()
    # the launching thread stays wherever it is, though a CPU is free
    counters = new_counters(steps, 2)
    _hold(counters, steps, own_affinity - {max(own_affinity)})
    assert _spread(counters, 1, 2) == (0, False)
    assert os.sched_getaffinity(0) == own_affinity
    # a thread allowed only held CPUs has nowhere to go
    counters = new_counters(steps, 2)
    _not_launcher(counters, steps)
    _hold(counters, steps, own_affinity)
    assert _spread(counters, 1, 2) == (0, False)
    assert os.sched_getaffinity(0) == own_affinity


def test_a_launcher_that_works_takes_its_cpu_first():
    steps = 2
    counters = new_counters(steps, 2)
    counters[steps + 1, 1] = 0   # one that waits (workqueue's) takes nothing
    assert _hold_launcher(counters, 2) == (0, False) and not counters[steps].any()
    assert _hold_launcher(new_counters(steps, 1), 1) == (0, False)   # no region to share
    counters[steps + 1, 1] = 1
    held = _hold_launcher(counters, 2)
    if not _LINUX:
        assert held == (0, False)
        return
    cpu, moved = held
    assert not moved and _cpus(counters[steps]) == {cpu - 1}
    assert _hold_launcher(counters, 2) == (0, False)   # held already: not taken twice
    helper = counters.copy()
    helper[steps] = 0
    assert _hold_launcher(helper, 2, 1) == (0, False) and not helper[steps].any()   # a helper
    _settle(counters, 0, 2, held)
    assert not counters[steps].any()


@nb.njit
def _arrive(counters, workers):
    team_arrive(counters, workers)


@nb.njit(nogil=True)
def _leave(counters, workers):
    team_leave(counters, workers)


def test_a_helper_joins_only_a_posted_region_its_caller_is_in():
    box = np.zeros((3, LINE), np.int64)
    assert not team_wait(box, 1, 100) and box[1, 0] == IDLE   # nothing posted
    box[1, 0] = POSTED
    assert not team_wait(box, 1, 100) and box[1, 0] == POSTED   # the caller not inside
    counters = new_counters(2, 3, box, 2)
    _arrive(counters, 3)
    assert box[0, 0] != 0
    assert team_wait(box, 1, 100) and box[1, 0] == JOINED
    assert not team_wait(box, 2, 100)   # helper 2's line was never posted
    # back from the region: its next wait sets it idle first, and nothing is posted
    assert not team_wait(box, 1, 10) and box[1, 0] == IDLE


def test_leaving_withdraws_posts_and_waits_for_joined_helpers():
    _leave(new_counters(2, 3), 3)   # (compiled first; no team's mailbox: nothing to do)
    box = np.zeros((3, LINE), np.int64)
    counters = new_counters(2, 3, box, 2)
    box[1:, 0] = POSTED
    _arrive(counters, 3)
    assert team_wait(box, 2, 100)   # helper 2 joins, helper 1 never does
    left = threading.Event()
    leaver = threading.Thread(target=lambda: (_leave(counters, 3), left.set()))
    leaver.start()
    deadline = time.monotonic() + 10
    while box[1, 0] != IDLE and time.monotonic() < deadline:   # the other's post withdrawn
        time.sleep(0.001)
    assert box[1, 0] == IDLE
    assert not left.wait(0.2)   # ... and it waits for the helper that joined
    team_wait(box, 2, 1)   # helper 2 back: idle
    assert left.wait(10)
    leaver.join()
    assert (box[1:, 0] == IDLE).all()
