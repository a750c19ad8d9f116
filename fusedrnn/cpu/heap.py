"""glibc's mmap threshold rises only when a mapped block is freed, and the op frees none:
beside it a torch program's tensors of a few MiB were mapped and faulted in at every step.
Measured: bench/results/cpu-kernel-notes.md#torch-programs-the-neighbours-page-faults"""
from __future__ import annotations

import ctypes
import functools
import mmap

__all__ = ["BLOCK", "glibc", "raise_mmap_threshold"]

# Two pages under glibc's DEFAULT_MMAP_THRESHOLD_MAX, the most its dynamic threshold takes
# (the mapped chunk, header and page rounding included, must not pass it); trim follows it.
# Measured: bench/results/cpu-kernel-notes.md#torch-programs-the-neighbours-page-faults
BLOCK = ((32 << 20) if ctypes.sizeof(ctypes.c_long) == 8 else (512 << 10)) - 2 * mmap.PAGESIZE


@functools.cache
def glibc():
    """The process's C library where it is glibc, else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version   # noqa: B018  (AttributeError: not glibc)
    except (OSError, AttributeError, TypeError):
        return None
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    return libc


@functools.cache
def raise_mmap_threshold():
    """Once a process: malloc and free one BLOCK, as torch.nn's first step would (glibc)."""
    libc = glibc()
    block = libc.malloc(BLOCK) if libc is not None else None
    if not block:
        return False
    libc.free(block)
    return True
