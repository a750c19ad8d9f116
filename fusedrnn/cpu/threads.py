"""Choose a Numba threading layer that tolerates concurrent calls from many threads.

Numba's fallback layer, workqueue, aborts the process when two Python threads run
parallel kernels at once. We ask for the "threadsafe" class (TBB, else OpenMP) unless
the user already chose a layer through NUMBA_THREADING_LAYER, and only when one of
those layers can actually load here (asking for an absent one fails at the first
launch). Numba reads the setting at its first parallel launch, so setting it here,
before any kernel runs, is enough.
"""
from __future__ import annotations

import importlib
import os

import numba


def _threadsafe_layer_loads() -> bool:
    for module in ("numba.np.ufunc.tbbpool", "numba.np.ufunc.omppool"):
        try:
            importlib.import_module(module)
            return True
        except ImportError:
            continue
    return False


if ("NUMBA_THREADING_LAYER" not in os.environ and numba.config.THREADING_LAYER == "default"
        and _threadsafe_layer_loads()):
    numba.config.THREADING_LAYER = "threadsafe"
