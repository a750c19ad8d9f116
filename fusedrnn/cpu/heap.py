"""glibc's mmap threshold rises only when a mapped block is freed, and the op frees none:
beside it a torch program's tensors of a few MiB were mapped and faulted in at every step.
Measured: bench/results/cpu-kernel-notes.md#torch-programs-the-neighbours-page-faults"""
from __future__ import annotations

import ctypes
import functools

__all__ = ["BLOCK", "glibc", "raise_mmap_threshold"]

# Just under glibc's DEFAULT_MMAP_THRESHOLD_MAX (4 MiB per byte of a long), the most its
# dynamic threshold takes; the trim threshold follows at twice it. At half that, an
# encoder's neighbour still had its heap top trimmed every step.
# Measured: bench/results/cpu-kernel-notes.md#torch-programs-the-neighbours-page-faults
BLOCK = (4 << 20) * ctypes.sizeof(ctypes.c_long) - (64 << 10)


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
