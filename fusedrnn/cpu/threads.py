"""Which Numba threading layer the cell kernels run on, and how launches are guarded.

Between our per-step Numba kernels run OpenBLAS GEMMs with OpenBLAS's own threads.
Numba's OpenMP layer leaves its threads spinning after each kernel, and on 2 cores
they fight OpenBLAS's threads for the cores. Measured (2 cores, LSTM T=300 N=20
I=H=800 float32 inference, median of 5; torch 2.13 imported first):
    OpenMP layer (shares torch's libgomp)        2.79 s
    OpenMP, OMP_WAIT_POLICY=PASSIVE at load      0.72 s, but only if fusedrnn loads
                                                 libgomp before torch does
    workqueue layer                              0.72-0.77 s, whatever the import order
(the parts alone: 0.13 s input GEMM, 0.25 s recurrent GEMMs, 0.13 s cell kernels).

So, unless the user chose a layer (NUMBA_THREADING_LAYER or numba.config), we select
workqueue. Its workers sleep between launches, but it aborts the process if two
Python threads launch parallel kernels at once (tests/cpu/test_threads.py shows the
abort without the lock), so while it is the layer, every fusedrnn kernel launch holds
LAUNCH_LOCK; the GEMMs between launches do not. With a thread-safe layer chosen by
the user (omp, tbb) no lock is taken.
"""
from __future__ import annotations

import contextlib
import os
import threading

import numba

_THREADSAFE = {"omp", "tbb", "threadsafe", "safe"}

if "NUMBA_THREADING_LAYER" not in os.environ and numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "workqueue"

LAYER = numba.config.THREADING_LAYER
LAUNCH_LOCK = contextlib.nullcontext() if LAYER in _THREADSAFE else threading.Lock()
