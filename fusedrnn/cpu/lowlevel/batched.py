"""A single step's backward GEMMs (a layer's, within bounds) in one region, B read in place.

At T=1 dx = dG @ W_x, dh_0 = dG @ W_h, dW_x = dG^T @ x and dW_h = dG^T @ h_0 are each too
small to pay a launch (a sleeping helper's wake each, or OpenBLAS's workers spinning
after), and packing W whole reads it twice: here they share one region's work items, B
read in place (panel_gemm_free) or a strip packed per item (_packs; by columns A's too).
Measured: bench/results/cpu-kernel-notes.md#batched-a-single-steps-backward-in-one-region,
bench/results/cpu-kernel-notes.md#batched-the-weight-gradients-packed,
bench/results/cpu-kernel-notes.md#batched-a-sequences-backward-in-one-region

products(jobs, items, like, work, team=None)
    jobs   (P, JOB) int64, a row per C = A @ B (job_rows): [a, lda, M, b, ldb, C, c, ldc,
           K, by_columns, first item], addresses and element strides of
           A (M, K), or by_columns A^T's storage (K, M): A[r, k] at a[k * lda + r]
           B (K, C) and C (M, C), unit column strides; C every element written, no C
           overlapping any job's A, B or other C
    like   a scalar of the dtype (float32 or float64) of every A, B and C
    team   team.Team, or None: Numba's layer (under LAUNCH_LOCK), or serial when small
"""
from __future__ import annotations

import threading

import numba as nb
import numpy as np
from numba import prange

from ..threads import KERNEL_OPTIONS, LAUNCH_LOCK, parallel_and_serial, pick, serial_only
from .mathfn import zero_like
from .microkernel import (
    PANEL,
    _groups,
    _itemsize,
    panel_gemm,
    panel_gemm_cols,
    panel_gemm_free,
    panel_gemm_free_cols,
    panels_per_tile,
    tile_height,
)
from .rows import row_copy
from .workshare import claim, finish, team_arrive, team_leave

__all__ = ["JOB", "job_rows", "products"]

JOB = 11
# Rows of C per work item (the tiles' heights divide it), and panels per item
ITEM_ROWS = 96
QUAD = 4
# Up to this many multiply-adds in all, one thread runs every job (a launch, a sleeping
# helper's wake, cost more).
# Measured: bench/results/cpu-kernel-notes.md#batched-a-single-steps-backward-in-one-region
SERIAL_WORK = 1 << 21
# Rows past one tile (_TILES: the tallest of QUAD panels' tiles) read B's strip once per
# tile: cached in place up to PACK_K and PACK_ROWS, else packed; by columns (dG^T) with A's
# block past PACK_COLUMNS_K k rows (at a power-of-two stride they share one or two L1 sets).
# Measured: bench/results/cpu-kernel-notes.md#batched-a-single-steps-backward-in-one-region,
# bench/results/cpu-kernel-notes.md#batched-the-weight-gradients-packed
PACK_K = 512
PACK_ROWS = 64
PACK_COLUMNS_K = 8
_TILES = tuple(tile_height(t, max(_groups(QUAD, panels_per_tile(t))))
               for t in (np.float32, np.float64))


@nb.njit(inline="always")
def _packs(size, rows, K, by_columns):
    """Whether an item of `rows` rows (elements of `size` bytes) packs B's strip first."""
    if rows <= (_TILES[0] if size == 4 else _TILES[1]):
        return False
    return K > PACK_COLUMNS_K if by_columns else K > PACK_K or rows > PACK_ROWS


def _items(M, C):
    """(row chunks, column groups) of one job: groups of QUAD panels, and the columns
    past the last whole panel as a group of their own."""
    full = C // PANEL
    return -(-M // ITEM_ROWS), -(-full // QUAD) + (C % PANEL != 0)


_job_items = nb.njit(inline="always")(_items)


def job_rows(products, dtype):
    """(jobs, work items, multiply-adds) of [(a, b, c, by_columns)] (module docstring), 2-D
    arrays of `dtype`; a ValueError names the first the kernel cannot read."""
    jobs, first, work = np.empty((len(products), JOB), np.int64), 0, 0
    for j, (a, b, c, by_columns) in enumerate(products):
        for x in (a, b, c):
            if x.dtype != dtype or x.ndim != 2 or x.size and (
                    x.strides[1] != dtype.itemsize or x.strides[0] < 0):
                raise ValueError(f"job_rows: 2-D {dtype} arrays with unit column strides "
                                 f"expected, got {x.dtype} of strides {x.strides}")
        if (a.shape[::-1] if by_columns else a.shape) + b.shape[1:] != c.shape[:1] + b.shape \
                or b.shape[1] != c.shape[1]:
            raise ValueError(f"job_rows: (M, K) @ (K, C) -> (M, C) expected, got "
                             f"{a.shape}{'^T' if by_columns else ''} @ {b.shape} -> {c.shape}")
        first, work = _fill(jobs[j], a, b, c, by_columns, first, work)
    return jobs, first, work


@nb.njit(cache=True)
def _fill(row, a, b, c, by_columns, first, work):
    """One job's row (addresses read here: cheaper than Python's); (next first item, work)."""
    M, C = c.shape
    K = a.shape[0] if by_columns else a.shape[1]
    size = c.itemsize
    row[0], row[1], row[2] = a.ctypes.data, a.strides[0] // size, M
    row[3], row[4], row[5] = b.ctypes.data, b.strides[0] // size, C
    row[6], row[7], row[8] = c.ctypes.data, c.strides[0] // size, K
    row[9], row[10] = by_columns, first
    chunks, groups = _job_items(M, C)
    return first + chunks * groups, work + M * K * C


@nb.njit(inline="always")
def _run_item(jobs, item, like, strips, worker):
    """The work item `item` of all jobs: a chunk of rows by a group of panels; `worker`'s
    row of `strips` holds B's packed panels, then by columns A's block (_packs)."""
    j = jobs.shape[0] - 1
    while jobs[j, 10] > item:
        j -= 1
    a, lda, M, b, ldb, C, c, ldc, K, by_columns, first = (
        jobs[j, 0], jobs[j, 1], jobs[j, 2], jobs[j, 3], jobs[j, 4], jobs[j, 5], jobs[j, 6],
        jobs[j, 7], jobs[j, 8], jobs[j, 9], jobs[j, 10])
    size = _itemsize(like)
    groups = _job_items(M, C)[1]
    chunk, group = (item - first) // groups, (item - first) % groups
    r0 = chunk * ITEM_ROWS
    rows = min(ITEM_ROWS, M - r0)
    a_r = a + (r0 if by_columns else r0 * lda) * size
    c_r = c + r0 * ldc * size
    full = C // PANEL
    p, stop = group * QUAD, min(group * QUAD + QUAD, full)
    if p >= full:   # the columns past the last whole panel
        _tail_columns(a_r, lda, rows, b + full * PANEL * size, ldb, C - full * PANEL,
                      c_r + full * PANEL * size, ldc, K, by_columns, like)
        return
    if _packs(size, rows, K, by_columns):
        strip = strips[worker].ctypes.data
        for k in range(K):
            for q in range(stop - p):
                row_copy(strip + (q * K + k) * PANEL * size,
                         b + (k * ldb + (p + q) * PANEL) * size, PANEL, like)
        if by_columns:   # A's block after the strip, k-major: A[r, k] at [k * rows + r]
            block = strip + QUAD * K * PANEL * size
            for k in range(K):
                for u in range(0, rows, PANEL):
                    row_copy(block + (k * rows + u) * size, a_r + (k * lda + u) * size,
                             min(PANEL, rows - u), like)
            a_r, lda = block, rows
        if stop - p == QUAD:
            _packed(a_r, lda, rows, strip, K * PANEL, QUAD, c_r + p * PANEL * size, ldc, K,
                    by_columns, like)
        else:
            for q in range(stop - p):
                _packed(a_r, lda, rows, strip + q * K * PANEL * size, 0, 1,
                        c_r + (p + q) * PANEL * size, ldc, K, by_columns, like)
        return
    if stop - p == QUAD:
        _free(a_r, lda, rows, b + p * PANEL * size, ldb, QUAD, c_r + p * PANEL * size, ldc, K,
              by_columns, like)
        return
    for q in range(p, stop):
        _free(a_r, lda, rows, b + q * PANEL * size, ldb, 1, c_r + q * PANEL * size, ldc, K,
              by_columns, like)


@nb.njit(inline="always")
def _packed(a, lda, rows, strip, pstride, npanels, c, ldc, K, by_columns, like):
    """panel_gemm or its _cols form over packed panels (a run-time choice)."""
    if by_columns:
        panel_gemm_cols(a, lda, rows, strip, pstride, npanels, c, ldc, K, like)
    else:
        panel_gemm(a, lda, rows, strip, pstride, npanels, c, ldc, K, like)


@nb.njit(inline="always")
def _free(a, lda, rows, b, ldb, npanels, c, ldc, K, by_columns, like):
    """panel_gemm_free or its _cols form (a run-time choice)."""
    if by_columns:
        panel_gemm_free_cols(a, lda, rows, b, ldb, npanels, c, ldc, K, like)
    else:
        panel_gemm_free(a, lda, rows, b, ldb, npanels, c, ldc, K, like)


@nb.njit
def _tail_columns(a, lda, rows, b, ldb, width, c, ldc, K, by_columns, like):
    """C[:, :width] = A @ B[:, :width], width < 16: through a zero-padded panel and a spill
    (a panel read in place would pass B's last row)."""
    size = _itemsize(like)
    panel = np.full((max(K, 1), PANEL), zero_like(like))
    spill = np.empty((rows, PANEL), panel.dtype)
    for k in range(K):
        row_copy(panel.ctypes.data + k * PANEL * size, b + k * ldb * size, width, like)
    _free(a, lda, rows, panel.ctypes.data, PANEL, 1, spill.ctypes.data, PANEL, K, by_columns,
          like)
    for i in range(rows):
        row_copy(c + i * ldc * size, spill.ctypes.data + i * PANEL * size, width, like)


def _products(jobs, items, like, strips):
    for item in prange(items):
        _run_item(jobs, item, like, strips, nb.get_thread_id())


def _products_share(jobs, items, like, strips, share):
    """_products' items claimed by one share of a team's region (workshare.py)."""
    counters, workers, me = share
    if me == 0:
        team_arrive(counters, workers)
    done = 0
    while True:
        item = claim(counters, 0, me, workers, items)
        if item < 0:
            break
        _run_item(jobs, item, like, strips, me)
        done += 1
    finish(counters, 0, done, items)
    if me == 0:
        team_leave(counters, workers)


_products, _products_serial = parallel_and_serial(_products)
_products_share = nb.njit(**KERNEL_OPTIONS)(_products_share)


_strips = threading.local()


def _strips_for(jobs, dtype):
    """A row per Numba thread for B's strips and A's blocks, kept (fresh pages cost more)."""
    width = max((row[8] * (QUAD * PANEL + ITEM_ROWS * row[9]) for row in jobs.tolist()),
                default=1)
    held = getattr(_strips, dtype.char, None)
    if held is None or held.shape[1] < width or held.shape[0] < nb.config.NUMBA_NUM_THREADS:
        held = np.empty((nb.config.NUMBA_NUM_THREADS, width), dtype)
        setattr(_strips, dtype.char, held)
    return held


def products(jobs, items, like, work, team=None):
    """Every job's C (module docstring): `items` and `work` (multiply-adds in all) as
    job_rows counted them; on `team` where one is given and the work is not small."""
    small = work <= SERIAL_WORK or items < 2
    workers = min(nb.get_num_threads(), items)
    strips = _strips_for(jobs, np.dtype(type(like)))
    if team is not None and not small and workers > 1 and not serial_only():
        team.launch(_products_share, (jobs, items, like, strips), 1, workers)
        return
    with LAUNCH_LOCK:
        pick(_products, _products_serial, small)(jobs, items, like, strips)
