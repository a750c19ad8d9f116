"""fusedrnn.cpu.jitcache: every cached kernel of the package gets our locator, the digest
moves with any dependency's content, and, end to end in fresh processes on a copy of the
package, an edit to lowlevel/microkernel.py retires the cached machine code of a kernel defined
in another file (which Numba alone would keep loading)."""
import os
import shutil
import subprocess
import sys
import time

import numpy as np

import fusedrnn
from fusedrnn.cpu import cells, fused, jitcache
from fusedrnn.cpu.lowlevel import gemm, microkernel, packing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_locators_come_first_and_install_is_idempotent():
    from numba.core import caching
    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    jitcache.install()
    jitcache.install()
    assert impl._locator_classes[:len(jitcache.LOCATORS)] == list(jitcache.LOCATORS)
    assert sum(c in jitcache.LOCATORS for c in impl._locator_classes) == len(jitcache.LOCATORS)


def test_package_kernels_use_our_locator():
    layer = fused.fused_layer("lstm", np.float32)
    kernels = [gemm._project, packing._pack_rows_at, packing._pack_recurrent,
               packing._pack_recurrent_rows, gemm._project_serial, packing._pack_rows_at_serial,
               packing._pack_recurrent_serial, packing._pack_recurrent_rows_serial,
               layer._forward, layer._forward_single, layer._backward,
               layer._forward_single_serial, layer._backward_serial,
               *(launch.kernel for launch in cells.cell_kernels("gru", np.float32))]
    for kernel in kernels:
        locator = kernel._cache._impl._locator
        assert isinstance(locator, jitcache.LOCATORS), (kernel, type(locator))
        assert locator.get_source_stamp()[1] == jitcache.dependency_digest()


def test_stamp_moves_with_the_tile_settings(monkeypatch):
    """VECTOR_BITS and ROWS are read when a tile compiles: a process that overrides them
    must get other cache entries, not load (or overwrite) the defaults' machine code."""
    locator = gemm._project._cache._impl._locator
    before = locator.get_source_stamp()
    monkeypatch.setattr(microkernel, "VECTOR_BITS", 768 - microkernel.VECTOR_BITS)
    after_width = locator.get_source_stamp()
    monkeypatch.setattr(microkernel, "ROWS", {**microkernel.ROWS, np.dtype(np.float32): 5})
    after_rows = locator.get_source_stamp()
    assert len({before, after_width, after_rows}) == 3


def test_digest_moves_with_each_dependency(tmp_path):
    copies = []
    root = os.path.dirname(os.path.dirname(jitcache.__file__))   # fusedrnn/
    for path in jitcache.DEPENDENCIES:   # two __init__.py: keep the folders
        copy = tmp_path / os.path.relpath(path, root)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
        copies.append(str(copy))
    assert jitcache.dependency_digest(copies) == jitcache.dependency_digest()
    seen = {jitcache.dependency_digest(copies)}
    for copy in copies:
        with open(copy, "a") as f:
            f.write("\n# an edit\n")
        seen.add(jitcache.dependency_digest(copies))
    assert len(seen) == len(copies) + 1
    assert any(p.endswith(os.path.join("fusedrnn", "config.py"))
               for p in jitcache.DEPENDENCIES)
    assert any(p.endswith(os.path.join("cpu", "lowlevel", "microkernel.py"))
               for p in jitcache.DEPENDENCIES)
    assert jitcache.dependency_digest([str(tmp_path / "missing.py")]) is None


PROBE = """
import numpy as np
from fusedrnn.cpu.lowlevel import packing
w = np.arange(12.0).reshape(3, 4)
out = np.empty((1, 4, 16))
packing._pack_rows_at(w, 0, out)
assert (out[0, :, :3] == w.T).all()
stats = packing._pack_rows_at.stats
print(sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
"""


def test_an_edit_to_an_inlined_file_retires_the_cache(tmp_path):
    package = tmp_path / "fusedrnn"
    shutil.copytree(os.path.dirname(fusedrnn.__file__), package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    def hits_and_misses():
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return tuple(int(v) for v in out.stdout.split()[-2:])

    assert hits_and_misses() == (0, 1)       # compiled and stored
    assert hits_and_misses() == (1, 0)       # loaded
    with open(package / "cpu" / "lowlevel" / "microkernel.py", "a") as f:
        f.write("\n# an edit that Numba's own stamp of packing.py would not see\n")
    assert hits_and_misses() == (0, 1)       # retired, compiled again
    assert hits_and_misses() == (1, 0)


_SAVER = """
import sys
from numba.core import caching
import fusedrnn.cpu  # noqa: F401  (installs the locked save)
path, who = sys.argv[1], sys.argv[2]
cache = caching.IndexDataCacheFile(path, "kernel", "stamp")
for i in range(150):
    cache.save(f"{who}-{i}", f"{who}-{i}")
"""


def test_concurrent_saves_into_our_cache_keep_every_kernel_apart(tmp_path):
    """Two processes saving kernels of one function (two modes of a closure, say) into one
    index at once: each key still loads its own data. Numba's read-modify-write of the
    index would give both the same data file now and then; this package's saves lock."""
    from numba.core import caching

    from fusedrnn.cpu import jitcache
    path = tmp_path / jitcache._HERE.lstrip(os.sep) / "__pycache__"   # (counts as ours)
    path.mkdir(parents=True)
    savers = [subprocess.Popen([sys.executable, "-c", _SAVER, str(path), who],
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
              for who in ("a", "b")]
    assert [s.wait(timeout=120) for s in savers] == [0, 0]
    cache = caching.IndexDataCacheFile(str(path), "kernel", "stamp")
    wrong = [k for who in ("a", "b") for k in (f"{who}-{i}" for i in range(150))
             if cache.load(k) != k]
    assert not wrong, wrong[:5]


_COMPILER = """
import os, sys, time
import numpy as np
from fusedrnn.cpu.lowlevel import packing
ready, go = sys.argv[1], sys.argv[2]
open(ready, "w").close()        # imported
while not os.path.exists(go):   # both imported: released together
    time.sleep(0.005)
released = time.time()
w = np.arange(12.0).reshape(3, 4)
out = np.empty((1, 4, 16))
packing._pack_rows_at(w, 0, out)
assert (out[0, :, :3] == w.T).all()
print(sum(packing._pack_rows_at.stats.cache_misses.values()), released, time.time())
"""


def test_processes_that_need_a_kernel_at_once_compile_it_once(tmp_path):
    """Two processes call a kernel that no cache holds at the same moment (pytest's
    workers, DDP ranks): one compiles it, the other, released while that compile ran,
    waits and loads what it saved."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    go, ready = tmp_path / "go", [tmp_path / f"ready{i}" for i in range(2)]
    runs = [subprocess.Popen([sys.executable, "-c", _COMPILER, str(r), str(go)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in ready]
    try:
        deadline = time.monotonic() + 120
        while not all(r.exists() for r in ready) and time.monotonic() < deadline:
            time.sleep(0.01)
        go.touch()
        outs = [run.communicate(timeout=300) for run in runs]
    finally:
        for run in runs:
            run.kill()
    assert [run.returncode for run in runs] == [0, 0], [err for _, err in outs]
    (loader_misses, released, _), (compiler_misses, _, done) = sorted(
        tuple(float(v) for v in out.split()[-3:]) for out, _ in outs)
    assert (loader_misses, compiler_misses) == (0, 1)
    assert released < done   # the loader came while the compile ran: it waited


def _pack_rows_at_copy():
    """A copy of a package kernel: ours to the locator, compiled in no test before."""
    from numba import njit
    options = {k: v for k, v in packing._pack_rows_at.targetoptions.items() if k != "nopython"}
    kernel = njit(cache=True, **options)(packing._pack_rows_at.py_func)
    sig = (kernel.typeof_pyval(np.zeros((2, 2), np.float32)), kernel.typeof_pyval(0),
           kernel.typeof_pyval(np.zeros((1, 2, 16), np.float32)))
    return kernel, sig


def test_a_compile_waits_no_longer_than_its_bound_and_then_for_none(tmp_path, monkeypatch):
    """A compile whose lock another process holds past COMPILE_WAIT_S compiles anyway, and
    the process waits for no other compile after."""
    import fcntl

    from numba import njit
    monkeypatch.setattr(jitcache, "COMPILE_WAIT_S", 0.2)
    monkeypatch.setattr(jitcache, "_WAITED_OUT", [])
    kernel, sig = _pack_rows_at_copy()
    path = jitcache._compile_lock_path(kernel, sig)
    assert path is not None and jitcache._compile_lock_path(njit(lambda a: a), sig) is None
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl, time\nf = open({path!r}, 'a')"
                               "\nfcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)"
                               "\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        kernel.compile(sig)
        assert tuple(sig) in kernel.overloads and 0.2 <= time.monotonic() - start < 30
        with open(path, "a") as f:   # still the holder's
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("the lock was not held")
            except BlockingIOError:
                pass
        assert jitcache._WAITED_OUT == [path]
        again, sig = _pack_rows_at_copy()
        assert jitcache._compile_lock_path(again, sig) is None
    finally:
        holder.kill()
        holder.wait()


def test_a_file_system_without_locks_compiles_at_once(monkeypatch):
    """flock failing for another reason than a holder (NFS without lockd): no wait."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "no locks")
    monkeypatch.setattr(jitcache, "COMPILE_WAIT_S", 30.0)
    monkeypatch.setattr(jitcache, "_WAITED_OUT", [])
    monkeypatch.setattr(fcntl, "flock", no_locks)
    kernel, sig = _pack_rows_at_copy()
    assert jitcache._compile_lock_path(kernel, sig) is not None
    start = time.monotonic()
    kernel.compile(sig)
    assert tuple(sig) in kernel.overloads and time.monotonic() - start < 20
    assert jitcache._WAITED_OUT == []
