"""Numba's disk cache for our kernels, made to notice edits to every file they compile in.

Numba keys a cached kernel on the source of the one file that defines it and on its
bytecode, but our kernels inline code from other files (the micro-kernel's tiles,
units.py's cell math, mathfn.py, ../config.py's clip flags): after an edit there Numba
would load stale machine code, silently wrong until someone clears __pycache__.

So our cache locators come first in Numba's list for this package's kernels: the cache
where Numba's own would put it, its stamp extended by a digest of every file in
DEPENDENCIES and the micro-kernel's settings. A user's NUMBA_CACHE_LOCATOR_CLASSES stays.
Saves into this package's caches hold a file lock: Numba's read-modify-write of an index
could give two processes' kernels (two modes of one closure) the same data file.
"""
from __future__ import annotations

import functools
import hashlib
import os

from numba.core import caching

try:
    import fcntl
except ImportError:   # (no POSIX locks: saves as Numba makes them)
    fcntl = None

__all__ = ["DEPENDENCIES", "dependency_digest", "install"]

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


def _locked(save):
    @functools.wraps(save)
    def locked_save(self, key, data):
        if fcntl is None or _HERE.lstrip(os.sep) not in self._cache_path:
            return save(self, key, data)
        with open(self._index_path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return save(self, key, data)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    locked_save.fusedrnn_locked = True
    return locked_save


def install():
    """Put LOCATORS first in Numba's list, and lock this package's saves (once). Must run
    before any kernel of this package is decorated with cache=True: Numba picks a kernel's
    locator then."""
    classes = _numba_name("CacheImpl")._locator_classes
    if classes[:len(LOCATORS)] != list(LOCATORS):
        classes[:0] = LOCATORS
    save = caching.IndexDataCacheFile.save
    if not getattr(save, "fusedrnn_locked", False):
        caching.IndexDataCacheFile.save = _locked(save)
