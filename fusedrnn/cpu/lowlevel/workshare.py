"""The blocks of each time step shared among one parallel region's workers.

One parallel region per call of the fused loops, not one per step (a launch costs tens
of microseconds even when empty): each worker walks every step, takes blocks of it, and
waits at the step's end until all its blocks are done.
Measured: bench/results/cpu-kernel-notes.md#workshare-one-region-per-call

Numba marks a region's arrays noalias; the atomics below are ordering points LLVM may
not move accesses across, so every worker reloads h_{t-1} after the barrier. The spin
never yields the core: waits are one block's work.

Blocks are claimed, never assigned: worker w takes its own [w*B/W, (w+1)*B/W) first
(its share of W_h stays in its L2), then whatever is left, so a worker run late or
stopped cannot hang the barrier: it only waits for blocks a running worker holds.

counters (T, stride) int64, zero on entry, rows on 64-byte lines (new_counters): row
    `step` holds each share's claim count (columns 0..W-1) and, alone on the last line
    (spinners do not slow the claims), the step's finished-block count (column stride-8).

claim(counters, step, worker, workers, blocks) -> b, or -1 when the step has none left
finish(counters, step, done, blocks)
    add this worker's `done` blocks to the step's count, then wait until it is `blocks`
    (a seq-cst add, acquire loads: stores before finish are visible to all after theirs)
"""
from __future__ import annotations

import platform
import threading

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["claim", "finish", "new_counters"]

LINE = 8   # int64 counters per 64-byte cache line

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def new_counters(steps, workers):
    """Zeroed (steps, stride) int64 counters for one launch, rows on 64-byte lines; small
    ones a view of this thread's buffer, held by the launch that follows until it returns."""
    stride = LINE * (-(-workers // LINE) + 1)
    size = steps * stride
    if size > SPARE:
        return _aligned(size).reshape(steps, stride)
    flat = getattr(_spare, "flat", None)
    if flat is None:
        flat = _spare.flat = _aligned(SPARE)
    counters = flat[:size].reshape(steps, stride)
    counters.fill(0)
    return counters


def _aligned(size):
    """Zeroed int64s starting on a 64-byte line."""
    raw = np.zeros(size + LINE, np.int64)
    skip = (-raw.ctypes.data % (LINE * 8)) // 8
    return raw[skip:skip + size]


SPARE = 4096   # int64s in each thread's buffer: the counters of T=256 at 16 workers
_spare = threading.local()


@intrinsic
def _fetch_add(typingctx, address, value):
    """*address += value atomically (int64, sequentially consistent); returns the old."""
    if not (isinstance(address, types.Integer) and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(context.cast(builder, args[0], signature.args[0], types.intp),
                               ir.IntType(64).as_pointer())
        amount = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.atomic_rmw("add", ptr, amount, "seq_cst")

    return types.int64(address, value), codegen


@intrinsic
def _load_acquire(typingctx, address):
    """*address (int64), an atomic load with acquire ordering."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(context.cast(builder, args[0], signature.args[0], types.intp),
                               ir.IntType(64).as_pointer())
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(address), codegen


@intrinsic
def _spin_pause(typingctx):
    """A spin-wait hint (x86 `pause`: the sibling hyperthread runs, power drops)."""

    def codegen(context, builder, signature, args):
        if _X86:
            pause = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(pause, [])
        return context.get_dummy_value()

    return types.void(), codegen


@nb.njit(inline="always")
def claim(counters, step, worker, workers, blocks):
    row = counters.ctypes.data + step * counters.shape[1] * 8
    for i in range(workers):
        share = (worker + i) % workers
        first, end = share * blocks // workers, (share + 1) * blocks // workers
        if first < end:
            k = _fetch_add(row + share * 8, 1)
            if first + k < end:
                return first + k
    return -1


@nb.njit(inline="always")
def finish(counters, step, done, blocks):
    count = counters.ctypes.data + (step * counters.shape[1] + counters.shape[1] - LINE) * 8
    _fetch_add(count, done)
    while _load_acquire(count) < blocks:
        _spin_pause()
