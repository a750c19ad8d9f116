"""CPU backend: numpy arrays, BLAS GEMMs through numpy, Numba-parallel cell kernels."""
from __future__ import annotations

import numpy as np

from . import threads  # noqa: F401  (picks a thread-safe Numba threading layer first)
from .cells import cell_kernels

__all__ = ["CpuBackend", "BACKEND"]


class CpuBackend:
    name = "cpu"
    xp = np

    @staticmethod
    def cell_kernels(mode, dtype):
        return cell_kernels(mode, dtype)

    @staticmethod
    def device_key(array):
        return ("cpu",)


BACKEND = CpuBackend()
