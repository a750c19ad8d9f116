"""When the CPU's fused kernels are ready, and getting them ready without a stall.

Numba compiles the fused kernels on first call (seconds each) into its disk cache
(jitcache.py). So that a first call does not wait, an op whose kernels are not cached runs
on the first tier (firsttier.py: numpy) while a background process compiles them by
replaying calls of its kind; `python -m fusedrnn compile` does it ahead of time.

The unit is a kernel set: what one op can launch, given by its mode, its data's dtype and
its form (the fused loop, its T=1 form, or a projected LSTM's per-step path; sizes only
pick between two builds, and the replay compiles both). A set is ready when its marker
file exists beside the cache, stamped with what the cache's freshness depends on
(jitcache's digest, Numba's and llvmlite's versions, the CPU).

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

ENV = "FUSEDRNN_FIRST_TIER"
FORMS = ("loop", "single", "projected")


@dataclass(frozen=True)
class KernelSet:
    """What one op of this kind can launch (module docstring), and the shape of the calls
    that replay it (the op's own layer sizes: the kernels' array layouts follow them)."""
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
            except (OSError, RuntimeError):   # no cache to fill, or no process to fill it:
                self._ready.add(name)          # compile here, as without the first tier
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
        """`python -m fusedrnn.cpu.warm SPEC` for `kernels`, a process at a lower priority,
        its output in a log beside the markers."""
        os.makedirs(self._dir, exist_ok=True)
        log = open(os.path.join(self._dir, f"{kernels.name}.log"), "w")   # noqa: SIM115
        env = dict(os.environ, **{ENV: "0"})
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "fusedrnn.cpu.warm", json.dumps(asdict(kernels))],
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

# The serial/parallel bounds (fused.py, lowlevel): the replay sets them each way in turn.
_BOUNDS = (("fused", ("SERIAL_WORK", "SERIAL_LOOP_WORK", "SERIAL_LOOP_BYTES",
                      "SERIAL_POINTWISE")),
           ("lowlevel.gemm", ("SERIAL_WORK",)), ("lowlevel.packing", ("SERIAL_ELEMENTS",)))


_SHIPPED = {}


def _set_bounds(value):
    """Every bound to `value`; None: back to what the modules shipped with."""
    import importlib
    for module, names in _BOUNDS:
        module = importlib.import_module(f"fusedrnn.cpu.{module}")
        for name in names:
            _SHIPPED.setdefault((module.__name__, name), getattr(module, name))
            setattr(module, name, _SHIPPED[module.__name__, name] if value is None else value)


def replay(kernels: KernelSet, write_marker=True):
    """Compile every kernel an op of `kernels` can launch into the disk cache (inference,
    training, lengths and clipping, a few batch sizes, each build, its own layers and two
    bidirectional ones, whose buffer views other stacks share); then mark it ready."""
    from ..config import PRECISIONS
    from . import _own_product
    from .fused import own_gemm
    for layers, bidirectional in {(kernels.num_layers, kernels.bidirectional), (2, True)}:
        _replay_calls(kernels, layers, bidirectional)
    compute = PRECISIONS[kernels.dtype].compute
    if own_gemm(compute):   # the large products' own GEMM (CpuBackend.matmul)
        a, b = np.random.default_rng(1).standard_normal((2, 8, 8)).astype(compute)
        _own_product(a, b, np.empty((8, 8), compute))
    if write_marker:
        path = READY.marker(kernels)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(kernels), f)
        os.replace(path + ".tmp", path)


def _replay_calls(kernels, num_layers, bidirectional):
    import fusedrnn

    from ..config import CELLS
    from .fused import FUSED_INPUT_ROWS
    dtype = _numpy_dtype(kernels.dtype)
    rng = np.random.default_rng(0)
    kw = dict(mode=kernels.mode, state_size=kernels.state_size, num_layers=num_layers,
              bidirectional=bidirectional,
              projection_size=kernels.projection_size, state_outputs=True)
    n = fusedrnn.param_size(input_size=kernels.input_size, **{
        k: kw[k] for k in ("mode", "state_size", "num_layers", "bidirectional",
                           "projection_size")})
    params = rng.uniform(-0.3, 0.3, n).astype(dtype)
    T = 1 if kernels.form == "single" else 3
    clip = {"lstm_state_clip_min": -2.0, "lstm_state_clip_max": 2.0} \
        if CELLS[kernels.mode].state_clip else {}
    for bound in (-1, 1 << 62):   # every parallel build, then every serial one
        _set_bounds(bound)
        for N in (1, 2, FUSED_INPUT_ROWS):
            x = rng.standard_normal((T, N, kernels.input_size)).astype(dtype)
            lengths = np.maximum(1, T - np.arange(N) % T).astype(np.int64)
            for extra in ({}, dict(sequence_length=lengths, use_sequence_length=True, **clip)):
                fusedrnn.RNN(x, params, **kw, **extra)
                out, *_, handle = fusedrnn.RNN(x, params, **kw, **extra, train=True)
                fusedrnn.rnn_backward(handle, np.ones_like(out))
    _set_bounds(None)


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


def compile_ahead(sets, jobs, force=False, say=print):
    """Replay each kernel set in a process of its own, `jobs` at a time (marked sets are
    skipped unless `force`). Returns the names of those that failed."""
    pending = [k for k in sets if force or not os.path.exists(READY.marker(k))]
    for k in sets:
        if k not in pending:
            say(f"  {k.name}: ready")
    running, failed = {}, []
    env = dict(os.environ, **{ENV: "0"})
    while pending or running:
        while pending and len(running) < jobs:
            k = pending.pop(0)
            running[k] = subprocess.Popen(
                [sys.executable, "-m", "fusedrnn.cpu.warm", json.dumps(asdict(k))],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for k, child in list(running.items()):
            if child.poll() is None:
                continue
            del running[k]
            if child.returncode:
                failed.append(k.name)
                say(f"  {k.name}: FAILED\n{child.stdout.read()}")
            else:
                say(f"  {k.name}: compiled")
        time.sleep(0.05)
    return failed


def main(args):
    """`python -m fusedrnn compile`: the CPU kernels into Numba's disk cache, ahead."""
    from ..config import MODES, PRECISIONS
    modes = MODES if args.modes == "all" else tuple(args.modes.split(","))
    dtypes = tuple(args.dtypes.split(","))
    unknown = sorted(set(modes) - set(MODES)) + sorted(set(dtypes) - set(PRECISIONS))
    if unknown:
        print(f"compile: unknown modes or dtypes {unknown}; modes: {', '.join(MODES)}, "
              f"dtypes: {', '.join(PRECISIONS)}", file=sys.stderr)
        return 2
    sets = list(sets_for(modes, dtypes))
    print(f"fusedrnn compile: {len(sets)} kernel sets into {marker_dir()}, {args.jobs} at a "
          f"time")
    start = time.perf_counter()
    failed = compile_ahead(sets, args.jobs, args.force)
    print(f"done in {time.perf_counter() - start:.0f} s" +
          (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


if __name__ == "__main__":   # the background compile (Readiness._start)
    replay(KernelSet(**json.loads(sys.argv[1])))
