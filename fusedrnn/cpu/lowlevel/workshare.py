"""The blocks of each time step shared among one parallel region's workers.

One parallel region per call of the fused loops, not one per step (a launch costs tens
of microseconds even when empty): each worker walks every step, takes blocks of it, and
waits at the step's end until all its blocks are done.
Measured: bench/results/cpu-kernel-notes.md#workshare-one-region-per-call

Numba marks a region's arrays noalias; the atomics below are ordering points LLVM may
not move accesses across, so every worker reloads h_{t-1} after the barrier.

Blocks are claimed, never assigned: worker w takes its own [w*B/W, (w+1)*B/W) first
(its share of W_h stays in its L2), then whatever is left, so a worker run late or
stopped cannot hang the barrier: it only waits for blocks a running worker holds.

Workers on one core run the loop as one, and a waiter holds the core the other needs;
the scheduler often wakes a region's workers onto one CPU. So a worker leaves a CPU an
earlier one holds, for the region (spread, settle), and a long wait yields (finish).
Measured: bench/results/cpu-kernel-notes.md#workshare-workers-on-one-cpu

counters (T + 1 + 2W, stride) int64, zero on entry, rows on 64-byte lines (new_counters):
    row `step` < T holds each share's claim count (columns 0..W-1) and, alone on the last
    line (spinners do not slow the claims), the step's finished-block count (column
    stride-8). Row T: each worker's CPU + 1 once spread (columns 0..W-1), then spread's
    ticket lock (W: next ticket, W+1: now serving). Rows T+1+2w, T+2+2w: worker w's
    affinity as it was and as spread narrowed it (MASK_WORDS int64s each: a cpu_set_t).

claim(counters, step, worker, workers, blocks) -> b, or -1 when the step has none left
finish(counters, step, done, blocks)
    add this worker's `done` blocks to the step's count, then wait until it is `blocks`
    (a seq-cst add, acquire loads: stores before finish are visible to all after theirs)
spread(counters, worker, workers) -> whether this worker left its CPU (Linux; else never)
settle(counters, worker, workers, moved)
    at the region's end: a worker that left its CPU gets its affinity back
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

__all__ = ["claim", "finish", "new_counters", "settle", "spread"]

LINE = 8   # int64 counters per 64-byte cache line
MASK_WORDS = 16   # a cpu_set_t (1024 CPUs) as int64s; a stride holds one (new_counters)
# Pauses a waiter spins before it also yields: longer than most waits at a step's end
# (one block's work), far shorter than a scheduler's time slice.
SPINS_BEFORE_YIELD = 1000

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_LINUX = platform.system() == "Linux"   # sched_getcpu and thread affinity


def new_counters(steps, workers):
    """Zeroed (steps + 1 + 2 * workers, stride) int64 counters for one launch (module
    docstring), rows on 64-byte lines; small ones a view of this thread's buffer, held by
    the launch that follows until it returns."""
    stride = LINE * (-(-workers // LINE) + 1)
    rows = steps + 1 + 2 * workers
    size = rows * stride
    if size > SPARE:
        return _aligned(size).reshape(rows, stride)
    flat = getattr(_spare, "flat", None)
    if flat is None:
        flat = _spare.flat = _aligned(SPARE)
    counters = flat[:size].reshape(rows, stride)
    counters.fill(0)
    return counters


def _aligned(size):
    """Zeroed int64s starting on a 64-byte line."""
    raw = np.zeros(size + LINE, np.int64)
    skip = (-raw.ctypes.data % (LINE * 8)) // 8
    return raw[skip:skip + size]


SPARE = 4096   # int64s in each thread's buffer: the counters of T=200 at 8 workers
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


@intrinsic
def _yield_core(typingctx):
    """sched_yield(): the core to another thread that waits for it, if any (POSIX)."""

    def codegen(context, builder, signature, args):
        if platform.system() != "Windows":
            give = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
            builder.call(give, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _current_cpu(typingctx):
    """sched_getcpu(): the CPU this thread runs on; -1 where unknown (and off Linux)."""

    def codegen(context, builder, signature, args):
        if not _LINUX:
            return ir.Constant(ir.IntType(64), -1)
        ask = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), []), "sched_getcpu")
        return builder.sext(builder.call(ask, []), ir.IntType(64))

    return types.int64(), codegen


def _affinity_intrinsic(name):
    """f(address) -> int64: glibc's `name` (sched_get/setaffinity) for this thread and
    the MASK_WORDS-word cpu set at address; 0 on success, else (and off Linux) -1."""

    @intrinsic
    def affinity(typingctx, address):
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            if not _LINUX:
                return ir.Constant(ir.IntType(64), -1)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                ir.IntType(32), [ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()]),
                name)
            mask = builder.inttoptr(context.cast(builder, args[0], signature.args[0], types.intp),
                                    ir.IntType(8).as_pointer())
            done = builder.call(fn, [ir.Constant(ir.IntType(32), 0),
                                     ir.Constant(ir.IntType(64), MASK_WORDS * 8), mask])
            return builder.sext(done, ir.IntType(64))

        return types.int64(address), codegen

    return affinity


_get_affinity = _affinity_intrinsic("sched_getaffinity")
_set_affinity = _affinity_intrinsic("sched_setaffinity")


@nb.njit(inline="always")
def _wait(spins):
    """A spin-wait's turn: a pause, past SPINS_BEFORE_YIELD turns a yield too; spins + 1."""
    _spin_pause()
    if spins >= SPINS_BEFORE_YIELD:
        _yield_core()
    return spins + 1


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
    spins = 0
    while _load_acquire(count) < blocks:
        spins = _wait(spins)


@nb.njit(inline="always")
def spread(counters, worker, workers):
    """Where an earlier worker (in the lock's order) holds this one's CPU, narrow this
    thread's affinity by that CPU, which moves it. Returns whether it did (settle)."""
    if workers < 2 or _current_cpu() < 0:
        return False
    stride = counters.shape[1]
    row = counters.shape[0] - 1 - 2 * workers
    slots = counters.ctypes.data + row * stride * 8
    ticket = _fetch_add(slots + workers * 8, 1)   # the lock: one worker decides at a time
    spins = 0
    while _load_acquire(slots + (workers + 1) * 8) != ticket:
        spins = _wait(spins)
    cpu, moved = _current_cpu(), False
    for other in range(workers):
        if other != worker and _load_acquire(slots + other * 8) == cpu + 1:
            kept, narrowed = row + 1 + 2 * worker, row + 2 + 2 * worker
            word, bit = cpu // 64, cpu % 64
            if word < MASK_WORDS and _get_affinity(
                    counters.ctypes.data + kept * stride * 8) == 0:
                others = 0
                for i in range(MASK_WORDS):
                    counters[narrowed, i] = counters[kept, i]
                counters[narrowed, word] &= ~(np.int64(1) << np.int64(bit))
                for i in range(MASK_WORDS):
                    others |= counters[narrowed, i]
                if others != 0 and _set_affinity(
                        counters.ctypes.data + narrowed * stride * 8) == 0:
                    moved = True
                    cpu = _current_cpu()
            break
    _fetch_add(slots + worker * 8, cpu + 1)
    _fetch_add(slots + (workers + 1) * 8, 1)   # the next ticket's turn
    return moved


@nb.njit(inline="always")
def settle(counters, worker, workers, moved):
    """A worker spread moved gets its affinity back (and stays where it runs)."""
    if moved:
        row = counters.shape[0] - 1 - 2 * workers + 1 + 2 * worker
        _set_affinity(counters.ctypes.data + row * counters.shape[1] * 8)
