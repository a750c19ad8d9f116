"""A thread-local, bounded LRU cache of op instances.

Each thread has its own cache and builds its own ops. An op's scratch buffers serve one
call at a time (recurrence.RecurrentOp.lock: a training handle can carry the op into
another thread for the backward). Entries are keyed by everything that shapes a plan
(backend, device, config, T, N, dtype); an entry holds the compiled kernels, its scratch
buffers and its pool of recycled training reserves. A reserve handed to a training
forward is owned by that forward's handle until backward returns it, so eviction or a
later forward never touches it.

Limits (per thread): at most `max_entries` ops and `max_bytes` of their buffers; the
least recently used ops are dropped first, after every call (an op grows on a hit too:
its backward scratch, a recycled reserve). The op in use is never dropped, so one op
larger than max_bytes alone stays. Defaults: 32 entries, 1 GiB.
"""
from __future__ import annotations

import numbers
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

__all__ = ["CacheInfo", "cache_info", "clear_cache", "set_cache_limits", "thread_cache"]

_limits = {"max_entries": 32, "max_bytes": 1 << 30}


@dataclass(frozen=True)
class CacheInfo:
    hits: int
    misses: int
    evictions: int
    entries: int
    nbytes: int
    max_entries: int
    max_bytes: int
    # entries per backend, by name: "cpu", "cpu-first-tier" (the CPU's ops that run before
    # their kernels are compiled: fusedrnn/cpu/warm.py), "cuda"
    backends: dict = field(default_factory=dict)


class OpCache:
    def __init__(self):
        self._ops = OrderedDict()
        self.hits = self.misses = self.evictions = 0
        # The thread's last checked call (op.LastCall), whose op this cache holds: a call
        # with the same signature skips the checks and the lookup. Gone with its op.
        self.last = None

    def get(self, key, build, *args):
        """The op under `key`, or build(*args)'s, kept (the arguments, not a closure: a
        hit should cost no more than the lookup)."""
        op = self._ops.get(key)
        if op is not None:
            self.hits += 1
            self._ops.move_to_end(key)
            return op
        self.misses += 1
        op = build(*args)  # if this raises, nothing was inserted
        self._ops[key] = op
        self.trim(keep=key)
        return op

    def touch(self, key, op):
        """A call on `op` that did not look it up (a backward through its handle): a hit,
        and the most recently used, where this thread caches it under `key`."""
        if self._ops.get(key) is op:
            self.hits += 1
            self._ops.move_to_end(key)

    def nbytes(self):
        return sum(op.nbytes for op in self._ops.values())

    def trim(self, keep=None):
        """Evict least-recently-used ops until within limits (never `keep`)."""
        while len(self._ops) > 1 and (len(self._ops) > _limits["max_entries"]
                                      or self.nbytes() > _limits["max_bytes"]):
            oldest = next((k for k in self._ops if k != keep), None)
            if oldest is None:
                break
            del self._ops[oldest]
            self.evictions += 1
            if self.last is not None and self.last.key == oldest:
                self.last = None

    def clear(self):
        self._ops.clear()
        self.hits = self.misses = self.evictions = 0
        self.last = None

    def info(self):
        return CacheInfo(self.hits, self.misses, self.evictions, len(self._ops), self.nbytes(),
                         _limits["max_entries"], _limits["max_bytes"],
                         dict(Counter(key[0] for key in self._ops)))


_local = threading.local()


def thread_cache() -> OpCache:
    cache = getattr(_local, "cache", None)
    if cache is None:
        cache = _local.cache = OpCache()
    return cache


def cache_info() -> CacheInfo:
    """Hits, misses, evictions, entries and bytes of the calling thread's op cache."""
    return thread_cache().info()


def clear_cache() -> None:
    """Drop every cached op of the calling thread and zero its statistics (outstanding
    training handles keep their own reserves and stay valid)."""
    thread_cache().clear()


def set_cache_limits(max_entries: int | None = None, max_bytes: int | None = None) -> None:
    """Set the per-thread limits (all threads); the calling thread's cache is trimmed now,
    others at their next miss."""
    new = {}
    for name, value in (("max_entries", max_entries), ("max_bytes", max_bytes)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
        new[name] = int(value)
    _limits.update(new)  # both checked first: a bad call changes nothing
    thread_cache().trim()
