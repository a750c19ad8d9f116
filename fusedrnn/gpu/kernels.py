"""The per-step cell kernels' host side: argument packing, grid size, launch.

cells.cuh holds the CUDA source (one template per cell, instantiated per dtype; build.py
names and compiles the instantiations). This module needs no CuPy: packing and launching
take a `launcher`, which for the real backend is a CuPy RawKernel, and in tests/gpu a
host build of the same source.
"""
from __future__ import annotations

import numpy as np

from ..config import CELLS
from .build import KernelFamily

__all__ = ["STEP_KERNELS", "grid_size", "step_forward_args", "step_backward_args",
           "CellKernels", "cupy_cell_kernels"]

STEP_KERNELS = KernelFamily("cells.cuh", "forward_step", "backward_step")
THREADS = 256          # per block; the pointwise step is memory-bound, any multiple of 32 does
MAX_BLOCKS = 2 ** 31 - 1


def grid_size(elements, threads=THREADS):
    """Blocks for one thread per element (the kernels also grid-stride past the cap)."""
    return max(1, min(-(-elements // threads), MAX_BLOCKS))


def _matrix(a):
    """(array, leading dimension in elements) for a row-major 2-D view."""
    if a.size == 0:
        return a, np.int64(0)
    if a.ndim != 2 or (a.shape[1] > 1 and a.strides[1] != a.itemsize):
        raise ValueError(f"kernel argument: expected a 2-D view with contiguous rows, "
                         f"got shape {a.shape} strides {a.strides}")
    return a, np.int64(a.strides[0] // a.itemsize)


def _step(lengths, t, clip_lo, clip_hi, clip_flags, N, H):
    return (lengths, np.int64(lengths.size), np.int64(t), np.float64(clip_lo),
            np.float64(clip_hi), np.int64(clip_flags), np.int64(N), np.int64(H))


def step_forward_args(gx, gh, bx, bh, h_prev, c_prev, h_next, c_next, y, saved, lengths,
                      t, clip_lo, clip_hi, clip_flags):
    """The forward_step argument list (see cells.cuh), and N*H."""
    N, H = h_next.shape
    args = (*_matrix(gx), *_matrix(gh), bx, bh, *_matrix(h_prev), *_matrix(c_prev),
            *_matrix(h_next), *_matrix(c_next), *_matrix(y), *_matrix(saved),
            *_step(lengths, t, clip_lo, clip_hi, clip_flags, N, H))
    return args, N * H


def step_backward_args(gates, dy, dh_rec, dh_carry_in, dc_carry_in, saved, h_prev, c_prev,
                       c_t, dgx, dgh, dh_carry_out, dc_carry_out, lengths, t, clip_lo,
                       clip_hi, clip_flags):
    """The backward_step argument list (see cells.cuh), and N*H."""
    N, H = dgx.shape[0], dgx.shape[1] // gates
    args = (*_matrix(dy), *_matrix(dh_rec), *_matrix(dh_carry_in), *_matrix(dc_carry_in),
            *_matrix(saved), *_matrix(h_prev), *_matrix(c_prev), *_matrix(c_t), *_matrix(dgx),
            *_matrix(dgh), *_matrix(dh_carry_out), *_matrix(dc_carry_out),
            *_step(lengths, t, clip_lo, clip_hi, clip_flags, N, H))
    return args, N * H


class CellKernels:
    """forward_step / backward_step with the CPU kernels' Python signature, launching
    `launch_forward(grid, block, args)` / `launch_backward(...)`."""

    def __init__(self, mode, launch_forward, launch_backward):
        self._gates = CELLS[mode].gates
        self._launch_forward, self._launch_backward = launch_forward, launch_backward

    def forward_step(self, *arrays):
        args, n = step_forward_args(*arrays)
        self._launch_forward((grid_size(n),), (THREADS,), args)

    def backward_step(self, *arrays):
        args, n = step_backward_args(self._gates, *arrays)
        self._launch_backward((grid_size(n),), (THREADS,), args)


def cupy_cell_kernels(cupy, mode, dtype):
    """(forward_step, backward_step) launching on CuPy's current stream."""
    kernels = CellKernels(mode, *STEP_KERNELS.cupy_functions(cupy, mode, dtype))
    return kernels.forward_step, kernels.backward_step
