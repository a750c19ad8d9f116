"""Every weight packer of the CPU kernels: matrices laid out as the micro-kernel's panels.

A panel is (K, PANEL) contiguous: 16 columns of the right-hand factor B, one 16-wide row
per k for the micro-kernel. Each weight is packed once per call, read by every step.

panels(units) -> B = ceil(units / 16), the panels covering `units` columns

pack_recurrent(w_h, gates, out=None)
    w_h    (G*H, K)         in   W_h (or any G row blocks of H)
    out    (B, G, K, 16)    out  panel [b, g]: gate g's units 16b..16b+15 as columns of
                                 W_h^T (a block's gates together), zero past H; or None

pack_recurrent_rows(w_h, out=None)
    w_h    (G*H, R)         in
    out    (B, G*H, 16)     out  panel b: W_h's columns 16b..16b+15 (dg @ W_h's); or None

pack_input_weights(ws, out)
    ws     sequence of (G*H, K) arrays, the input weights of each direction, in order
    out    (P, K, 16)       out  panel p: rows 16p..16p+15 of the concatenated ws as
                                 columns, zero past the end (none between directions)

pack_panel(w, r0, width, out)  (inline Numba function, for use inside a kernel)
    w      (R, K)           in
    out    (K, 16)          out  rows r0..r0+width-1 of w as columns, zero past width

Arrays of one dtype (float32 or float64), C-contiguous; out overlaps nothing.
"""
from __future__ import annotations

import numba as nb
import numpy as np
from numba import prange

from ..threads import LAUNCH_LOCK, SLEEPING_WORKERS, parallel_and_serial, pick
from .mathfn import zero_like
from .microkernel import PANEL
from .rows import VECTOR_BYTES, rows_to_columns

__all__ = ["pack_input_weights", "pack_panel", "pack_recurrent", "pack_recurrent_rows",
           "panels"]


def panels(units):
    """B: panels of 16 covering `units`."""
    return -(-units // PANEL)


# Up to this many weight elements a packer runs as its serial build: a parallel region's
# launch costs more than copying them, and more where it wakes workqueue's workers.
# Measured: bench/results/cpu-kernel-notes.md#packing-and-projection-serial-builds
SERIAL_ELEMENTS = 1 << 19 if SLEEPING_WORKERS else 1 << 18


# A whole panel's rows move by rows_to_columns, the rest element by element: as scalar
# loops the packers ran several times slower than a copy of the weights.
# Measured: bench/results/cpu-kernel-notes.md#packing-transposed-in-vectors
@nb.njit(inline="always")
def _to_columns(w, r0, rows, out):
    """out (K, 16)[k, u] = w[r0 + u, k] for u < rows, 0 for u >= rows."""
    K, size = w.shape[1], w.itemsize
    k = 0
    if rows == PANEL:
        step, like = VECTOR_BYTES // size, zero_like(w)
        src, dst = w.ctypes.data + np.uint64(r0 * K * size), out.ctypes.data
        while k + step <= K:
            rows_to_columns(dst + np.uint64(k * PANEL * size), PANEL, src + np.uint64(k * size),
                            K, like)
            k += step
    for kk in range(k, K):
        for u in range(PANEL):
            out[kk, u] = w[r0 + u, kk] if u < rows else 0


def _pack_recurrent(w, gates, out):
    H = w.shape[0] // gates
    for bg in prange(out.shape[0] * gates):   # (a panel each: more shares than blocks)
        b, g = bg // gates, bg % gates
        _to_columns(w, g * H + b * PANEL, min(PANEL, H - b * PANEL), out[b, g])


_pack_recurrent, _pack_recurrent_serial = parallel_and_serial(_pack_recurrent)


def _check(name, ws, out):
    """A ValueError unless every w of ws and out are C-contiguous float32 or float64 of
    one dtype: the vector moves read and write them as such."""
    for w in ws:
        if w.dtype != out.dtype or out.dtype not in (np.float32, np.float64) or not (
                w.flags.c_contiguous and out.flags.c_contiguous):
            raise ValueError(f"{name}: C-contiguous weights and out of one dtype, float32 or "
                             f"float64, expected, got {w.dtype} (contiguous "
                             f"{w.flags.c_contiguous}) into {out.dtype} (contiguous "
                             f"{out.flags.c_contiguous})")


def pack_recurrent(w_h, gates, out=None):
    """W_h (G*H, K) -> (B, G, K, 16) (module docstring)."""
    if out is None:
        out = np.empty((panels(w_h.shape[0] // gates), gates, w_h.shape[1], PANEL), w_h.dtype)
    _check("pack_recurrent", (w_h,), out)
    with LAUNCH_LOCK:
        small = w_h.size <= SERIAL_ELEMENTS
        pick(_pack_recurrent, _pack_recurrent_serial, small)(w_h, gates, out)
    return out


def _pack_recurrent_rows(w, out):
    GH, R = w.shape
    for b in prange(out.shape[0]):
        for k in range(GH):
            for u in range(PANEL):
                j = b * PANEL + u
                out[b, k, u] = w[k, j] if j < R else 0


_pack_recurrent_rows, _pack_recurrent_rows_serial = parallel_and_serial(_pack_recurrent_rows)


def pack_recurrent_rows(w_h, out=None):
    """W_h (G*H, R) -> (B, G*H, 16) (module docstring)."""
    if out is None:
        out = np.empty((panels(w_h.shape[1]), w_h.shape[0], PANEL), w_h.dtype)
    with LAUNCH_LOCK:
        small = w_h.size <= SERIAL_ELEMENTS
        pick(_pack_recurrent_rows, _pack_recurrent_rows_serial, small)(w_h, out)
    return out


def pack_input_weights(ws, out):
    """The concatenated rows of `ws` -> out (P, K, 16) (module docstring)."""
    _check("pack_input_weights", ws, out)
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
            pick(_pack_rows_at, _pack_rows_at_serial, w.size <= SERIAL_ELEMENTS)(w, row0, out)
            row0 += w.shape[0]
    return out


def _pack_rows_at(w, row0, out):
    rows, K = w.shape
    first, last = row0 // PANEL, (row0 + rows - 1) // PANEL
    for p in prange(first, last + 1):
        r0 = p * PANEL - row0
        if r0 >= 0 and r0 + PANEL <= rows:
            _to_columns(w, r0, PANEL, out[p])
        else:   # a panel shared with the other direction's rows, or the last
            for k in range(K):
                for u in range(PANEL):
                    r = r0 + u
                    if 0 <= r < rows:
                        out[p, k, u] = w[r, k]


_pack_rows_at, _pack_rows_at_serial = parallel_and_serial(_pack_rows_at)


@nb.njit(inline="always")
def pack_panel(w, r0, width, out):
    """out (K, 16) = rows r0..r0+width-1 of w (R, K) as columns, zero past width."""
    for u in range(PANEL):
        if u < width:
            for k in range(w.shape[1]):
                out[k, u] = w[r0 + u, k]
        else:
            for k in range(w.shape[1]):
                out[k, u] = 0
