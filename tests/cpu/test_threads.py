"""fusedrnn.cpu.threads: concurrent calls from many Python threads (no abort, results
identical to serial), the threading layer chosen (OpenMP in a torch program, workqueue
elsewhere), the parallel and serial builds of one kernel, and a forked child's calls."""
import itertools
import threading

import numpy as np
import pytest
import threadpoolctl
from numba import prange

import fusedrnn
from fusedrnn.config import TORCH_CALLER, RNNConfig
from fusedrnn.cpu import BACKEND, threads

from conftest import MODES, QUICK_KERNELS, make_case


def test_threading_layer_is_guarded_when_not_threadsafe():
    if threads.LAYER == "workqueue":
        assert isinstance(threads.LAUNCH_LOCK, type(threading.Lock()))


@pytest.mark.parametrize("kernels", ["quick", "every"])
def test_concurrent_calls_match_serial(monkeypatch, kernels):
    """8 threads x 200 calls of mixed modes and shapes, training forward + backward, the
    loops on their parallel builds (which calls this small would not take)."""
    from fusedrnn.cpu import fused
    monkeypatch.setattr(fused, "SERIAL_LOOP_WORK", -1)
    # (the quick tier's parallel kernels, conftest.py; "every" mode in the exhaustive tier)
    modes = QUICK_KERNELS["parallel"] if kernels == "quick" else MODES
    cases = [make_case(mode, T=2 + j % 4, N=1 + j % 3, L=1 + j % 3, D=1 + j % 2, seed=i,
                       dtype=np.float32)   # each mode at every N and L
             for i, (j, mode) in enumerate(itertools.product(range(4), modes))]

    def run(case, kw, heads):
        *outs, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
        return outs, fusedrnn.rnn_backward(handle, **heads)

    serial = [run(*c) for c in cases]
    results, errors = {}, []

    def worker(w):
        try:
            for rep in range(200):
                i = (w * 7 + rep) % len(cases)
                results[(w, rep)] = (i, run(*cases[i]))
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors
    assert len(results) == 1600
    for i, (outs, grads) in results.values():
        want_outs, want_grads = serial[i]
        assert all(np.array_equal(a, b) for a, b in zip(outs, want_outs))
        assert all((a is None and b is None) or np.array_equal(a, b)
                   for a, b in zip(grads, want_grads))


def test_warns_when_numba_threads_started_first_on_a_spinning_layer():
    """If Numba's pool was started (OpenMP) before fusedrnn chose, fusedrnn keeps the
    running layer, takes no lock (OpenMP is thread-safe) and says why calls are slow."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = ("import warnings, numba\n"
            "numba.config.THREADING_LAYER = 'omp'\n"
            "numba.get_num_threads(); numba.config.THREADING_LAYER = 'default'\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    from fusedrnn.cpu import threads\n"
            "assert threads.LAYER == 'omp', threads.LAYER\n"
            "assert any('started (OpenMP layer)' in str(x.message) for x in w), w\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop("NUMBA_THREADING_LAYER", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("torch_first", [True, False])
def test_the_layer_is_openmp_in_a_torch_program_and_workqueue_elsewhere(torch_first):
    """Unless the user chose: in a torch program (torch loaded first) Numba's OpenMP layer,
    whose threads do not lose the cores to torch's spinning ones (threads.py: the
    measurement), loaded with a short GOMP_SPINCOUNT that is not left in the
    environment; in a numpy program workqueue. Where this Numba has no OpenMP layer,
    workqueue in both."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    try:
        import numba.np.ufunc.omppool  # noqa: F401
        has_omp = True
    except ImportError:
        has_omp = False
    want = "omp" if torch_first and has_omp else "workqueue"
    code = ("import os, sys\n"
            + ("import torch\n" if torch_first else "")
            + "from fusedrnn.cpu import fused, threads\n"
            "import fusedrnn, numpy as np, numba\n"
            # (the loops' parallel build, which larger calls run, at these small sizes)
            "fused.SERIAL_LOOP_WORK = -1\n"
            "size = fusedrnn.param_size(mode='gru', input_size=4, state_size=8)\n"
            "fusedrnn.RNN(np.ones((3, 2, 4), np.float32), np.ones(size, np.float32), "
            "mode='gru', state_size=8, num_layers=1)\n"
            f"assert threads.LAYER == numba.threading_layer() == {want!r}, threads.LAYER\n"
            "assert 'GOMP_SPINCOUNT' not in os.environ\n"
            "assert ('torch' in sys.modules) == " + str(torch_first) + "\n"
            # on this layer too, calls from several Python threads equal serial ones
            "import threading\n"
            "x = np.random.default_rng(0).standard_normal((20, 3, 4)).astype(np.float32)\n"
            "p = np.random.default_rng(1).standard_normal(size).astype(np.float32) * 0.3\n"
            "want = fusedrnn.RNN(x, p, mode='gru', state_size=8, num_layers=1)\n"
            "got = []\n"
            "def work():\n"
            "    for _ in range(50):\n"
            "        got.append(fusedrnn.RNN(x, p, mode='gru', state_size=8, num_layers=1))\n"
            "pool = [threading.Thread(target=work) for _ in range(4)]\n"
            "[t.start() for t in pool]; [t.join() for t in pool]\n"
            "assert len(got) == 200 and all(np.array_equal(g, want) for g in got)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    for name in ("NUMBA_THREADING_LAYER", "GOMP_SPINCOUNT"):
        env.pop(name, None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def _doubled(x, out):
    for i in prange(x.shape[0]):
        out[i] = 2 * x[i]


def test_parallel_and_serial_builds_agree_and_are_cached_apart():
    """Numba's disk cache files a kernel under its function's name, not its flags: the
    serial twin must have its own name, or each build would evict (or be served) the
    other's machine code. The original function keeps its name."""
    parallel, serial = threads.parallel_and_serial(_doubled)
    x = np.arange(1000.0)
    outs = [np.full_like(x, np.nan), np.full_like(x, np.nan)]
    parallel(x, outs[0])
    serial(x, outs[1])
    assert np.array_equal(outs[0], 2 * x) and np.array_equal(outs[1], 2 * x)
    assert parallel.targetoptions.get("parallel") and not serial.targetoptions.get("parallel")
    assert _doubled.__qualname__ == "_doubled" and serial.py_func.__qualname__ == "_doubled_serial"
    names = {build._cache._impl._filename_base for build in (parallel, serial)}
    assert len(names) == 2


def test_every_kernel_build_takes_numpys_error_model():
    """Under Python's error model a serial build checks each division for zero, and those
    branches kept its cell loops scalar (4x slower than the parallel build's, whose region
    body Numba always compiles with numpy's model). Every entry point, parallel or serial,
    is compiled with threads.KERNEL_OPTIONS: the low-level kernels, the fused layers' six
    builds and the cell kernels."""
    from numba.core.registry import CPUDispatcher

    from fusedrnn.cpu import cells, fused
    from fusedrnn.cpu.lowlevel import bf16gemm, float16, gemm, packing
    builds = [build for module in (bf16gemm, float16, gemm, packing)
              for build in vars(module).values()
              if isinstance(build, CPUDispatcher) and build.targetoptions.get("inline") != "always"]
    assert len(builds) >= 20   # (every parallel_and_serial pair of the four modules)
    for mode in ("lstm", "gru"):
        layer = fused.FusedLayer(mode, np.float32)
        builds += [layer._forward, layer._forward_serial, layer._forward_single,
                   layer._forward_single_serial, layer._backward, layer._backward_serial]
        builds += [launch.kernel for launch in cells.cell_kernels(mode, np.float32)]
    assert threads.KERNEL_OPTIONS["error_model"] == "numpy"
    for build in builds:   # (cache=True is the dispatcher's, not a target option)
        options = {k: build.targetoptions.get(k) for k in ("error_model", "nogil")}
        assert options == {"error_model": "numpy", "nogil": True}, (
            build.py_func.__qualname__, options)


def _blas_threads():
    return [lib["num_threads"] for lib in threadpoolctl.threadpool_info()
            if lib["user_api"] == "blas"]


class _StandIn:
    """What config.TORCH_CALLER holds in a torch program (torch's operations), on numpy."""

    @staticmethod
    def matmul(a, b, out, transpose_a=False):
        return np.matmul(a.T if transpose_a else a, b, out=out)

    @staticmethod
    def transpose(a, out):
        np.copyto(out, a.T)
        return out

    @staticmethod
    def deterministic():
        return False


@pytest.fixture
def torch_caller():
    token = TORCH_CALLER.set(_StandIn())
    yield
    TORCH_CALLER.reset(token)


@pytest.fixture
def two_blas_threads():
    """numpy's BLAS at 2 threads for the test (what it finds on the 2-core machine), set
    as a user would with OpenBLAS's own call, and put back afterwards."""
    libs = threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers
    before = [lib.num_threads for lib in libs]
    for lib in libs:
        lib.set_num_threads(2)
    yield _blas_threads()
    for lib, threads_before in zip(libs, before):
        lib.set_num_threads(threads_before)


def test_blas_runs_on_one_thread_inside_and_as_before_after(two_blas_threads, torch_caller):
    assert two_blas_threads and set(two_blas_threads) == {2}
    with threads.BLAS_ONE_THREAD:
        assert set(_blas_threads()) == {1}
        with threads.BLAS_ONE_THREAD:          # nested: still one, still restored once
            assert set(_blas_threads()) == {1}
        assert set(_blas_threads()) == {1}
    assert _blas_threads() == two_blas_threads
    with pytest.raises(ZeroDivisionError):     # an error inside restores too
        with threads.BLAS_ONE_THREAD:
            1 / 0  # noqa: B018  (raises)
    assert _blas_threads() == two_blas_threads


def test_a_call_from_another_thread_leaves_the_blas_count_alone(two_blas_threads,
                                                                 torch_caller):
    """Only the main thread caps and restores (BlasOneThread says why): a worker thread's
    call, even one overlapping a main-thread call, changes nothing, and the main
    thread's restore still happens."""
    seen = []

    def call():
        with threads.BLAS_ONE_THREAD:
            seen.append(_blas_threads())

    worker = threading.Thread(target=call)
    worker.start()
    worker.join()
    assert seen == [two_blas_threads]
    with threads.BLAS_ONE_THREAD:
        worker = threading.Thread(target=call)
        worker.start()
        worker.join()
        assert set(_blas_threads()) == {1}
    assert _blas_threads() == two_blas_threads


@pytest.mark.parametrize("T, N, H", [(50, 32, 64), (300, 64, 800)])
def test_every_op_runs_its_numpy_blas_in_the_capping_scope(T, N, H):
    """Ops past BLAS_SERIAL_WORK, small and large: the scope caps a torch program's numpy
    BLAS at one thread (its large GEMMs run on torch's pool, CpuBackend.matmul)."""
    config = RNNConfig(mode="lstm", input_size=H, state_size=H, num_layers=2,
                       bidirectional=True)
    # a fused layer's: one thread in any program, a numpy program's GEMMs in parts
    assert BACKEND.blas_scope(config, T, N) is threads.BLAS_IN_PARTS
    projected = RNNConfig(mode="lstm", input_size=H, state_size=H, num_layers=2,
                          projection_size=H // 2)
    assert BACKEND.blas_scope(projected, T, N) is threads.BLAS_ONE_THREAD


def test_a_numpy_programs_call_leaves_blas_alone(two_blas_threads):
    """Outside a torch program the count is never touched (BlasOneThread says why)."""
    with threads.BLAS_ONE_THREAD:
        assert _blas_threads() == two_blas_threads


def test_an_op_on_its_own_gemms_caps_blas_in_a_numpy_program_too(two_blas_threads):
    """bfloat16 pairs (pair_products): numpy's BLAS keeps only small products there, and
    its spinning workers slowed the op's own GEMMs, so the cap holds in any program and
    is undone on the way out."""
    config = RNNConfig(mode="lstm", input_size=8, state_size=8, num_layers=1)
    scope = BACKEND.blas_scope(config, 5, 3, own_gemms=True)
    assert scope is threads.BLAS_ONE_THREAD_ALWAYS
    with scope:
        assert set(_blas_threads()) == {1}
    assert _blas_threads() == two_blas_threads
    import ml_dtypes

    from fusedrnn.recurrence import RecurrentOp
    op = RecurrentOp(BACKEND, config, 5, 3, np.dtype(ml_dtypes.bfloat16))
    assert (op.blas is threads.BLAS_ONE_THREAD_ALWAYS) == BACKEND.pair_products("bfloat16")
    float_op = RecurrentOp(BACKEND, config, 50, 30, np.dtype(np.float32))
    assert float_op.blas is threads.BLAS_IN_PARTS


@pytest.mark.parametrize("projection", [None, 4])
def test_an_op_whose_every_gemm_is_small_runs_without_a_scope(projection):
    """Up to BLAS_SERIAL_WORK multiply-adds in its largest GEMM (every one of the op's
    GEMMs is within T*N*D*G*H*max(inputs, H, R)) an op enters no BLAS scope; one more
    sample and it does."""
    from fusedrnn.cpu import BLAS_SERIAL_WORK
    config = RNNConfig(mode="lstm", input_size=8, state_size=16, num_layers=2,
                       bidirectional=True, projection_size=projection)
    # T=1, D=2, G*H=64; the widest: the second layer's input (2*16), or with the
    # projection H (its input is 2*4)
    per_sample = 2 * 64 * (16 if projection else 32)
    N = BLAS_SERIAL_WORK // per_sample
    assert N > 1 and not isinstance(BACKEND.blas_scope(config, 1, N), threads.BlasOneThread)
    big = BACKEND.blas_scope(config, 1, N + 1)
    assert big is (threads.BLAS_ONE_THREAD if projection else threads.BLAS_IN_PARTS)


@pytest.mark.parametrize("caller", ["numpy", "torch"])
def test_a_training_call_leaves_the_blas_threads_as_it_found_them(two_blas_threads, caller,
                                                                  monkeypatch):
    import fusedrnn.cpu as cpu
    monkeypatch.setattr(cpu, "BLAS_SERIAL_WORK", 0)   # (in the scope, whatever its size)
    fusedrnn.clear_cache()
    token = TORCH_CALLER.set(_StandIn() if caller == "torch" else None)
    try:
        case, kw, heads = make_case("gru", T=5, N=3, L=2, D=2, dtype=np.float32)
        out, handle = fusedrnn.RNN(**case, **kw, train=True)
        fusedrnn.rnn_backward(handle, heads["dout"])
    finally:
        TORCH_CALLER.reset(token)
    assert _blas_threads() == two_blas_threads



def test_blas_in_parts_caps_blas_and_counts_its_threads(two_blas_threads):
    """BLAS_IN_PARTS caps numpy's BLAS at one thread in a numpy program too, and meanwhile
    blas_parts() is the count it had, on the main thread only; all undone on the way out."""
    assert threads.blas_parts() == 1
    seen = []
    with threads.BLAS_IN_PARTS:
        assert set(_blas_threads()) == {1} and threads.blas_parts() == 2
        with threads.BLAS_ONE_THREAD_ALWAYS:   # nested: the outer entry counts
            assert threads.blas_parts() == 2
        assert threads.blas_parts() == 2          # ... and the inner exit keeps it
        worker = threading.Thread(target=lambda: seen.append(threads.blas_parts()))
        worker.start()
        worker.join()
    assert seen == [1] and threads.blas_parts() == 1
    assert _blas_threads() == two_blas_threads


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_gemm_in_parts_is_the_product(parts, transpose_a):
    rng = np.random.default_rng(parts)
    a = rng.standard_normal((37, 29)).astype(np.float32)   # rows not a multiple of parts
    b = rng.standard_normal((37 if transpose_a else 29, 11)).astype(np.float32)
    left = a.T if transpose_a else a                        # a^T: a strided view
    out = np.full((left.shape[0], 11), np.nan, np.float32)  # poisoned
    assert threads.gemm_in_parts(left, b, out, parts) is out
    want = left.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_blas_in_parts_counts_no_parts_in_a_torch_program(two_blas_threads, torch_caller):
    with threads.BLAS_IN_PARTS:   # (its GEMMs run on torch's pool)
        assert set(_blas_threads()) == {1} and threads.blas_parts() == 1


def test_more_parts_than_rows_and_float64():
    a, b = np.arange(6.0).reshape(3, 2), np.arange(8.0).reshape(2, 4)
    out = np.full((3, 4), np.nan)
    np.testing.assert_array_equal(threads.gemm_in_parts(a, b, out, 5), a @ b)


def test_a_failing_helper_part_raises_here():
    def fail():
        raise KeyError("a helper's part")
    done = []
    with pytest.raises(KeyError, match="a helper's part"):
        threads._helpers.run([lambda: done.append(0), fail])
    assert done == [0]
    threads._helpers.run([lambda: done.append(1), lambda: done.append(2)])   # still served
    assert sorted(done) == [0, 1, 2]


def test_a_part_that_fails_raises_here_and_the_helpers_go_on():
    a, b = np.ones((8, 3), np.float32), np.ones((4, 5), np.float32)   # inner sizes differ
    with pytest.raises(ValueError):
        threads.gemm_in_parts(a, b, np.empty((8, 5), np.float32), 2)
    out = threads.gemm_in_parts(a, np.ones((3, 5), np.float32), np.empty((8, 5), np.float32),
                                2)
    assert (out == 3).all()


def _parts_in_child(conn):
    out = threads.gemm_in_parts(np.ones((6, 2)), np.ones((2, 3)), np.empty((6, 3)), 2)
    conn.send(float(out.sum()))


def test_a_forked_child_starts_its_own_helpers():
    import multiprocessing
    threads.gemm_in_parts(np.ones((6, 2)), np.ones((2, 3)), np.empty((6, 3)), 2)
    context = multiprocessing.get_context("fork")
    mine, theirs = context.Pipe()
    child = context.Process(target=_parts_in_child, args=(theirs,), daemon=True)
    child.start()
    got = mine.recv() if mine.poll(60) else None   # (a child waiting on its parent's
    child.join(60)                                  # helpers would never answer)
    if child.is_alive():
        child.kill()
    assert got == 36.0 and child.exitcode == 0


def test_a_numpy_programs_training_gemms_run_in_parts(two_blas_threads, monkeypatch):
    """A fused layer's training call in a numpy program runs its GEMMs in parts (here from
    any size, its products apart) with BLAS on one thread, to the gradients in one piece."""
    import fusedrnn.cpu as cpu
    monkeypatch.setattr(cpu.CpuBackend, "sequence_products", staticmethod(lambda *a: False))
    case, kw, heads = make_case("gru", T=6, N=5, L=2, D=2, dtype=np.float32)

    def grads():
        out, handle = fusedrnn.RNN(**case, **kw, train=True)
        return fusedrnn.rnn_backward(handle, heads["dout"])

    whole = grads()
    calls = []
    monkeypatch.setattr(cpu, "PARTS_WORK", 1)
    monkeypatch.setattr(cpu, "BLAS_SERIAL_WORK", 0)   # (in the scope, whatever its size)
    original = threads.gemm_in_parts

    def spy(a, b, out, parts):
        calls.append((parts, set(_blas_threads())))
        return original(a, b, out, parts)

    monkeypatch.setattr(threads, "gemm_in_parts", spy)
    fusedrnn.clear_cache()
    in_parts = grads()
    assert calls and all(call == (2, {1}) for call in calls)
    for got, want in zip(in_parts, whole, strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert _blas_threads() == two_blas_threads


class _Refusing:
    """A parallel build that must not run (its signatures kept for serial twins)."""

    def __init__(self, build):
        self.signatures = getattr(build, "signatures", [])

    def __call__(self, *args):
        raise AssertionError("a parallel build was launched in a serial-only process")


def test_a_serial_only_process_launches_no_parallel_build(monkeypatch):
    """What threads.pick promises a forked child, in process: with every parallel build
    replaced by one that raises (the low-level kernels, the fused layers' and the cell
    kernels'), calls large enough for each path's parallel rule (float32, bfloat16 and
    float16, T > 1 and T = 1, forward and backward, the projected LSTM) run on serial
    builds and give the parallel builds' results (float32: the last bits may differ)."""
    import ml_dtypes
    from numba.core.registry import CPUDispatcher

    from fusedrnn import cache
    from fusedrnn.cpu import cells, fused
    from fusedrnn.cpu.lowlevel import bf16gemm, float16, gemm, packing
    # (modes whose parallel builds the quick tier compiles anyway: conftest's QUICK_KERNELS)
    calls = [("lstm", 20, 64, 256, None, np.float32), ("lstm", 1, 160, 512, None, np.float32),
             ("gru", 20, 16, 256, None, ml_dtypes.bfloat16),
             ("gru", 20, 64, 512, None, np.float16), ("lstm", 6, 8, 64, 32, np.float32)]

    def run():
        rng, results = np.random.default_rng(0), []
        for mode, T, N, H, P, dtype in calls:
            kw = dict(mode=mode, state_size=H, num_layers=1, projection_size=P)
            x = rng.standard_normal((T, N, H)).astype(dtype)
            p = (rng.standard_normal(fusedrnn.param_size(input_size=H, **kw)) * 0.1
                 ).astype(dtype)
            y, handle = fusedrnn.RNN(x, p, **kw, train=True)
            grads = fusedrnn.rnn_backward(handle, np.ones_like(y))
            results.append([np.asarray(a, np.float64) for a in (y, *grads) if a is not None])
        return results

    want = run()
    cache.clear_cache()
    monkeypatch.setattr(threads, "_forked_from_openmp", True)
    for module in (bf16gemm, float16, gemm, packing):
        for name, build in list(vars(module).items()):
            if isinstance(build, CPUDispatcher) and build.targetoptions.get("parallel"):
                monkeypatch.setattr(module, name, _Refusing(build))
    monkeypatch.setattr(fused, "_layers", {})
    init = fused.FusedLayer.__init__

    def refusing_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._forward = _Refusing(self._forward)
        self._forward_single = _Refusing(self._forward_single)
        self._backward = _Refusing(self._backward)
    monkeypatch.setattr(fused.FusedLayer, "__init__", refusing_init)
    monkeypatch.setattr(cells, "_compiled", {})
    guarded = cells._guarded
    monkeypatch.setattr(cells, "_guarded", lambda build, f: guarded(_Refusing(build), f))
    try:
        got = run()
    finally:
        cache.clear_cache()   # (no op built on the refusing layers outlives the test)
    for case_want, case_got in zip(want, got):
        for a, b in zip(case_want, case_got):
            assert np.abs(a - b).max() <= 2e-6 * np.abs(a).max(), np.abs(a - b).max()

def test_a_forked_child_runs_the_op_as_its_parent_did():
    """GNU OpenMP is not fork-safe: Numba's OpenMP layer kills a forked child of a process
    whose pool ran as soon as it opens a parallel region (and a Pool waiting on it hangs).
    So such a child launches serial builds only (threads.pick): here a torch program's
    fork Pool runs every path (the fused loops at T > 1 and T = 1, forward and backward,
    the per-step driver's cell kernels for the projected LSTM, bfloat16's pair kernels)
    and gets its parent's results (float32: the last bits may differ between the
    builds). The parent runs the parallel builds at these small sizes (its serial bounds
    set to -1), as larger calls would."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = '''
import multiprocessing as mp, numpy as np, torch, ml_dtypes, numba
import fusedrnn
from fusedrnn.cpu import fused, threads
from fusedrnn.cpu.lowlevel import gemm, packing
fused.SERIAL_WORK = fused.SERIAL_POINTWISE = fused.SERIAL_LOOP_WORK = -1
gemm.SERIAL_WORK = packing.SERIAL_ELEMENTS = -1

def run(_=None):
    rng, res = np.random.default_rng(0), []
    for mode, T, N, H, P, dt in [("lstm", 20, 8, 32, None, np.float32),
                                 ("lstm", 1, 4, 24, None, np.float32),
                                 ("lstm", 10, 3, 16, 8, np.float32),
                                 ("gru", 12, 8, 32, None, ml_dtypes.bfloat16)]:
        kw = dict(mode=mode, state_size=H, num_layers=1, projection_size=P)
        size = fusedrnn.param_size(input_size=H, **kw)
        x = rng.standard_normal((T, N, H)).astype(dt)
        p = (rng.standard_normal(size) * 0.2).astype(dt)
        y, handle = fusedrnn.RNN(x, p, **kw, train=True)
        grads = fusedrnn.rnn_backward(handle, np.ones_like(y))
        res.append([np.asarray(a, np.float64) for a in (y, *grads) if a is not None])
    return threads.serial_only(), res

if __name__ == "__main__":
    serial, want = run()
    layer = numba.threading_layer()
    with mp.get_context("fork").Pool(1) as pool:
        # (a child killed by OpenMP's fork guard leaves this waiting: the timeout says so)
        serial_child, got = pool.map_async(run, [0]).get(timeout=TIMEOUT)[0]
    assert not serial and serial_child == (layer == "omp"), (layer, serial_child)
    for case_want, case_got in zip(want, got):
        for a, b in zip(case_want, case_got):
            assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max(), np.abs(a - b).max()
    print("layer", layer)
'''
    try:
        import numba.np.ufunc.omppool  # noqa: F401
        has_omp = True
    except ImportError:
        has_omp = False
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop("NUMBA_THREADING_LAYER", None)
    # (the child compiles the serial builds it has not on disk yet: ~15 s)
    done = subprocess.run([sys.executable, "-c", code.replace("TIMEOUT", "300")], env=env,
                          timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"layer {'omp' if has_omp else 'workqueue'}" in done.stdout, done.stdout
