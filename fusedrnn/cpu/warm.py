"""When the CPU's fused kernels are ready. Until then an op runs on the first tier
(firsttier.py) while a background process (../precompile.py) compiles its kernel set: its
mode, dtype and form (the loop, T=1, or a projected LSTM's step path). A set is ready when
its marker exists beside Numba's cache, stamped with what the cache's freshness depends on.
FUSEDRNN_FIRST_TIER=0 turns the first tier off: ops compile on first use, in process.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

try:
    import fcntl
except ImportError:   # (no POSIX locks: no cross-process coordination)
    fcntl = None

ENV = "FUSEDRNN_FIRST_TIER"
FORMS = ("loop", "single", "projected")


@dataclass(frozen=True)
class KernelSet:
    """A kernel set, with the op's layer sizes for its replay (array layouts follow them)."""
    mode: str
    dtype: str
    form: str
    input_size: int
    state_size: int
    num_layers: int = 1
    bidirectional: bool = False
    projection_size: int | None = None

    @property
    def name(self):
        return f"{self.mode}-{self.dtype}-{self.form}"

    @classmethod
    def of(cls, config, seq_len, dtype):
        form = "projected" if config.projection_size else "single" if seq_len == 1 else "loop"
        return cls(config.mode, np.dtype(dtype).name, form, config.input_size,
                   config.state_size, config.num_layers, config.directions == 2,
                   config.projection_size)


def enabled(environ=os.environ):
    """Not FUSEDRNN_FIRST_TIER=0, nor a frozen program (no `-m fusedrnn.precompile`)."""
    return environ.get(ENV, "1") != "0" and not getattr(sys, "frozen", False)


def stamp():
    """A digest of what a cached kernel's freshness depends on (Numba's stamps included)."""
    import llvmlite
    import numba
    from llvmlite import binding

    from . import jitcache
    stats = tuple((os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in jitcache.DEPENDENCIES)
    parts = (jitcache.dependency_digest(), stats, jitcache._tile_settings(), numba.__version__,
             llvmlite.__version__, sys.implementation.cache_tag, binding.get_host_cpu_name(),
             binding.get_host_cpu_features())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


def marker_dir():
    """Where the markers live: beside the fused kernels' own disk cache."""
    from . import fused, jitcache
    for locator in jitcache.LOCATORS:
        found = locator.from_function(fused.fused_layer, fused.__file__)
        if found is not None:
            return os.path.join(found.get_cache_path(), "fusedrnn-ready")
    raise RuntimeError("fusedrnn: no writable cache directory for Numba's kernels")


def compiling_elsewhere(marker):
    """Whether some process holds the set's lock (its compile is under way)."""
    if fcntl is None or not os.path.exists(marker + ".lock"):
        return False
    with open(marker + ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
    return False


# A compile that has not finished by then (a starved or stuck process) leaves its ops to
# compile in their own process.
GIVE_UP_S = 600.0


class Readiness:
    """Which sets may run fused; starts the others' compile, one per set across processes."""

    def __init__(self):
        self._fused = set()          # (config, T == 1, dtype) known fused: a call's one lookup
        self._ready = set()          # kernel-set names known to be in the cache
        self._waiting = {}           # name -> (our Popen or None, when we began waiting)
        self._lock = threading.Lock()
        self._stamp = self._dir = None

    def stop(self):
        """Ends this process's compiles (a benchmark's or a test's, which leave none behind)."""
        for child, _ in self._waiting.values():
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()

    def forget_children(self):
        """In a forked child: the parent's processes and lock are not this process's."""
        self._waiting, self._lock = {}, threading.Lock()

    def fused(self, config, seq_len, dtype, deterministic=False) -> bool:
        """Whether such an op runs fused now (ready); a deterministic program's always does."""
        key = (config, seq_len == 1, dtype)
        if key in self._fused:
            return True
        if enabled() and not deterministic and not self.ready(
                KernelSet.of(config, seq_len, dtype)):
            return False
        self._fused.add(key)
        return True

    def ready(self, kernels: KernelSet) -> bool:
        """Whether an op of `kernels` may run fused now; else its compile is under way."""
        name = kernels.name
        if name in self._ready:
            return True
        with self._lock:
            if name in self._ready:
                return True
            try:
                marker = self.marker(kernels)
                if os.path.exists(marker):
                    return self._done(name)
                child, since = self._waiting.get(name, (None, None))
                if since is None:
                    child = None if compiling_elsewhere(marker) else self._start(kernels)
                    self._waiting[name] = (child, time.monotonic())
                    return False
            except (OSError, RuntimeError):   # no cache or no process: compile here
                return self._done(name)
            ended = child.poll() is not None if child is not None else \
                not compiling_elsewhere(marker)
            if ended or time.monotonic() - since > GIVE_UP_S:   # without its marker
                return self._done(name)
            return False

    def _done(self, name):
        child, _ = self._waiting.pop(name, (None, None))
        if child is not None:
            child.poll()   # (reaped if it has ended)
        self._ready.add(name)
        return True

    def marker(self, kernels):
        if self._stamp is None:
            self._stamp, self._dir = stamp(), marker_dir()
        return os.path.join(self._dir, f"{kernels.name}-{self._stamp}")

    def _start(self, kernels):
        """`python -m fusedrnn.precompile SPEC`, which lowers its priority; a log beside."""
        os.makedirs(self._dir, exist_ok=True)
        log = open(os.path.join(self._dir, f"{kernels.name}.log"), "w")
        env = dict(os.environ, **{ENV: "0"})
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "fusedrnn.precompile", json.dumps(asdict(kernels))],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
        finally:
            log.close()


READY = Readiness()
os.register_at_fork(after_in_child=READY.forget_children)


def sets_for(modes, dtypes, input_size=16, state_size=16):
    """Every kernel set of these modes and dtypes (the projected form where a mode has it)."""
    from ..config import CELLS
    for mode in modes:
        for dtype in dtypes:
            for form in FORMS:
                if form == "projected" and not CELLS[mode].projection:
                    continue
                yield KernelSet(mode, dtype, form, input_size, state_size,
                                projection_size=state_size // 2 if form == "projected"
                                else None)


def numpy_dtype(name):
    """numpy's dtype of this name (bfloat16: ml_dtypes')."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)

