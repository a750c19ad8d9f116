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

import numba as nb
from numba import prange

from ..threads import (
    KERNEL_OPTIONS,
    LAUNCH_LOCK,
    SLEEPING_WORKERS,
    parallel_and_serial,
    pick,
    serial_only,
)
from .mathfn import zero_like
from .microkernel import PANEL, panel_gemm
from .workshare import claim, finish, team_arrive, team_leave

__all__ = ["CHUNK", "project"]

# Rows per work item: a multiple of the tile heights, and a chunk of A (these rows of a
# design-size input) small enough to stay in L2 while every panel of W passes over it.
CHUNK = 96
# Up to this many multiply-adds (M*K*C) the projection runs as its serial build: a
# parallel region's launch costs more than the product on one core, and more in a numpy
# program (threads.SLEEPING_WORKERS) than on a torch program's OpenMP layer; a team's
# launch (team.py) keeps workqueue's bound: OpenMP's lost there.
# Measured: bench/results/cpu-kernel-notes.md#packing-and-projection-serial-builds
# Measured: bench/results/cpu-kernel-notes.md#threads-a-team-of-our-own
SERIAL_WORK = 1 << 25 if SLEEPING_WORKERS else 1 << 23
# Panels per product where four are left: tiles of several panels (panels_per_tile)
QUAD = 4


def _split(M, C):
    """(work items, panel groups) of an (M, C) product: few row chunks would leave a core
    idle, so the panels split into at least 8 items."""
    chunks, panels = (M + CHUNK - 1) // CHUNK, -(-C // PANEL)
    groups = min(panels, max(1, -(-8 // chunks)))
    return chunks * groups, groups


_items = nb.njit(inline="always")(_split)


def _project(a, wpack, c, spill):
    items = _items(a.shape[0], c.shape[1])[0]   # (prange over a plain variable: fused.py)
    for item in prange(items):
        _project_item(a, wpack, c, spill, item)


def _project_share(a, wpack, c, spill, share):
    """_project's items claimed by one share of a team's region (workshare.py)."""
    counters, workers, me = share
    if me == 0:
        team_arrive(counters, workers)
    items, done = _items(a.shape[0], c.shape[1])[0], 0
    while True:
        item = claim(counters, 0, me, workers, items)
        if item < 0:
            break
        _project_item(a, wpack, c, spill, item)
        done += 1
    finish(counters, 0, done, items)
    if me == 0:
        team_leave(counters, workers)


@nb.njit(inline="always")
def _project_item(a, wpack, c, spill, item):
    M, K = a.shape
    C = c.shape[1]
    itemsize = a.itemsize
    full = C // PANEL
    panels = -(-C // PANEL)
    groups = _items(a.shape[0], c.shape[1])[1]
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
_project_share = nb.njit(**KERNEL_OPTIONS)(_project_share)


def project(a, wpack, c, spill, team=None):
    """c = a @ W^T with W packed by packing.pack_input_weights (module docstring); on
    `team` (team.Team) where one is given and the product is not small."""
    small = a.shape[0] * a.shape[1] * c.shape[1] <= SERIAL_WORK
    workers = min(nb.get_num_threads(), _split(a.shape[0], c.shape[1])[0])
    if team is not None and not small and workers > 1 and not serial_only():
        team.launch(_project_share, (a, wpack, c, spill), 1, workers)
        return c
    with LAUNCH_LOCK:
        pick(_project, _project_serial, small)(a, wpack, c, spill)
    return c
