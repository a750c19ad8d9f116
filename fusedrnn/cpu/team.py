"""Threads of our own for the fused loops' regions in a numpy program (workqueue's layer).

Numba's workqueue wakes its sleeping workers at every launch while the caller waits: under
a hypervisor that cost more than a small step's work, so such steps ran on one core. A
team runs a region as the kernel's serial build on each of its threads: the caller runs
share 0 at once and posts the others to helpers, which spin a while after each region
(SPIN_SECONDS) before they sleep. A helper joins once the caller is inside its kernel (the
GIL free); one that comes late finds the blocks taken (workshare.py).
Measured: bench/results/cpu-kernel-notes.md#threads-a-team-of-our-own
"""
from __future__ import annotations

import os
import queue
import threading
import time

import numba as nb
import numpy as np

from .lowlevel import IDLE, LINE, POSTED, new_counters, team_wait
from .threads import SLEEPING_WORKERS

__all__ = ["TEAM", "Team"]

# A helper's spin for the next region, then it sleeps; back-to-back calls find it awake.
# Measured: bench/results/cpu-kernel-notes.md#threads-a-team-of-our-own
SPIN_SECONDS = 100e-6


class Team:
    """One region at a time (a second thread's launch runs alone); helpers start on first
    use, again after a fork."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pid, self._job, self.errors = None, None, []
        self.joins = 0   # regions a helper joined (tests)
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self):
        self._lock, self._pid = threading.Lock(), None

    def _ready(self):
        if self._pid == os.getpid():
            return self._box
        helpers = max(0, nb.config.NUMBA_NUM_THREADS - 1)
        raw = np.zeros((helpers + 2) * LINE, np.int64)   # a line each: [state, asleep]
        skip = (-raw.ctypes.data % (LINE * 8)) // 8
        box = raw[skip:skip + (helpers + 1) * LINE].reshape(helpers + 1, LINE)
        probe = np.zeros((2, LINE), np.int64)   # never posted: times the spin
        team_wait(probe, 1, 1000)   # (its first call loads it)
        start = time.perf_counter()
        team_wait(probe, 1, 4000)
        spins = max(1000, int(SPIN_SECONDS * 4000 / max(time.perf_counter() - start, 1e-9)))
        self._box, self._wakes, self._pid = box, [], os.getpid()
        for k in range(1, helpers + 1):
            self._wakes.append(queue.SimpleQueue())
            threading.Thread(target=self._serve, args=(box, k, self._wakes[-1], spins),
                             daemon=True, name=f"fusedrnn-team-{k}").start()
        return box

    def launch(self, kernel, args, steps, workers):
        """kernel(*args, (counters, workers, me)): me = 0 here, 1.. on helpers."""
        if workers < 2 or not self._lock.acquire(blocking=False):
            kernel(*args, (new_counters(steps, workers), workers, 0))
            return
        try:
            box = self._ready()
            helpers = min(workers, box.shape[0]) - 1
            counters = new_counters(steps, workers, box, helpers)
            box[0, 0] = 0   # (the kernel sets it: arrived)
            self._job = (kernel, args, counters, workers)
            for k in range(1, helpers + 1):
                box[k, 0] = POSTED
                if box[k, 1]:   # asleep: one token, however many launches see it so
                    box[k, 1] = 0
                    self._wakes[k - 1].put(None)
            kernel(*args, (counters, workers, 0))
        finally:
            # (normally team_leave left all idle; a dispatch that failed never arrived)
            if self._pid == os.getpid():
                for k in range(1, self._box.shape[0]):
                    if self._box[k, 0] == POSTED:
                        self._box[k, 0] = IDLE
            self._job = None
            self._lock.release()

    def _serve(self, box, k, wake, spins):
        while True:
            if not team_wait(box, k, spins):
                box[k, 1] = 1   # asleep (under the GIL: a post sees it or was seen here)
                if box[k, 0] != POSTED:
                    wake.get()   # (the post that puts the token clears the flag)
                else:
                    box[k, 1] = 0
                continue
            job = self._job
            if job is None:
                continue
            kernel, args, counters, workers = job
            self.joins += 1
            try:
                kernel(*args, (counters, workers, k))
            except BaseException as error:   # (raised by the dispatch, before any claim)
                self.errors.append(error.with_traceback(None))
            finally:   # (the region's arrays are not held until the next one)
                del job, kernel, args, counters


# Where a launch wakes sleeping workers; FUSEDRNN_TEAM=0 launches on Numba's layer.
TEAM = Team() if SLEEPING_WORKERS and os.environ.get("FUSEDRNN_TEAM", "1") != "0" else None
