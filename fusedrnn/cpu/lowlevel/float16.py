"""IEEE float16 on the CPU: conversions to and from float32, and the input projection
that reads half-precision data in place (float16, and bfloat16 without AVX512-BF16, are
converted inside the kernel, not by copying the whole tensor). Numba's CPU target has no
float16, so values travel as their bits (uint16), converted with selects LLVM vectorises.

f16_value(bits)  (inline) float16 bits (uint16) -> float32, exact (NaN payloads too)
f16_bits(x)      (inline) float32 -> float16 bits, nearest even; past range inf; NaN stays
widen_f16(src, dst) / narrow_f16(src, dst)
    src, dst  flat arrays of one length: float16 bits (uint16) <-> float32, on Numba's
              threads: the op's conversions at its edges (numpy's casts are single-threaded)
project_widened(a, bf16, wpack, c, spill, block)
    a      (M, K) uint16   in   contiguous rows of float16 bits, or bfloat16 where bf16
    bf16   bool
    wpack  (P, K, 16) float32 in  packing.pack_input_weights's layout
    c      (M, C) float32  out  a @ W^T, every element written
    spill  (ceil(M/CHUNK), CHUNK, 16) float32 scratch, as gemm.project's
    block  (W, CHUNK, K) float32 scratch: worker w widens its chunks into block[w]
    No argument overlaps another. gemm.project's tiling; A widened a chunk at a time.
"""
from __future__ import annotations

import numba as nb
import numpy as np
from numba import prange

from ..threads import LAUNCH_LOCK, parallel_and_serial, pick
from . import gemm as _gemm  # (their serial bounds, read per call)
from . import packing as _packing
from .gemm import CHUNK, QUAD
from .mathfn import zero_like
from .microkernel import PANEL, panel_gemm

__all__ = ["f16_bits", "f16_value", "narrow_f16", "project_widened", "widen_f16"]

_TWO_M24 = np.float32(2.0 ** -24)       # float16's smallest subnormal
# 0.5 as float32 bits, ((127 - 15) + (23 - 10) + 1) << 23: its last place is float16's
# smallest subnormal, so adding it rounds to float16's subnormal grid
_DENORM_MAGIC = np.uint32(0x3F000000)


@nb.njit(inline="always", cache=True)
def f16_value(bits):
    h = np.uint32(bits)
    mag = h & np.uint32(0x7FFF)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    # normal: rebias the exponent (15 -> 127); inf/NaN: the all-ones exponent
    moved = mag << np.uint32(13)
    wide = (moved | np.uint32(0x7F800000)) if mag >= np.uint32(0x7C00) else \
        (moved + np.uint32(0x38000000))
    # subnormal (and zero): the mantissa times 2^-24, exact in float32
    small = np.float32(np.float32(mag) * _TWO_M24).view(np.uint32)
    out = small if mag < np.uint32(0x400) else wide
    return np.uint32(out | sign).view(np.float32)


@nb.njit(inline="always", cache=True)
def f16_bits(x):
    b = np.float32(x).view(np.uint32)
    sign = (b >> np.uint32(16)) & np.uint32(0x8000)
    f = np.uint32(b & np.uint32(0x7FFFFFFF))
    # at or past 2^16 (and inf/NaN): infinity, or a quiet NaN
    big = np.uint32(0x7E00) if f > np.uint32(0x7F800000) else np.uint32(0x7C00)
    # below 2^-14 (float16 subnormals): adding 0.5 rounds the mantissa into the low bits
    sub = np.uint32(np.float32(f.view(np.float32) + np.float32(0.5)).view(np.uint32) -
                    _DENORM_MAGIC)
    # normal: rebias, then round to nearest even on the 13 dropped bits (a carry past the
    # largest finite value gives infinity)
    odd = (f >> np.uint32(13)) & np.uint32(1)
    # 0xC8000FFF: (15 - 127) << 23 (mod 2^32) plus 0xFFF, the half below the last place
    normal = np.uint32(f + np.uint32(0xC8000FFF) + odd) >> np.uint32(13)
    out = big if f >= np.uint32(0x47800000) else (sub if f < np.uint32(0x38800000) else normal)
    return np.uint16(out | sign)


# Flat loops index 1-D slices from 0 so that they vectorise (bf16gemm.py says why).
_FLAT_CHUNK = 1 << 14


def _widen_f16(src, dst):
    n = src.shape[0]
    for c in prange(-(-n // _FLAT_CHUNK)):
        s = src[c * _FLAT_CHUNK:min(n, (c + 1) * _FLAT_CHUNK)]
        d = dst[c * _FLAT_CHUNK:min(n, (c + 1) * _FLAT_CHUNK)]
        for i in range(s.shape[0]):
            d[i] = f16_value(s[i])


def _narrow_f16(src, dst):
    n = src.shape[0]
    for c in prange(-(-n // _FLAT_CHUNK)):
        s = src[c * _FLAT_CHUNK:min(n, (c + 1) * _FLAT_CHUNK)]
        d = dst[c * _FLAT_CHUNK:min(n, (c + 1) * _FLAT_CHUNK)]
        for i in range(s.shape[0]):
            d[i] = f16_bits(s[i])


_widen_f16, _widen_f16_serial = parallel_and_serial(_widen_f16)
_narrow_f16, _narrow_f16_serial = parallel_and_serial(_narrow_f16)


def widen_f16(src, dst):
    """dst (float32) = src (float16 bits, uint16), both flat (docstring above)."""
    with LAUNCH_LOCK:
        small = src.size <= _packing.SERIAL_ELEMENTS
        pick(_widen_f16, _widen_f16_serial, small)(src, dst)
    return dst


def narrow_f16(src, dst):
    """dst (float16 bits, uint16) = src (float32) rounded, both flat (docstring above)."""
    with LAUNCH_LOCK:
        small = src.size <= _packing.SERIAL_ELEMENTS
        pick(_narrow_f16, _narrow_f16_serial, small)(src, dst)
    return dst


@nb.njit(inline="always", cache=True)
def _widen_row(src, bf16, dst):
    if bf16:
        for k in range(dst.shape[0]):
            dst[k] = np.uint32(np.uint32(src[k]) << np.uint32(16)).view(np.float32)
    else:
        for k in range(dst.shape[0]):
            dst[k] = f16_value(src[k])


def _project_widened(a, bf16, wpack, c, spill, block):
    M, K = a.shape
    C = c.shape[1]
    full = C // PANEL
    panels = -(-C // PANEL)
    chunks = (M + CHUNK - 1) // CHUNK
    workers = block.shape[0]
    # One work item per chunk of rows and all its panels (split, each would widen again)
    for w in prange(workers):
        rows_f32 = block[w]
        for chunk in range(w, chunks, workers):
            r0 = chunk * CHUNK
            rows = min(CHUNK, M - r0)
            for i in range(rows):
                _widen_row(a[r0 + i], bf16, rows_f32[i])
            a_rows = rows_f32.ctypes.data
            c_rows = c.ctypes.data + r0 * C * 4
            p = 0
            while p + QUAD <= full:
                panel_gemm(a_rows, K, rows, wpack[p].ctypes.data, K * PANEL, QUAD,
                           c_rows + p * PANEL * 4, C, K, zero_like(rows_f32))
                p += QUAD
            for p in range(p, panels):  # noqa: B020  (p goes on from the loop above)
                if p < full:
                    panel_gemm(a_rows, K, rows, wpack[p].ctypes.data, 0, 1,
                               c_rows + p * PANEL * 4, C, K, zero_like(rows_f32))
                else:
                    panel_gemm(a_rows, K, rows, wpack[p].ctypes.data, 0, 1,
                               spill[chunk].ctypes.data, PANEL, K, zero_like(rows_f32))
                    for i in range(rows):
                        for u in range(C - full * PANEL):
                            c[r0 + i, full * PANEL + u] = spill[chunk, i, u]


_project_widened, _project_widened_serial = parallel_and_serial(_project_widened)


def project_widened(a, bf16, wpack, c, spill, block):
    """c = widened(a) @ W^T, A widened a chunk at a time (module docstring)."""
    M, K = a.shape
    if a.dtype != np.uint16 or block.shape[1:] != (CHUNK, K) or c.dtype != np.float32 or \
            wpack.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError(f"project_widened: a {a.dtype} {a.shape} (C-contiguous uint16), "
                         f"block {block.shape} (workers, {CHUNK}, {K}), wpack {wpack.dtype} "
                         f"and c {c.dtype} (float32) do not fit")
    with LAUNCH_LOCK:
        small = M * K * c.shape[1] <= _gemm.SERIAL_WORK
        pick(_project_widened, _project_widened_serial, small)(
            a, bool(bf16), wpack, c, spill, block[:1] if small else block)
    return c
