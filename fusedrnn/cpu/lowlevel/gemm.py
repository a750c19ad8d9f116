"""The input projection W_x x_t of every step, as one GEMM on Numba's threads.

Why not numpy's matmul (as fast alone): OpenBLAS's threads spin after each call, against
the fused loop that follows. Used in float32, and float64 with 512-bit tiles (own_gemm).
Measured: bench/results/cpu-kernel-notes.md#gemm-the-input-projection

project(a, wpack, c, spill)
    a      (M, K)   in   rows of x (contiguous rows, unit column stride)
    wpack  (P, K, 16) in packing.pack_input_weights's layout
    c      (M, C)   out  a @ W^T, C = the concatenated row count; every element written
    spill  (ceil(M/CHUNK), CHUNK, 16) scratch for a partial last panel (C % 16 != 0)
    One dtype throughout (float32 or float64); c overlaps nothing.
"""
from __future__ import annotations

from numba import prange

from ..threads import LAUNCH_LOCK, SLEEPING_WORKERS, parallel_and_serial, pick
from .mathfn import zero_like
from .microkernel import PANEL, panel_gemm

__all__ = ["CHUNK", "project"]

# Rows per work item: a multiple of the tile heights (6 and 3), and a chunk of A (96 x 800
# floats) small enough to stay in L2 while every panel of W passes over it.
CHUNK = 96
# Up to this many multiply-adds (M*K*C) the projection runs as its serial build: a
# parallel region's launch costs more than the product on one core, and more in a numpy
# program (threads.SLEEPING_WORKERS) than on a torch program's OpenMP layer.
# Measured: bench/results/cpu-kernel-notes.md#packing-and-projection-serial-builds
SERIAL_WORK = 1 << 25 if SLEEPING_WORKERS else 1 << 23
# Panels per product where four are left: tiles of several panels (panels_per_tile)
QUAD = 4


def _project(a, wpack, c, spill):
    M, K = a.shape
    C = c.shape[1]
    itemsize = a.itemsize
    full = C // PANEL
    panels = -(-C // PANEL)
    chunks = (M + CHUNK - 1) // CHUNK
    # Few row chunks would leave a core idle: split the panels into at least 8 work items.
    groups = min(panels, max(1, -(-8 // chunks)))
    for item in prange(chunks * groups):
        chunk, group = item // groups, item % groups
        r0 = chunk * CHUNK
        rows = min(CHUNK, M - r0)
        a_rows = a.ctypes.data + r0 * K * itemsize
        c_rows = c.ctypes.data + r0 * C * itemsize
        first, stop = group * panels // groups, (group + 1) * panels // groups
        whole = min(stop, full)
        p = first
        while p + QUAD <= whole:    # four panels per product (microkernel.panels_per_tile)
            panel_gemm(a_rows, K, rows, wpack[p].ctypes.data, K * PANEL, QUAD,
                       c_rows + p * PANEL * itemsize, C, K, zero_like(a))
            p += QUAD
        for p in range(p, stop):  # noqa: B020  (p goes on from the loop above)
            if p < full:
                panel_gemm(a_rows, K, rows, wpack[p].ctypes.data, 0, 1,
                           c_rows + p * PANEL * itemsize, C, K, zero_like(a))
            else:      # the partial last panel goes through spill
                panel_gemm(a_rows, K, rows, wpack[p].ctypes.data, 0, 1,
                           spill[chunk].ctypes.data, PANEL, K, zero_like(a))
                for i in range(rows):
                    for u in range(C - full * PANEL):
                        c[r0 + i, full * PANEL + u] = spill[chunk, i, u]


_project, _project_serial = parallel_and_serial(_project)


def project(a, wpack, c, spill):
    """c = a @ W^T with W packed by packing.pack_input_weights (module docstring)."""
    with LAUNCH_LOCK:
        small = a.shape[0] * a.shape[1] * c.shape[1] <= SERIAL_WORK
        pick(_project, _project_serial, small)(a, wpack, c, spill)
    return c
