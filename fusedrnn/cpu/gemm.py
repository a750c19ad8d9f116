"""The input projection W_x x_t of every step, as one GEMM on Numba's threads.

Why not numpy's matmul, which is as fast on its own: OpenBLAS's threads spin for about
0.1 s after each call (its THREAD_TIMEOUT, 2^28 cycles, read once at start-up), and the
fused loop that follows competes with them for the same 2 cores. Measured on the 2-core
machine, rnn_relu T=300 N=20 I=H=800 float32: the fused loop takes 210 ms right after an
OpenBLAS GEMM and 143 ms when started 0.3 s later (132 ms with OPENBLAS_THREAD_TIMEOUT=4,
which a library cannot set). Running the projection with the fused loop's own
micro-kernel keeps an inference call on one thread pool. That holds in float32, and in
float64 where the tiles are 512 bits wide; with 256-bit float64 tiles this kernel ran at
about half of numpy's dgemm, which won despite its spinning threads
(FusedLayer.projects_input gives the measurements).

pack_input_weights(ws, out)
    ws     sequence of (G*H, K) arrays, the input weights of each direction, in order
    out    (P, K, 16) scratch, P = ceil(len(ws)*G*H / 16): panel p holds output columns
           16p..16p+15 of the concatenated rows as columns of W^T, zero past the end

project(a, wpack, c, spill)
    a      (M, K)   in   rows of x (contiguous rows, unit column stride)
    wpack  (P, K, 16) in pack_input_weights's layout
    c      (M, C)   out  a @ W^T, C = the concatenated row count; every element written
    spill  (ceil(M/CHUNK), CHUNK, 16) scratch for a partial last panel (C % 16 != 0)
    One dtype throughout (float32 or float64); c overlaps nothing.
"""
from __future__ import annotations

import numba as nb
from numba import prange

from .mathfn import zero_like
from .microkernel import PANEL, panel_gemm
from .threads import LAUNCH_LOCK

__all__ = ["CHUNK", "pack_input_weights", "project"]

# Rows per parallel work item: a multiple of both register-tile heights (6 and 3), and
# small enough that a chunk of A (96 x 800 floats, 300 KB) stays in the 1 MB L2 while
# every panel of W passes over it once.
CHUNK = 96


def pack_input_weights(ws, out):
    """Pack the concatenated rows of `ws` into `out` (module docstring)."""
    total = sum(w.shape[0] for w in ws)
    if out.shape[0] * PANEL < total or out.shape[1] != ws[0].shape[1]:
        raise ValueError(f"pack_input_weights: out {out.shape} cannot hold {total} rows "
                         f"of length {ws[0].shape[1]}")
    with LAUNCH_LOCK:
        tail = out.shape[0] * PANEL - total
        if tail:
            out[-1] = 0
        row0 = 0
        for w in ws:
            _pack_rows_at(w, row0, out)
            row0 += w.shape[0]
    return out


@nb.njit(parallel=True, cache=True, nogil=True)
def _pack_rows_at(w, row0, out):
    rows, K = w.shape
    first, last = row0 // PANEL, (row0 + rows - 1) // PANEL
    for p in prange(first, last + 1):
        for k in range(K):
            for u in range(PANEL):
                r = p * PANEL + u - row0
                if 0 <= r < rows:
                    out[p, k, u] = w[r, k]


@nb.njit(parallel=True, cache=True, nogil=True)
def _project(a, wpack, c, spill):
    M, K = a.shape
    C = c.shape[1]
    itemsize = a.itemsize
    full = C // PANEL
    panels = -(-C // PANEL)
    chunks = (M + CHUNK - 1) // CHUNK
    # Few row chunks (T*N = 64: a short sequence of a small batch) would leave a core
    # idle: split the panels into groups so there are at least 8 work items.
    groups = min(panels, max(1, -(-8 // chunks)))
    for item in prange(chunks * groups):
        chunk, group = item // groups, item % groups
        r0 = chunk * CHUNK
        rows = min(CHUNK, M - r0)
        a_rows = a.ctypes.data + r0 * K * itemsize
        c_rows = c.ctypes.data + r0 * C * itemsize
        for p in range(group * panels // groups, (group + 1) * panels // groups):
            if p < full:
                panel_gemm(a_rows, K, rows, wpack[p].ctypes.data,
                           c_rows + p * PANEL * itemsize, C, K, zero_like(a))
            else:      # the partial last panel goes through spill
                panel_gemm(a_rows, K, rows, wpack[p].ctypes.data, spill[chunk].ctypes.data,
                           PANEL, K, zero_like(a))
                for i in range(rows):
                    for u in range(C - full * PANEL):
                        c[r0 + i, full * PANEL + u] = spill[chunk, i, u]


def project(a, wpack, c, spill):
    """c = a @ W^T with W packed by pack_input_weights (module docstring)."""
    with LAUNCH_LOCK:
        _project(a, wpack, c, spill)
    return c
