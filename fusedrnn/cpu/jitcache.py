"""Numba's disk cache for our kernels, made to notice edits to every file they compile in.

Numba keys a cached kernel on the source of the one file that defines it and on its
bytecode, but our kernels inline code from other files (the micro-kernel's tiles,
units.py's cell math, mathfn.py, ../config.py's clip flags): after an edit there Numba
would load stale machine code, silently wrong until someone clears __pycache__.

So our cache locators come first in Numba's list for this package's kernels: the cache
where Numba's own would put it, its stamp extended by a digest of every file in
DEPENDENCIES and the micro-kernel's settings. A user's NUMBA_CACHE_LOCATOR_CLASSES stays.
Saves into this package's caches hold a file lock: Numba's read-modify-write of an index
could give two processes' kernels (two modes of one closure) the same data file. A compile
holds one per kernel and signature: processes that need a kernel at once (test workers,
DDP ranks, the first tier's background compile) build it once, the others load it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import time

from numba.core import caching, dispatcher, sigutils
from numba.core.compiler_lock import global_compiler_lock

try:
    import fcntl
except ImportError:   # (no POSIX locks: saves as Numba makes them)
    fcntl = None

__all__ = ["DEPENDENCIES", "dependency_digest", "install"]

# How long a compile waits for another process's compile of the same kernel before it
# compiles the kernel itself, and waits for none again (a stopped process must not stop
# its neighbours).
COMPILE_WAIT_S = 120.0

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# What a cached kernel may compile in: every .py under cpu/, recursively, and config.py
DEPENDENCIES = tuple(sorted(os.path.join(folder, name)
                            for folder, _, names in os.walk(_HERE) for name in names
                            if name.endswith(".py"))) + (os.path.join(_ROOT, "config.py"),)


def dependency_digest(paths=DEPENDENCIES):
    """sha256 over the names and contents of `paths`, recomputed when one's stat changes;
    None where a file cannot be read (a frozen application: its sources do not change)."""
    try:
        stats = tuple((path, st.st_mtime_ns, st.st_size)
                      for path, st in ((p, os.stat(p)) for p in paths))
        return _digest(stats)
    except OSError:
        return None


@functools.lru_cache(maxsize=8)
def _digest(stats):
    h = hashlib.sha256()
    for path, _, _ in stats:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _tile_settings():
    """The micro-kernel's settings compiled code depends on. Imported here, not at the
    top: install() must run before lowlevel's kernels are decorated."""
    from . import lowlevel
    return lowlevel.tile_settings()


def _ours(base):
    """`base` (a Numba locator) for this package's files, the dependency digest stamped."""

    class Locator(base):
        @classmethod
        def from_function(cls, py_func, py_file):
            if not os.path.abspath(py_file).startswith(_HERE + os.sep):   # lowlevel/ too
                return None
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return super().get_source_stamp(), dependency_digest(), _tile_settings()

    Locator.__name__ = Locator.__qualname__ = f"FusedRNN{base.__name__.lstrip('_')}"
    return Locator


def _numba_name(name):
    """Numba 0.61 made these names public; older releases have them with a leading _."""
    return getattr(caching, name, None) or getattr(caching, "_" + name)


LOCATORS = tuple(_ours(_numba_name(name)) for name in
                 ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator"))


def _flock(fd, blocking=True):
    """True once `fd` is locked; False where another process holds it (non-blocking) or the
    file system has no locks (NFS without lockd, some FUSE): then go on unlocked."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


def _locked(save):
    @functools.wraps(save)
    def locked_save(self, key, data):
        if fcntl is None or _HERE.lstrip(os.sep) not in self._cache_path:
            return save(self, key, data)
        with open(self._index_path + ".lock", "a") as lock:
            if not _flock(lock):
                return save(self, key, data)
            try:
                return save(self, key, data)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    locked_save.fusedrnn_locked = True
    return locked_save


_HELD = set()   # compile locks this process holds: a forked child closes its copies
_WAITED_OUT = []   # a wait that ran out: this process waits for no other compile


def _compile_lock_path(kernel, sig):
    """The lock file of `kernel`'s compile for `sig`: this package's cached kernels not yet
    compiled in this process, with a cache to load from; None for every other."""
    cache = getattr(kernel, "_cache", None)
    impl = getattr(cache, "_impl", None)
    if (fcntl is None or _WAITED_OUT or not getattr(cache, "_enabled", False)
            or not isinstance(getattr(impl, "locator", None), LOCATORS)):
        return None
    try:
        args, _ = sigutils.normalize_signature(sig)
        if tuple(args) in kernel.overloads:
            return None
        key = repr((impl.filename_base, cache._index_key(sig, kernel.targetctx.codegen())))
    except Exception:   # noqa: BLE001  (another Numba's internals: compile as Numba does)
        return None
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(cache._cache_path, f"compile-{digest}.lock")


def _once(compile):
    @functools.wraps(compile)
    def compile_once(self, sig):
        # Numba's lock first: within a process one thread compiles at a time anyway
        with global_compiler_lock:
            path = _compile_lock_path(self, sig)
            if path is None:
                return compile(self, sig)
            try:   # (read-only: flock needs no write access to a shared cache's files)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError:   # (an unwritable cache: Numba compiles in memory)
                return compile(self, sig)
            _HELD.add(fd)
            try:
                deadline = time.monotonic() + COMPILE_WAIT_S
                while _flock(fd, blocking=False) is False:   # (None: no locks here)
                    if time.monotonic() > deadline:
                        _WAITED_OUT.append(path)
                        break
                    time.sleep(0.05)
                return compile(self, sig)   # which loads what the other process saved
            finally:
                _HELD.discard(fd)
                os.close(fd)   # (releases the lock)
    compile_once.fusedrnn_once = True
    return compile_once


def _close_held():
    for fd in _HELD:
        os.close(fd)
    _HELD.clear()


def install():
    """Put LOCATORS first in Numba's list, lock this package's saves and compiles (once).
    Must run before any kernel of this package is decorated with cache=True: Numba picks a
    kernel's locator then."""
    classes = _numba_name("CacheImpl")._locator_classes
    if classes[:len(LOCATORS)] != list(LOCATORS):
        classes[:0] = LOCATORS
    save = caching.IndexDataCacheFile.save
    if not getattr(save, "fusedrnn_locked", False):
        caching.IndexDataCacheFile.save = _locked(save)
    compile = dispatcher.Dispatcher.compile
    if not getattr(compile, "fusedrnn_once", False):
        dispatcher.Dispatcher.compile = _once(compile)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_close_held)
