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
from dataclasses import asdict, dataclass

import numpy as np

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
    return environ.get(ENV, "1") != "0"


def stamp():
    """What a cached kernel's freshness depends on, as a short digest."""
    import llvmlite
    import numba
    from llvmlite import binding

    from . import jitcache
    parts = (jitcache.dependency_digest(), jitcache._tile_settings(), numba.__version__,
             llvmlite.__version__, binding.get_host_cpu_name(), binding.get_host_cpu_features())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


def marker_dir():
    """Where the markers live: beside the fused kernels' own disk cache."""
    from . import fused, jitcache
    for locator in jitcache.LOCATORS:
        found = locator.from_function(fused.fused_layer, fused.__file__)
        if found is not None:
            return os.path.join(found.get_cache_path(), "fusedrnn-ready")
    raise RuntimeError("fusedrnn: no writable cache directory for Numba's kernels")


class Readiness:
    """Which kernel sets may run fused, starting the others' compile; READY, thread-safe."""

    def __init__(self):
        self._fused = set()          # (config, T == 1, dtype) known fused: a call's one lookup
        self._ready = set()          # kernel-set names known to be in the cache
        self._compiling = {}         # name -> Popen of its background compile
        self._lock = threading.Lock()
        self._stamp = self._dir = None

    def fused(self, config, seq_len, dtype) -> bool:
        """Whether an op of (config, seq_len, dtype) runs fused now (ready, below)."""
        key = (config, seq_len == 1, dtype)
        if key in self._fused:
            return True
        if enabled() and not self.ready(KernelSet.of(config, seq_len, dtype)):
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
                if os.path.exists(self.marker(kernels)):
                    self._ready.add(name)
                    return True
                child = self._compiling.get(name)
                if child is None:
                    self._compiling[name] = self._start(kernels)
                    return False
            except (OSError, RuntimeError):   # no cache or no process: compile here
                self._ready.add(name)
                return True
            if child.poll() is not None:   # it ended without its marker: compile here
                self._ready.add(name)
                return True
            return False

    def marker(self, kernels):
        if self._stamp is None:
            self._stamp, self._dir = stamp(), marker_dir()
        return os.path.join(self._dir, f"{kernels.name}-{self._stamp}")

    def _start(self, kernels):
        """`python -m fusedrnn.precompile SPEC`, niced, its log beside the markers."""
        os.makedirs(self._dir, exist_ok=True)
        log = open(os.path.join(self._dir, f"{kernels.name}.log"), "w")
        env = dict(os.environ, **{ENV: "0"})
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "fusedrnn.precompile", json.dumps(asdict(kernels))],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_lower_priority)
        finally:
            log.close()


def _lower_priority():
    try:
        os.nice(5)
    except OSError:
        pass


READY = Readiness()


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

