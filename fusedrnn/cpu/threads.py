"""Which Numba threading layer the cell kernels run on, and how launches are guarded.

Unless the user chose a layer, workqueue: Numba's OpenMP threads spin after each kernel
and fight OpenBLAS's for the cores. In a torch program (torch imported first), OpenMP with
a short spin (OPENMP_SPIN) where Numba has it: numpy's BLAS is capped there
(BlasOneThread), and torch's spinning threads took a core from workqueue's sleepers.
Measured: bench/results/cpu-kernel-notes.md#threads-the-threading-layer
Measured: bench/results/cpu-kernel-notes.md#threads-openmp-in-a-torch-program

Workqueue aborts the process if two Python threads launch parallel kernels at once
(tests/cpu/test_threads.py), so on it every kernel launch holds LAUNCH_LOCK (the GEMMs
between launches do not); a thread-safe layer (omp, tbb) takes no lock.

GNU OpenMP is not fork-safe (a forked child that opens a parallel region is killed), so
a process forked from one on the OpenMP layer launches serial builds only (`pick`): the
same results, on one core. (A fork before this module loads is not seen.)
Measured: bench/results/cpu-kernel-notes.md#threads-forked-processes

Numba fixes its layer when its thread pool starts. If that happened before this import,
the running layer stays; we warn when it is one that spins (OpenMP outside torch).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import queue
import sys
import threading
import types
import warnings

import numba
import numpy as np
import threadpoolctl

from ..config import TORCH_CALLER

_THREADSAFE = {"omp", "tbb", "threadsafe", "safe"}


def _running_layer():
    try:
        return numba.threading_layer()  # raises until the thread pool has started
    except ValueError:
        return None


# Spin iterations of the OpenMP layer's threads before they sleep (libgomp's 300000 would
# hold a core torch's next op wants); only for the libgomp we load, if the user set none.
OPENMP_SPIN = "10000"


def _openmp_layer_loads():
    """Load Numba's OpenMP layer (its libgomp reads GOMP_SPINCOUNT now); False if none."""
    saved = os.environ.get("GOMP_SPINCOUNT")
    os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN)
    try:
        import numba.np.ufunc.omppool  # noqa: F401
    except ImportError:
        return False
    finally:
        if saved is None:
            del os.environ["GOMP_SPINCOUNT"]
    return True


_user_choice = "NUMBA_THREADING_LAYER" in os.environ or numba.config.THREADING_LAYER != "default"
LAYER = _running_layer()
if LAYER is None:
    if not _user_choice:
        numba.config.THREADING_LAYER = (
            "omp" if "torch" in sys.modules and _openmp_layer_loads() else "workqueue")
    LAYER = numba.config.THREADING_LAYER
elif LAYER == "omp" and not _user_choice and "torch" not in sys.modules:
    warnings.warn("fusedrnn: Numba's thread pool was started (OpenMP layer) before fusedrnn "
                  "could choose its layer; OpenMP threads spin against BLAS between steps and "
                  "calls run several times slower. Import fusedrnn.cpu before starting Numba's "
                  "threads, or set NUMBA_THREADING_LAYER=workqueue.", RuntimeWarning,
                  stacklevel=2)
LAUNCH_LOCK = contextlib.nullcontext() if LAYER in _THREADSAFE else threading.Lock()
# Whether a launch wakes sleeping workers (a user's "default", "safe" or "forksafe" may
# mean workqueue) rather than spinning ones: the serial bounds differ by layer.
SLEEPING_WORKERS = LAYER not in ("omp", "tbb")

_forked_from_openmp = False


def _after_fork_in_child():
    global _forked_from_openmp
    _parts.count = 1   # (a fork inside another thread's capped call: no scope ends here)
    if _running_layer() == "omp":   # (the pool ran here, or in a process this one forked from)
        _forked_from_openmp = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def pick(parallel, serial, small=False):
    """The build of a kernel to launch: `serial` for small work (its caller's rule), and
    always in a process forked from one running the OpenMP layer (module docstring)."""
    return serial if small or _forked_from_openmp else parallel


def serial_only():
    """Whether this process may launch serial builds only (module docstring)."""
    return _forked_from_openmp


def serial_twin(kernel):
    """A copy of a kernel's function named qualname + "_serial", for its serial build:
    Numba's disk cache tells builds apart by function, not by compile flags."""
    twin = types.FunctionType(kernel.__code__, kernel.__globals__, kernel.__name__,
                              kernel.__defaults__, kernel.__closure__)
    twin.__qualname__ = kernel.__qualname__ + "_serial"
    return twin


# How every kernel entry point is compiled. numpy's error model (a division by zero gives
# inf or nan): Python's checks each division, and those branches kept the serial builds'
# cell loops scalar; a parallel region's body always takes numpy's, so both builds agree.
# Measured: bench/results/cpu-kernel-notes.md#threads-numpys-error-model-in-every-build
KERNEL_OPTIONS = dict(cache=True, nogil=True, error_model="numpy")


def parallel_and_serial(kernel):
    """(parallel build, serial build) of a kernel's function, cached on disk, compiled on
    first use; `pick` gives small calls the serial one (a launch costs more than them)."""
    return (numba.njit(parallel=True, **KERNEL_OPTIONS)(kernel),
            numba.njit(**KERNEL_OPTIONS)(serial_twin(kernel)))


class BlasOneThread:
    """A reusable context: a torch program's call (config.TORCH_CALLER) on the main thread
    runs numpy's BLAS on one thread inside it: OpenBLAS's spinning workers took a core from
    torch's ops. A numpy program's GEMMs gain from the second thread (left alone, but by
    BLAS_ONE_THREAD_ALWAYS and BLAS_IN_PARTS: blas_parts()), and other threads leave it
    alone (the count is process-wide, and a second thread's change was not always honoured).
    Measured: bench/results/cpu-kernel-notes.md#threads-blas-on-one-thread"""

    def __init__(self, always=False, spare_one=False, parts=False):
        self._always = always   # cap in a numpy program's calls too
        self._spare_one = spare_one   # cap at one thread fewer than BLAS has, not at one
        self._parts = parts   # the capped GEMMs may run in parts on helper threads
        self._entered = []   # the main thread's entries: (capped, blas_parts() before)
        self._libs, self._saved = None, []

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        cap = (self._always or TORCH_CALLER.get() is not None) and not any(
            capped for capped, _ in self._entered)
        if cap:
            if self._libs is None:   # scanning the loaded libraries is slow: once
                self._libs = threadpoolctl.ThreadpoolController().select(
                    user_api="blas").lib_controllers
            self._saved = [lib.num_threads for lib in self._libs]
            for lib, threads in zip(self._libs, self._saved, strict=True):
                if threads != 1:
                    lib.set_num_threads(max(1, threads - 1) if self._spare_one else 1)
        self._entered.append((cap, _parts.count))
        if cap and self._parts and TORCH_CALLER.get() is None:   # (torch's GEMMs: its pool)
            _parts.count = max(self._saved, default=1)
        return self

    def __exit__(self, *exc):
        if threading.current_thread() is not threading.main_thread():
            return False
        capped, _parts.count = self._entered.pop()
        if capped:
            for lib, threads in zip(self._libs, self._saved, strict=True):
                if threads != 1:
                    lib.set_num_threads(threads)
        return False


class _Parts:
    count = 1   # blas_parts()


_parts = _Parts()


def blas_parts():
    """gemm_in_parts' count here: BLAS's own threads inside BLAS_IN_PARTS (main thread)."""
    if _parts.count == 1 or threading.current_thread() is not threading.main_thread():
        return 1
    return _parts.count


class _Helpers:
    """Threads for a GEMM's other parts (again after a fork), asleep on a queue between."""

    def __init__(self):
        self._queues, self._pid = [], None

    def run(self, tasks):
        """tasks[0]() here, the rest on helpers; when all are done, raise the first error."""
        if self._pid != os.getpid():   # (threads do not survive a fork)
            self._queues, self._pid = [], os.getpid()
        while len(self._queues) < len(tasks) - 1:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), daemon=True,
                             name=f"fusedrnn-gemm-{len(self._queues) + 1}").start()
            self._queues.append(jobs)
        errors, handed = [None] * len(tasks), []
        try:
            for k, jobs in enumerate(self._queues[:len(tasks) - 1], 1):
                handed.append(threading.Event())
                jobs.put((tasks[k], handed[-1], errors, k))
            tasks[0]()
        except BaseException as error:
            errors[0] = error
        # waited for even through ^C: no part may write into `out` after the call ends
        for event in handed:
            while True:
                try:
                    if event.wait(0.1):
                        break
                except BaseException as error:
                    errors[0] = errors[0] or error
        for error in errors:
            if error is not None:
                raise error

    @staticmethod
    def _serve(jobs):
        while True:
            task, event, errors, k = jobs.get()
            try:
                task()
            except BaseException as error:
                errors[k] = error
            event.set()


_helpers = _Helpers()


def gemm_in_parts(a, b, out, parts):
    """out = a @ b (a may be a^T's view) in `parts` row blocks, numpy's matmul each, the
    first here and the rest on helper threads (matmul releases the GIL). Returns out."""
    M = out.shape[0]
    if a.ndim != 2 or a.shape[0] != M or np.may_share_memory(out, a) or \
            np.may_share_memory(out, b) or M < 2 or parts < 2:
        return np.matmul(a, b, out=out)   # (numpy's checks and copies, in one piece)
    parts = min(parts, M)
    bounds = [M * k // parts for k in range(parts + 1)]
    _helpers.run([functools.partial(np.matmul, a[lo:hi], b, out=out[lo:hi])
                  for lo, hi in itertools.pairwise(bounds)])
    return out


BLAS_ONE_THREAD = BlasOneThread()
# An op whose large GEMMs run on its own kernels (bfloat16 pairs) leaves numpy's BLAS only
# small products, whose spinning workers slowed the GEMMs after them: capped everywhere.
# Measured: bench/results/cpu-kernel-notes.md#bf16-openblas-spinning-in-a-numpy-program
BLAS_ONE_THREAD_ALWAYS = BlasOneThread(always=True)
# A fused op's calls: BLAS on one thread, so no OpenBLAS worker is woken to spin beside
# the loops after a GEMM; outside a torch program matmul runs large GEMMs in parts.
# Measured: bench/results/cpu-kernel-notes.md#threads-the-training-gemms-in-parts
BLAS_IN_PARTS = BlasOneThread(always=True, parts=True)
# The first tier's GEMMs leave one core to the background compile (firsttier.py).
BLAS_SPARE_ONE = BlasOneThread(always=True, spare_one=True)
