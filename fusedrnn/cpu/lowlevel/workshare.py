"""The blocks of each time step shared among one parallel region's workers.

One parallel region per call of the fused loops, not one per step (an empty launch cost
more than a small step's work): each worker walks every step, takes blocks of it, and
waits at the step's end until all its blocks are done.
Measured: bench/results/cpu-kernel-notes.md#workshare-one-region-per-call

Numba marks a region's arrays noalias; the atomics below are ordering points LLVM may
not move accesses across, so every worker reloads h_{t-1} after the barrier.

Blocks are claimed, never assigned: worker w takes its own [w*B/W, (w+1)*B/W) first
(its share of W_h stays in its L2), then whatever is left, so a worker run late or
stopped cannot hang the barrier: it only waits for blocks a running worker holds.

Workers on one core run the loop as one, and a waiter holds the core the other needs;
the scheduler often wakes a region's workers onto one CPU. So a worker that finds its CPU
taken leaves it for the region (spread, settle), and a long wait yields (finish, POSIX).
Measured: bench/results/cpu-kernel-notes.md#workshare-workers-on-one-cpu

A team (team.Team) runs one region as serial builds on several threads: the caller
runs share 0 and posts the others to helpers that spin a while after each call, so a
launch wakes no sleeping thread. Helpers join once the caller is inside (it released the
GIL) and may join late: the caller takes whatever blocks are left.
Measured: bench/results/cpu-kernel-notes.md#threads-a-team-of-our-own

counters (T + 2, stride) int64 and then 2W cpu sets, zero but row T+1, rows on 64-byte lines
    (new_counters): row `step` < T holds each share's claim count (columns 0..W-1) and,
    alone on the last line (spinners do not slow the claims), the step's finished-block
    count (column stride-8). Row T: the CPUs the region's workers hold (a cpu set). Row
    T+1: the launching thread's pthread id (never moved: it is the caller's), whether
    it runs a share itself (the OpenMP layer's and a team's do; workqueue's waits), and
    a team's mailbox address (0: none) and helpers posted.
    Then worker w's affinity as it was and as spread narrowed it (MASK_WORDS int64s
    each, a cpu_set_t, at words 2*w*MASK_WORDS and (2*w+1)*MASK_WORDS past row T+2).

claim(counters, step, worker, workers, blocks) -> b, or -1 when the step has none left
finish(counters, step, done, blocks)
    add this worker's `done` blocks to the step's count, then wait until it is `blocks`
    (a seq-cst add, acquire loads: stores before finish are visible to all after theirs)
hold_launcher(counters, workers), spread(counters, worker, workers) -> what settle needs:
    the CPU taken in row T (+1; 0: none) and whether it moved (Linux; elsewhere neither
    looks)
settle(counters, worker, workers, held)
    at the region's end: the CPU given back, and a moved worker's affinity
team_arrive(counters, workers), team_leave(counters, workers)   share 0 of a team's region
    helpers may join now; at its end, posts no helper joined withdrawn, joined ones
    waited for (they touch the counters, reused by the next launch)
team_wait(box, k, spins) -> whether helper k joined a posted region (else spins ran out)
    box (W, LINE) int64: [0, 0] the caller arrived; [k, 0] helper k's IDLE/POSTED/JOINED
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

from ..threads import SLEEPING_WORKERS

__all__ = ["IDLE", "JOINED", "POSTED", "claim", "finish", "hold_launcher", "new_counters",
           "settle", "spread", "team_arrive", "team_leave", "team_wait"]

LINE = 8   # int64 counters per 64-byte cache line
MASK_WORDS = 16   # a cpu_set_t (1024 CPUs) in int64 words; a stride holds one (new_counters)
# Pauses a waiter spins before it also yields: not critical (from a tenth to ten times
# this alike), short of a scheduler's time slice
# Measured: bench/results/cpu-kernel-notes.md#workshare-workers-on-one-cpu
SPINS_BEFORE_YIELD = 1000
IDLE, POSTED, JOINED = 0, 1, 2   # a team helper's state (module docstring)

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_LINUX = platform.system() == "Linux"   # sched_getcpu and thread affinity


def new_counters(steps, workers, box=None, helpers=0):
    """Counters for one launch (module docstring), zero but row T+1, rows on 64-byte lines;
    small ones a view of this thread's buffer, held by the launch that follows it. With a
    team's mailbox `box`, `helpers` of whose lines are posted."""
    stride = LINE * (-(-workers // LINE) + 1)
    rows = steps + 2 + -(-2 * workers * MASK_WORDS // stride)
    size = rows * stride
    if size > SPARE:
        counters = _aligned(size).reshape(rows, stride)
    else:
        flat = getattr(_spare, "flat", None)
        if flat is None:
            flat = _spare.flat = _aligned(SPARE)
        counters = flat[:size].reshape(rows, stride)
        counters.fill(0)
    me = threading.get_ident()   # (pthread_self's value on POSIX), as an int64's bits
    counters[steps + 1, 0] = me - (1 << 64) if me >= 1 << 63 else me
    counters[steps + 1, 1] = box is not None or not SLEEPING_WORKERS   # launcher works
    if box is not None:
        counters[steps + 1, 2:4] = box.ctypes.data, helpers
    return counters


def _aligned(size):
    """Zeroed int64s starting on a 64-byte line."""
    raw = np.zeros(size + LINE, np.int64)
    skip = (-raw.ctypes.data % (LINE * 8)) // 8
    return raw[skip:skip + size]


SPARE = 4096   # int64 words in each thread's buffer: the counters of T=200 at 8 workers
_spare = threading.local()


def _atomic_intrinsic(operation):
    """f(address, value) -> int64: *address = *address `operation` value atomically (int64,
    sequentially consistent); returns the old value."""

    @intrinsic
    def fetch(typingctx, address, value):
        if not (isinstance(address, types.Integer) and isinstance(value, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(context.cast(builder, args[0], signature.args[0],
                                                types.intp), ir.IntType(64).as_pointer())
            amount = context.cast(builder, args[1], signature.args[1], types.int64)
            return builder.atomic_rmw(operation, ptr, amount, "seq_cst")

        return types.int64(address, value), codegen

    return fetch


_fetch_add = _atomic_intrinsic("add")
_fetch_or = _atomic_intrinsic("or")
_fetch_and = _atomic_intrinsic("and")


@intrinsic
def _compare_swap(typingctx, address, expected, new):
    """*address = new if it holds expected (int64, sequentially consistent); the old value."""
    if not all(isinstance(a, types.Integer) for a in (address, expected, new)):
        return None

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(context.cast(builder, args[0], signature.args[0], types.intp),
                               ir.IntType(64).as_pointer())
        old, new = (context.cast(builder, v, t, types.int64)
                    for v, t in zip(args[1:], signature.args[1:], strict=True))
        pair = builder.cmpxchg(ptr, old, new, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return types.int64(address, expected, new), codegen


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
    """sched_yield(): the core to a thread waiting for it (POSIX; elsewhere nothing)."""

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


@intrinsic
def _self_id(typingctx):
    """pthread_self() as an int64's bits (POSIX; 0 elsewhere)."""

    def codegen(context, builder, signature, args):
        if platform.system() == "Windows":
            return ir.Constant(ir.IntType(64), 0)
        word = context.get_value_type(types.uintp)
        ask = cgutils.get_or_insert_function(builder.module, ir.FunctionType(word, []),
                                             "pthread_self")
        return builder.zext(builder.call(ask, []), ir.IntType(64)) if word.width < 64 \
            else builder.call(ask, [])

    return types.int64(), codegen


def _affinity_intrinsic(name):
    """f(address of a cpu set) -> glibc's `name` for this thread: 0, or -1 (off Linux)."""

    @intrinsic
    def affinity(typingctx, address):
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            if not _LINUX:
                return ir.Constant(ir.IntType(64), -1)
            size = context.get_value_type(types.uintp)   # size_t
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                ir.IntType(32), [ir.IntType(32), size, ir.IntType(8).as_pointer()]), name)
            mask = builder.inttoptr(context.cast(builder, args[0], signature.args[0], types.intp),
                                    ir.IntType(8).as_pointer())
            done = builder.call(fn, [ir.Constant(ir.IntType(32), 0),
                                     ir.Constant(size, MASK_WORDS * 8), mask])
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
def _held_row(counters, workers):
    """Row T of the counters (the CPUs held; T+1 the launcher's)."""
    return counters.shape[0] - 2 - (-(-2 * workers * MASK_WORDS // counters.shape[1]))


@nb.njit(inline="always")
def spread(counters, worker, workers):
    """Take this worker's CPU in row T's set; where another holds it, narrow this thread's
    affinity by the set (it moves) but for the launching thread's. (CPU taken + 1, moved)."""
    cpu = _current_cpu()
    if workers < 2 or cpu < 0 or cpu >= MASK_WORDS * 64:
        return 0, False
    stride = counters.shape[1]
    row = _held_row(counters, workers)   # T
    if _self_id() == counters[row + 1, 0]:   # (its CPU held since hold_launcher, if it works)
        return 0, False
    held = counters.ctypes.data + row * stride * 8
    bit = np.int64(1) << np.int64(cpu % 64)
    if _fetch_or(held + (cpu // 64) * 8, bit) & bit == 0:
        return cpu + 1, False   # a CPU of its own
    masks = counters.ctypes.data + (row + 2) * stride * 8 + 2 * worker * MASK_WORDS * 8
    kept = (row + 2) * stride + 2 * worker * MASK_WORDS   # flat word indices of its sets
    flat = counters.reshape(-1)
    if _get_affinity(masks) != 0:
        return 0, False
    free = 0
    for i in range(MASK_WORDS):   # its own affinity less every CPU held
        flat[kept + MASK_WORDS + i] = flat[kept + i] & ~_load_acquire(held + i * 8)
        free |= flat[kept + MASK_WORDS + i]
    if free == 0 or _set_affinity(masks + MASK_WORDS * 8) != 0:
        return 0, False
    cpu = _current_cpu()
    bit = np.int64(1) << np.int64(cpu % 64)
    if 0 <= cpu < MASK_WORDS * 64 and _fetch_or(held + (cpu // 64) * 8, bit) & bit == 0:
        return cpu + 1, True
    _set_affinity(masks)   # taken meanwhile: pinned beside another worker is worse
    return 0, False


@nb.njit(inline="always")
def hold_launcher(counters, workers, me=0):
    """Where the launcher runs a share (row T+1), its CPU taken before the region: spread
    never moves the caller's thread. Returns what settle gives back (a helper: nothing)."""
    stride = counters.shape[1]
    row = _held_row(counters, workers)
    cpu = _current_cpu()
    if me != 0 or workers < 2 or counters[row + 1, 1] == 0 or cpu < 0 or \
            cpu >= MASK_WORDS * 64:
        return 0, False
    bit = np.int64(1) << np.int64(cpu % 64)
    if _fetch_or(counters.ctypes.data + (row * stride + cpu // 64) * 8, bit) & bit != 0:
        return 0, False
    return cpu + 1, False


@nb.njit(inline="always")
def settle(counters, worker, workers, held):
    """Give back spread's CPU and affinity (refused: every CPU, the kernel keeps its own)."""
    cpu, moved = held
    stride = counters.shape[1]
    row = _held_row(counters, workers)
    if cpu > 0:
        bit = np.int64(1) << np.int64((cpu - 1) % 64)
        _fetch_and(counters.ctypes.data + (row * stride + (cpu - 1) // 64) * 8, ~bit)
    if moved:
        masks = counters.ctypes.data + (row + 2) * stride * 8 + 2 * worker * MASK_WORDS * 8
        if _set_affinity(masks) != 0:
            flat = counters.reshape(-1)
            start = (row + 2) * stride + 2 * worker * MASK_WORDS
            for i in range(MASK_WORDS):
                flat[start + i] = -1
            _set_affinity(masks)


@nb.njit(inline="always")
def team_arrive(counters, workers):
    box = counters[_held_row(counters, workers) + 1, 2]
    if box != 0:
        _fetch_or(box, 1)


@nb.njit(inline="always")
def team_leave(counters, workers):
    row = _held_row(counters, workers) + 1
    box = counters[row, 2]
    if box == 0:
        return
    for k in range(1, counters[row, 3] + 1):   # no helper joins after this
        _compare_swap(box + k * LINE * 8, POSTED, IDLE)
    for k in range(1, counters[row, 3] + 1):
        spins = 0
        while _load_acquire(box + k * LINE * 8) == JOINED:
            spins = _wait(spins)


@nb.njit(nogil=True, cache=True)
def team_wait(box, k, spins):
    state, arrived = box.ctypes.data + k * box.shape[1] * 8, box.ctypes.data
    _compare_swap(state, JOINED, IDLE)   # back from a region: the caller may go on
    for _ in range(spins):
        if _load_acquire(state) == POSTED and _load_acquire(arrived) != 0:
            if _compare_swap(state, POSTED, JOINED) == POSTED:
                return True
        _spin_pause()
    return False
