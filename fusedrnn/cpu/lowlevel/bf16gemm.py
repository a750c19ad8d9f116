"""The bfloat16 path's products around the vdpbf16ps tile (bf16.py): its packers, the
input projection, and the float32 -> bfloat16 rounding the fused loop's states take.

Layouts are bf16.py's (kp = ceil(K / 2) pairs of k); rounding is to nearest even.

bf16_bits(x)                  (inline) float32 -> bfloat16 bits (uint32); NaN stays NaN
round_rows(src, dst)
    src  (M, K) float32       in
    dst  (M, 2*kp) uint16     out  src rounded to bfloat16, a zero in the odd-K pad
pack_recurrent_pairs(w_h, gates, out)
    w_h  (G*H, K) float32     in   bfloat16 values (packed exactly), or uint16 bits
    out  (B, G, kp, 16) uint32 out pack_recurrent's order, zero past H and K
pack_input_pairs(ws, out)
    ws   sequence of (G*H, K) float32, each direction's W_x (or uint16 bits, as above)
    out  (P, kp, 16) uint32   out  pack_input_weights's order, zero past the end
widen(src, dst) / narrow(src, dst)
    src, dst  flat arrays of one length: bfloat16 bits (uint16) <-> float32 (exact /
              rounded): the op's conversions at its edges, on Numba's threads
interleave_rows(src, dst)
    src  (K, M) float32       in   any row stride, unit column stride (a column block of dG)
    dst  (kp, M) uint32       out  (p, m) holds src[2p, m] (low) and src[2p+1, m] (high),
                                   zero past K: src^T as A by columns (panel_gemm_bf16_cols)
pack_k_pairs(src, out)
    src  (K, C) float32       in   any row stride, unit column stride (or bfloat16 in place)
    out  (P, kp, 16) uint32   out  src as panels of pairs of k, rounded, zero past K and C
project_bf16(a, wpack, c, spill, by_columns=False)
    a     (M, kp) uint32      in   rows of bfloat16 pairs; with by_columns (kp, M), by columns
    wpack (P, kp, 16) uint32  in   pack_input_pairs's or pack_k_pairs's
    c     (M, C) float32      out  A @ W^T (A @ B for pack_k_pairs's B); every element written
    spill (ceil(M/CHUNK), CHUNK, 16) float32  scratch for a partial last panel
No argument overlaps another.
"""
from __future__ import annotations

import numba as nb
import numpy as np
from numba import prange, types
from numba.extending import overload

from ..threads import LAUNCH_LOCK, parallel_and_serial, pick
from . import gemm as _gemm  # (their serial bounds, read per call)
from . import packing as _packing
from .bf16 import panel_gemm_bf16, panel_gemm_bf16_cols, panel_gemm_bf16_cols_acc
from .gemm import CHUNK, QUAD
from .microkernel import PANEL

__all__ = ["bf16_bits", "interleave_rows", "narrow", "pack_input_pairs", "pack_k_pairs",
           "pack_recurrent_pairs", "project_bf16", "round_rows", "widen"]


@nb.njit(inline="always", cache=True)
def bf16_bits(x):
    bits = np.uint32(np.float32(x).view(np.uint32))
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)   # NaN: keep it quiet
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    # a select, not a branch, so that the loops calling this vectorise
    return ((bits >> np.uint32(16)) | np.uint32(0x40)) if nan else \
        ((bits + rounding) >> np.uint32(16))


# The loops below index 1-D slices from 0: from any other start Numba's loops did not
# vectorise. Measured: bench/results/cpu-kernel-notes.md#bf16-the-training-gemms


def _round_rows(src, dst):
    M, K = src.shape
    for i in prange(M):
        s, d = src[i], dst[i]
        for k in range(K):
            d[k] = np.uint16(bf16_bits(s[k]))
        for k in range(K, d.shape[0]):
            d[k] = 0


_round_rows, _round_rows_serial = parallel_and_serial(_round_rows)


def round_rows(src, dst):
    """dst (M, 2*kp) uint16 = src (M, K) float32 rounded to bfloat16 (docstring above)."""
    with LAUNCH_LOCK:
        small = src.size <= _packing.SERIAL_ELEMENTS
        pick(_round_rows, _round_rows_serial, small)(src, dst)
    return dst


def _interleave_rows(src, dst):
    K, M = src.shape
    for p in prange(dst.shape[0]):
        k, d = 2 * p, dst[p]
        low = src[k]
        if k + 1 < K:
            high = src[k + 1]
            for m in range(M):
                d[m] = bf16_bits(low[m]) | (bf16_bits(high[m]) << np.uint32(16))
        else:
            for m in range(M):
                d[m] = bf16_bits(low[m])


_interleave_rows, _interleave_rows_serial = parallel_and_serial(_interleave_rows)


def interleave_rows(src, dst):
    """dst (kp, M) uint32 = src (K, M)'s row pairs, rounded, interleaved (docstring above)."""
    if dst.shape != (-(-src.shape[0] // 2), src.shape[1]) or src.strides[1] != 4:
        raise ValueError(f"interleave_rows: dst {dst.shape} does not fit src {src.shape} "
                         f"(strides {src.strides})")
    with LAUNCH_LOCK:
        small = src.size <= _packing.SERIAL_ELEMENTS
        pick(_interleave_rows, _interleave_rows_serial, small)(src, dst)
    return dst


def _pack_k_pairs(src, out):
    K, C = src.shape
    P, kp = out.shape[0], out.shape[1]
    for p in prange(kp):
        k = 2 * p
        for j in range(P):
            for u in range(PANEL):
                c = j * PANEL + u
                if c >= C:
                    out[j, p, u] = 0
                elif k + 1 < K:
                    out[j, p, u] = _bits(src[k, c]) | (_bits(src[k + 1, c]) << np.uint32(16))
                else:
                    out[j, p, u] = _bits(src[k, c])


_pack_k_pairs, _pack_k_pairs_serial = parallel_and_serial(_pack_k_pairs)


def pack_k_pairs(src, out):
    """out (P, kp, 16) uint32 = src (K, C) as panels of pairs of k (docstring above)."""
    K, C = src.shape
    if src.dtype.name == "bfloat16":   # its bits, as they are
        src = src.view(np.uint16)
    if out.shape != (-(-C // PANEL), -(-K // 2), PANEL) or src.strides[1] != src.itemsize:
        raise ValueError(f"pack_k_pairs: out {out.shape} does not fit src {src.shape} "
                         f"(strides {src.strides})")
    with LAUNCH_LOCK:
        small = src.size <= _packing.SERIAL_ELEMENTS
        pick(_pack_k_pairs, _pack_k_pairs_serial, small)(src, out)
    return out


_FLAT_CHUNK = 1 << 14   # values per work item of widen/narrow


def _widen(src, dst):
    n = src.shape[0]
    for c in prange(-(-n // _FLAT_CHUNK)):
        s = src[c * _FLAT_CHUNK:min(n, (c + 1) * _FLAT_CHUNK)]
        d = dst[c * _FLAT_CHUNK:min(n, (c + 1) * _FLAT_CHUNK)]
        for i in range(s.shape[0]):
            d[i] = np.uint32(s[i]) << np.uint32(16)


def _narrow(src, dst):
    n = src.shape[0]
    for c in prange(-(-n // _FLAT_CHUNK)):
        s = src[c * _FLAT_CHUNK:min(n, (c + 1) * _FLAT_CHUNK)]
        d = dst[c * _FLAT_CHUNK:min(n, (c + 1) * _FLAT_CHUNK)]
        for i in range(s.shape[0]):
            d[i] = np.uint16(bf16_bits(s[i]))


_widen, _widen_serial = parallel_and_serial(_widen)
_narrow, _narrow_serial = parallel_and_serial(_narrow)


def widen(src, dst):
    """dst (float32) = src (bfloat16 bits, uint16), both flat (docstring above)."""
    with LAUNCH_LOCK:
        small = src.size <= _packing.SERIAL_ELEMENTS
        pick(_widen, _widen_serial, small)(src, dst.view(np.uint32))
    return dst


def narrow(src, dst):
    """dst (bfloat16 bits, uint16) = src (float32) rounded, both flat (docstring above)."""
    with LAUNCH_LOCK:
        small = src.size <= _packing.SERIAL_ELEMENTS
        pick(_narrow, _narrow_serial, small)(src, dst)
    return dst


def _bits(x):
    """(Numba only) bfloat16 bits of a weight: a float32 value rounded, or uint16 bits."""
    raise NotImplementedError("_bits is compiled by Numba only")


@overload(_bits)
def _bits_of(x):
    if isinstance(x, types.Float):
        return lambda x: bf16_bits(x)
    if isinstance(x, types.Integer):
        return lambda x: np.uint32(x)
    return None


@nb.njit(inline="always", cache=True)
def _pair(w, r, k, K):
    low = _bits(w[r, k])
    high = _bits(w[r, k + 1]) if k + 1 < K else np.uint32(0)
    return low | (high << np.uint32(16))


def _pack_recurrent_pairs(w, gates, out):
    H, K = w.shape[0] // gates, w.shape[1]
    for b in prange(out.shape[0]):
        for g in range(gates):
            for p in range(out.shape[2]):
                for u in range(PANEL):
                    j = b * PANEL + u
                    out[b, g, p, u] = _pair(w, g * H + j, 2 * p, K) if j < H else 0


_pack_recurrent_pairs, _pack_recurrent_pairs_serial = parallel_and_serial(_pack_recurrent_pairs)


def pack_recurrent_pairs(w_h, gates, out):
    """W_h (G*H, K) float32 or bfloat16 bits -> (B, G, kp, 16) uint32 (docstring above)."""
    with LAUNCH_LOCK:
        small = w_h.size <= _packing.SERIAL_ELEMENTS
        pick(_pack_recurrent_pairs, _pack_recurrent_pairs_serial, small)(w_h, gates, out)
    return out


def _pack_pairs_at(w, row0, out):
    rows, K = w.shape
    first, last = row0 // PANEL, (row0 + rows - 1) // PANEL
    for p in prange(first, last + 1):
        for q in range(out.shape[1]):
            for u in range(PANEL):
                r = p * PANEL + u - row0
                if 0 <= r < rows:
                    out[p, q, u] = _pair(w, r, 2 * q, K)


_pack_pairs_at, _pack_pairs_at_serial = parallel_and_serial(_pack_pairs_at)


def pack_input_pairs(ws, out):
    """The concatenated rows of `ws` -> out (P, kp, 16) uint32 pairs (docstring above)."""
    total, K = sum(w.shape[0] for w in ws), ws[0].shape[1]
    if out.shape[0] * PANEL < total or out.shape[1] != -(-K // 2):
        raise ValueError(f"pack_input_pairs: out {out.shape} cannot hold {total} rows "
                         f"of length {K}")
    with LAUNCH_LOCK:
        if out.shape[0] * PANEL > total:
            out[-1] = 0
        row0 = 0
        for w in ws:
            small = w.size <= _packing.SERIAL_ELEMENTS
            pick(_pack_pairs_at, _pack_pairs_at_serial, small)(w, row0, out)
            row0 += w.shape[0]
    return out


# Pairs of k per pass of the by-columns product (dW's, K = T*N): in blocks, each later one
# adding to C, a chunk's A over one block stays in L2 while every panel passes over it.
# (A by rows, its chunk contiguous, gained nothing: one pass.)
# Measured: bench/results/cpu-kernel-notes.md#bf16-k-blocks-for-the-weight-gradients
K_BLOCK = 1024
# Work items at least of the by-columns form (by rows gemm._project's 8, which left the 9
# chunks of an 800-row product 5 to 4 on two workers)
ITEMS = 16


@nb.njit(inline="always", cache=True)
def _quad(a, lda, rows, panel, pstride, c, ldc, kb, by_columns, later):
    if not by_columns:
        panel_gemm_bf16(a, lda, rows, panel, pstride, QUAD, c, ldc, kb)
    elif later:
        panel_gemm_bf16_cols_acc(a, lda, rows, panel, pstride, QUAD, c, ldc, kb)
    else:
        panel_gemm_bf16_cols(a, lda, rows, panel, pstride, QUAD, c, ldc, kb)


@nb.njit(inline="always", cache=True)
def _single(a, lda, rows, panel, c, ldc, kb, by_columns, later):
    if not by_columns:
        panel_gemm_bf16(a, lda, rows, panel, 0, 1, c, ldc, kb)
    elif later:
        panel_gemm_bf16_cols_acc(a, lda, rows, panel, 0, 1, c, ldc, kb)
    else:
        panel_gemm_bf16_cols(a, lda, rows, panel, 0, 1, c, ldc, kb)


def _project_bf16(a, wpack, c, spill, by_columns):
    M, C = c.shape
    kp = wpack.shape[1]
    full = C // PANEL
    panels = -(-C // PANEL)
    chunks = (M + CHUNK - 1) // CHUNK
    groups = min(panels, max(1, -(-(ITEMS if by_columns else 8) // chunks)))
    lda = M if by_columns else kp   # uint32 words between k-pairs / rows of A
    step = K_BLOCK if by_columns else kp
    for item in prange(chunks * groups):
        chunk, group = item // groups, item % groups
        r0 = chunk * CHUNK
        rows = min(CHUNK, M - r0)
        a_rows = a.ctypes.data + (r0 if by_columns else r0 * kp) * 4
        c_rows = c.ctypes.data + r0 * C * 4
        first, stop = group * panels // groups, (group + 1) * panels // groups
        whole = min(stop, full)
        for k0 in range(0, kp, step):
            kb = min(step, kp - k0)
            later = k0 > 0                           # add to the blocks before
            a_k = a_rows + (k0 * lda if by_columns else k0) * 4
            along = k0 * PANEL * 4                   # the block's rows of every panel
            p = first
            while p + QUAD <= whole:
                _quad(a_k, lda, rows, wpack[p].ctypes.data + along, kp * PANEL,
                      c_rows + p * PANEL * 4, C, kb, by_columns, later)
                p += QUAD
            for p in range(p, stop):  # noqa: B020  (p goes on from the loop above)
                to, ldc = c_rows + p * PANEL * 4, C
                if p >= full:
                    to, ldc = np.int64(spill[chunk].ctypes.data), PANEL
                _single(a_k, lda, rows, wpack[p].ctypes.data + along, to, ldc, kb, by_columns,
                        later)
        if stop > full:
            for i in range(rows):
                for u in range(C - full * PANEL):
                    c[r0 + i, full * PANEL + u] = spill[chunk, i, u]


_project_bf16, _project_bf16_serial = parallel_and_serial(_project_bf16)


def project_bf16(a, wpack, c, spill, by_columns=False):
    """c = A @ W^T in float32 from bfloat16 pairs (docstring above)."""
    M, kp = (a.shape[1], a.shape[0]) if by_columns else a.shape
    if (M, kp) != (c.shape[0], wpack.shape[1]) or wpack.shape[0] * PANEL < c.shape[1]:
        raise ValueError(f"project_bf16: a {a.shape} (by_columns={by_columns}), wpack "
                         f"{wpack.shape} and c {c.shape} do not fit")
    with LAUNCH_LOCK:
        small = M * kp * 2 * c.shape[1] <= _gemm.SERIAL_WORK
        pick(_project_bf16, _project_bf16_serial, small)(a, wpack, c, spill, by_columns)
    return c
