"""Which Numba threading layer the cell kernels run on, and how launches are guarded.

Between our per-step Numba kernels run OpenBLAS GEMMs with OpenBLAS's own threads.
Numba's OpenMP layer leaves its threads spinning after each kernel, and on 2 cores
they fight OpenBLAS's threads for the cores: an LSTM call took almost four times as
long as on the workqueue layer (OMP_WAIT_POLICY=PASSIVE helps only if fusedrnn loads
libgomp before torch does, which a library cannot ensure).
Measured: bench/results/cpu-kernel-notes.md#threads-the-threading-layer

So, unless the user chose a layer (NUMBA_THREADING_LAYER or numba.config), we select
workqueue, except in a torch program (torch loaded before this module: fusedrnn.torch
imports it first). There numpy's BLAS runs on one thread during our calls
(BlasOneThread) and the ops between ours are torch's, whose OpenMP threads spin after
each op; our kernels started on workqueue's sleeping workers beside them lost a core's
share: the design-size bf16 modules ran 13-20% slower than the op alone (LSTM inference
90-104 ms against 85). On Numba's OpenMP layer the same benchmark ran faster in every
case (LSTM inference 0.73 -> 0.88 of torch, training 1.57 -> 1.78; GRU 1.18 -> 1.35,
1.15 -> 1.27; rnn_tanh 1.07 -> 1.30, 1.01 -> 1.25) and the float32 train steps too
(encoder 68-72 -> 53-54 ms, acoustic 365-373 -> 326-328), the neighbour's time about
the same. So in a torch program the layer is OpenMP (its own libgomp, loaded here, with
a short spin: GOMP_SPINCOUNT below), where Numba has it.
Measured: bench/results/cpu-kernel-notes.md#threads-openmp-in-a-torch-program

Workqueue's workers sleep between launches, but it aborts the process if two
Python threads launch parallel kernels at once (tests/cpu/test_threads.py shows the
abort without the lock), so while it is the layer, every fusedrnn kernel launch holds
LAUNCH_LOCK; the GEMMs between launches do not. With a thread-safe layer (omp, tbb)
no lock is taken.

GNU OpenMP is not fork-safe, and Numba's OpenMP layer kills (SIGTERM) a forked child
whose parent started the pool as soon as the child opens a parallel region: a torch
program that forks workers after running fusedrnn would lose them, and a
multiprocessing Pool waiting on them hangs. So a process forked from one that runs the
OpenMP layer launches every kernel's serial build instead (`pick`): the same results,
on one core. (The handler is registered when this module loads: a fork before that,
from a program whose own Numba code started the OpenMP pool, is not seen.)
Measured: bench/results/cpu-kernel-notes.md#threads-forked-processes

Numba fixes its layer when its thread pool starts (the first parallel kernel, or a
call such as numba.get_num_threads()). If that happened before this module was
imported, the running layer stays; we use it and warn when it is one that spins (OpenMP
outside a torch program).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import types
import warnings

import numba
import threadpoolctl

from ..config import TORCH_CALLER

_THREADSAFE = {"omp", "tbb", "threadsafe", "safe"}


def _running_layer():
    try:
        return numba.threading_layer()  # raises until the thread pool has started
    except ValueError:
        return None


# Spin iterations of the OpenMP layer's threads before they sleep (libgomp's default is
# 300000, milliseconds on these cores, in which they would hold a core torch's next op
# wants). Set only for the libgomp this module loads, and only if the user set none.
OPENMP_SPIN = "10000"


def _openmp_layer_loads():
    """Load Numba's OpenMP layer (and with it a libgomp, reading GOMP_SPINCOUNT now);
    False where this Numba has none."""
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
# Whether a parallel launch wakes sleeping workers (workqueue's, 110-120 us for an empty
# region on the 2-core machine, against 3 us on the OpenMP layer, whose workers spin):
# the kernels' serial bounds (fused.py, lowlevel) are set for each kind of layer. A
# user's "default", "safe" or "forksafe" may mean workqueue: counted as sleeping.
SLEEPING_WORKERS = LAYER not in ("omp", "tbb")

_forked_from_openmp = False   # (module docstring: serial builds only)


def _after_fork_in_child():
    global _forked_from_openmp
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
    """A copy of a kernel's Python function under its own name (qualname + "_serial"), for
    its serial build: Numba's disk cache tells builds apart by function, not by compile
    flags."""
    twin = types.FunctionType(kernel.__code__, kernel.__globals__, kernel.__name__,
                              kernel.__defaults__, kernel.__closure__)
    twin.__qualname__ = kernel.__qualname__ + "_serial"
    return twin


# How every kernel entry point is compiled, parallel or serial. The error model is
# numpy's (a float division by zero gives inf or nan, as IEEE says, instead of raising):
# under Python's model each division is checked for zero, and those branches kept the
# serial builds' cell loops scalar (LSTM T=20 N=8 H=64, serial build 502 -> 108 us a
# call). A parallel region's body is always compiled with numpy's model (Numba's parfor
# lowering), so the two builds now also agree on the one rule they could differ by.
# Measured: bench/results/cpu-kernel-notes.md#threads-numpys-error-model-in-every-build
KERNEL_OPTIONS = dict(cache=True, nogil=True, error_model="numpy")


def parallel_and_serial(kernel):
    """(parallel build, serial build) of a kernel's Python function, both cached on disk
    and compiled on first use. Small calls take the serial one: launching a parallel
    region costs 3 us to over 100 (SLEEPING_WORKERS; lowlevel/packing.py and gemm.py give
    the measurement); `pick` chooses."""
    return (numba.njit(parallel=True, **KERNEL_OPTIONS)(kernel),
            numba.njit(**KERNEL_OPTIONS)(serial_twin(kernel)))


class BlasOneThread:
    """A reusable context: while a call from a torch program (config.TORCH_CALLER) runs
    inside it on the main thread, numpy's BLAS (OpenBLAS, through threadpoolctl) runs on
    one thread; leaving restores the count it found. Why: after a threaded GEMM
    OpenBLAS's workers spin for about 0.1 s and take a core from torch's own ops (a
    Linear + loss beside a fusedrnn training step took 2.2x as long, the step itself
    1.5x). There the op's large GEMMs run on torch's pool instead (CpuBackend.matmul),
    so what stays on numpy's BLAS is small. In a numpy program the second thread makes
    the training GEMMs faster, so there the count is left alone, except by an op whose
    large GEMMs run on its own kernels (BLAS_ONE_THREAD_ALWAYS, below).
    Measured: bench/results/cpu-kernel-notes.md#threads-blas-on-one-thread
    Calls from other threads leave it alone too: OpenBLAS's count is process-wide, and
    here a change made from a second thread was not always honoured, so a restore from
    one could leave the whole process on one thread."""

    def __init__(self, always=False):
        self._always = always   # cap in a numpy program's calls too
        self._entered = []   # the main thread's nested entries: whether each capped
        self._libs, self._saved = None, []

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        cap = (self._always or TORCH_CALLER.get() is not None) and not any(self._entered)
        if cap:
            if self._libs is None:   # scanning the loaded libraries takes ~3 ms: once
                self._libs = threadpoolctl.ThreadpoolController().select(
                    user_api="blas").lib_controllers
            self._saved = [lib.num_threads for lib in self._libs]
            for lib, threads in zip(self._libs, self._saved, strict=True):
                if threads != 1:
                    lib.set_num_threads(1)
        self._entered.append(cap)
        return self

    def __exit__(self, *exc):
        if threading.current_thread() is not threading.main_thread():
            return False
        if self._entered.pop():
            for lib, threads in zip(self._libs, self._saved, strict=True):
                if threads != 1:
                    lib.set_num_threads(threads)
        return False


BLAS_ONE_THREAD = BlasOneThread()
# For an op whose large GEMMs run on its own kernels (bfloat16 pairs), numpy's BLAS is
# left only small products, after which OpenBLAS's spinning workers slowed the GEMMs that
# follow by half: cap it in every program. Design size, bfloat16 training step in a numpy
# program: LSTM 377-392 -> 322-324 ms, rnn_tanh 148-154 -> 103-118.
# Measured: bench/results/cpu-kernel-notes.md#bf16-openblas-spinning-in-a-numpy-program
BLAS_ONE_THREAD_ALWAYS = BlasOneThread(always=True)
