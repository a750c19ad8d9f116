import os
import sys
import types
from pathlib import Path

# The suite checks the fused kernels: every op compiles them in the test's own process, as
# before the first tier (fusedrnn/cpu/warm.py). tests/cpu/test_warm.py turns it back on.
os.environ["FUSEDRNN_FIRST_TIER"] = "0"

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference.py

import fusedrnn  # noqa: E402
from fusedrnn.config import CELLS, MODES  # noqa: E402,F401  (the tests' modes: the table's)
from fusedrnn.cpu import CpuBackend  # noqa: E402

from reference import GATES  # noqa: E402

# MXNet's golden vectors live in the repository (tests/golden), so a clone with nothing
# beside it tests itself.
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
# The modes whose float64 golden vectors MXNet rounded to float32 (tests/test_golden.py):
# a fact about the recorded data, not about the cell.
MXNET_ROUNDS_TO_FLOAT32 = ("rnn_relu",)


def _poisoned_numpy():
    """numpy, except that every array from empty() starts as NaN."""
    def empty(shape, dtype=float, **kwargs):
        a = np.empty(shape, dtype=dtype, **kwargs)
        floating = a.dtype.kind == "f" or a.dtype.name == "bfloat16"   # (ml_dtypes': kind V)
        a.fill(np.nan if floating else np.iinfo(a.dtype).min)
        return a
    members = {k: getattr(np, k) for k in dir(np) if not k.startswith("__")}
    return types.SimpleNamespace(**dict(members, empty=empty))


POISONED_NUMPY = _poisoned_numpy()


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch):
    """Every buffer the CPU backend allocates (outputs, gradients, scratch, reserves)
    starts as NaN, so an element the op forgets to write shows up in the result."""
    fusedrnn.clear_cache()
    monkeypatch.setattr(CpuBackend, "xp", POISONED_NUMPY)
    yield
    fusedrnn.clear_cache()


def param_count(mode, I, H, L, D):
    G = GATES[mode]
    return D * G * H * (I + H + 2) + (L - 1) * D * G * H * (D * H + H + 2)


def make_case(mode, T=4, N=3, I=5, H=6, L=1, D=1, dtype=np.float64, seed=0, states=True):
    """Fresh seeded random inputs (never zeros) for one configuration, as a dict."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(H)
    case = dict(
        data=rng.standard_normal((T, N, I)).astype(dtype),
        parameters=rng.uniform(-scale, scale, param_count(mode, I, H, L, D)).astype(dtype),
        state=(0.5 * rng.standard_normal((L * D, N, H))).astype(dtype) if states else None,
        state_cell=((0.5 * rng.standard_normal((L * D, N, H))).astype(dtype)
                    if states and CELLS[mode].has_cell_state else None),
    )
    kwargs = dict(mode=mode, state_size=H, num_layers=L, bidirectional=D == 2)
    heads = dict(dout=rng.standard_normal((T, N, D * H)).astype(dtype),
                 dhy=rng.standard_normal((L * D, N, H)).astype(dtype),
                 dcy=(rng.standard_normal((L * D, N, H)).astype(dtype)
                      if CELLS[mode].has_cell_state else None))
    return case, kwargs, heads


def rel_err(actual, expected):
    """max |actual - expected| / max |expected| (NaN anywhere counts as infinite error)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-300)
    return np.inf if np.isnan(err) else err


def tolerance(dtype):
    return 1e-10 if np.dtype(dtype) == np.float64 else 1e-5


def launch_fused(mode, dtype, steps):
    """One small fused call that launches (and types) the fused kernels of `mode`: with
    steps > 1 a training call (forward and backward kernels), with steps == 1 an
    inference call (the T=1 form)."""
    rng = np.random.default_rng(0)
    N, I, H = 2, 4, 16
    params = rng.standard_normal(fusedrnn.param_size(mode=mode, input_size=I, state_size=H))
    x = rng.standard_normal((steps, N, I)).astype(dtype)
    kw = dict(state_size=H, num_layers=1, mode=mode)
    if steps == 1:
        fusedrnn.RNN(x, (params * 0.1).astype(dtype), **kw)
        return
    out, handle = fusedrnn.RNN(x, (params * 0.1).astype(dtype), **kw, train=True)
    fusedrnn.rnn_backward(handle, np.ones_like(out))


# The tests that read a fresh compile run on one worker (the xdist_group below; .ci/run's
# --dist loadgroup), so that a kernel several of them read is compiled once there.
FRESH_COMPILE = pytest.mark.xdist_group("fresh-compile")
_FRESH = {}


def fresh_compile(dispatcher, signature, parallel=True):
    """What `dispatcher`'s function shows compiled afresh for `signature` with the
    package's kernel flags (threads.KERNEL_OPTIONS; `parallel` for the parallel build): the
    disk cache keeps no IR, asm or parfor diagnostics to inspect. Once per process for a
    (function, signature, build); the text is kept, not the compiled code."""
    key = (dispatcher.py_func, signature, parallel)
    if key not in _FRESH:
        import numba as nb

        from fusedrnn.cpu.threads import KERNEL_OPTIONS
        fresh = nb.njit(parallel=parallel, **dict(KERNEL_OPTIONS, cache=False))(
            dispatcher.py_func)
        fresh.compile(signature)
        compiled = fresh.overloads[signature]
        diagnostics = compiled.metadata.get("parfor_diagnostics")   # (a serial build's: empty)
        body = _prange_library(compiled.library, set())
        _FRESH[key] = types.SimpleNamespace(
            llvm=fresh.inspect_llvm(signature), asm=fresh.inspect_asm(signature),
            # the source lines Numba made parallel loops of
            parallel_lines={p.loc.line for p in getattr(diagnostics, "initial_parfors", ())},
            # the asm of the library Numba optimised the prange body in first, before it
            # was linked into the kernel's (None without a prange)
            prange_asm=body.get_asm_str() if body is not None else None)
    return _FRESH[key]


def _prange_library(library, seen):
    """The library Numba compiled a kernel's prange body into, among those it links."""
    if id(library) in seen:
        return None
    seen.add(id(library))
    if library.name.startswith("__numba_parfor_gufunc"):
        return library
    for linked in library._linking_libraries:
        found = _prange_library(linked, seen)
        if found is not None:
            return found
    return None


@pytest.fixture(params=["serial", "parallel"])
def lowlevel_builds(request, monkeypatch):
    """A low-level kernel test on both builds, whatever its size picks (the bounds the
    bfloat16 and float16 kernels read per call: gemm.SERIAL_WORK, packing.SERIAL_ELEMENTS)."""
    from fusedrnn.cpu.lowlevel import gemm, packing
    limit = 1 << 62 if request.param == "serial" else -1
    monkeypatch.setattr(gemm, "SERIAL_WORK", limit)
    monkeypatch.setattr(packing, "SERIAL_ELEMENTS", limit)
    return request.param


# ---- the two tiers --------------------------------------------------------------------
# The quick tier (the README's command: pyproject's addopts deselect `exhaustive`) keeps,
# of every test with more than QUICK_CASES parametrized cases, the cases in collection
# order that each bring a parameter value not seen before: every mode, dtype, layer count,
# direction, build and feature still runs at small sizes, once per test rather than in
# every combination. Its kernels are compiled once per (mode, dtype, build) and a fresh
# clone compiles every one it touches (seconds each), so the quick tier's cases keep to
# QUICK_KERNELS: every mode in float32 (and float16, which runs float32's kernels); on the
# parallel builds LSTM and GRU, no float64 (a parallel build is its serial twin with the
# workers' loop a prange: the quick tier checks the one-gate modes' paired blocks on the
# serial builds, and several workers claiming them in the exhaustive tier); one mode each
# for float64's single steps and cells, bfloat16 and the serial builds. The rest, and the tests in EXHAUSTIVE_ONLY, are marked exhaustive
# (.ci/run runs them after the quick tier).
QUICK_CASES = 4
QUICK_KERNELS = {"float64": ("lstm",), "bfloat16": ("gru",), "serial": ("gru",),
                 "parallel": ("lstm", "gru")}
# A test about bfloat16 named so (its dtype no parameter) counts as a bfloat16 case.
BF16_NAMES = ("bf16", "bfloat16")
# The GPU kernels' compiles in the quick tier: Hopper's (the exhaustive tier, sm_80 too).
QUICK_ARCHS = ("sm_90",)
# Whole tests that cost minutes and check no behaviour the quick tier misses: Numba's IR
# and machine code of fresh compiles (vector code, no spills, parallel loops), the
# benchmark CLI's end-to-end runs, and stress runs.
EXHAUSTIVE_ONLY = {
    "tests/cpu/lowlevel/test_microkernel.py::test_tile_loop_reloads_nothing_from_the_stack",
    "tests/cpu/test_parallel_regions.py::test_every_prange_is_a_parallel_loop",
    "tests/cpu/test_parallel_regions.py::test_every_half_precision_prange_is_a_parallel_loop",
    "tests/cpu/test_vectorised_cells.py::test_cell_loop_is_vectorised",
    "tests/cpu/test_fused.py::test_the_cached_prange_body_spills_no_more_than_the_first",
    "tests/cpu/lowlevel/test_workshare.py::test_more_workers_than_threads_neither_hangs_"
    "nor_changes_results",
    "tests/benchmark/test_cli.py::test_header_names_the_machine_and_its_ceilings",
    "tests/benchmark/test_cli.py::test_grid_headline_and_cells",
    "tests/benchmark/test_cli.py::test_train_step_and_cases_tables",
    "tests/benchmark/test_cli.py::test_json_and_plots",
    "tests/benchmark/test_cli.py::test_bfloat16_grid_cells_against_torch_bfloat16",
    "tests/benchmark/test_cli.py::test_a_peers_figure_does_not_depend_on_which_peers_ran",
    "tests/test_memory.py::test_many_random_calls_keep_memory_bounded",
    # (a case by its id) the parallel builds of two features the serial builds check in the
    # quick tier, each a kernel no other quick case compiles (float64 parallel; the float32
    # GRU single step beside the bf16 one)
    "tests/cpu/test_fused.py::test_op_single_step_matches_generic_path_with_lstm_clipping"
    "[parallel-False]",
    "tests/cpu/test_fused.py::test_op_single_step_matches_generic_path_with_lstm_clipping"
    "[parallel-True]",
    "tests/cpu/test_fused.py::test_a_bf16_single_step_reads_the_weights_in_place"
    "[parallel-gru-1-1-17-33]",
    "tests/benchmark/test_cli.py::test_a_variant_runs_in_its_own_process",
    # read-only arrays at T=1: a specialisation of the float64 single step of its own (the
    # T > 1 and per-step cases stay quick)
    "tests/test_op.py::test_read_only_inputs_give_the_results_of_writable_ones[1-None]",
    # a team's regions in float64: the float32 case runs the same code, and this one
    # compiles float64's parallel builds, which the quick tier leaves out
    "tests/cpu/test_team.py::test_a_teams_regions_match_numbas_layer[float64]",
    # a float64 input to the float32 single step: a specialisation of its own
    "tests/cpu/test_fused.py::test_an_input_of_another_dtype_takes_the_columns",
    "tests/cpu/test_threads.py::test_concurrent_calls_match_serial[every]",
    # the kernels' timing instrumentation, compiled as the plain build is
    "tests/gpu/test_compile.py::test_nvcc_compiles_every_persistent_kernel[sm_90-phase-clocks]",
    "tests/gpu/test_compile.py::test_nvrtc_compiles_every_persistent_kernel_as_cupy_does"
    "[sm_90-phase-clocks]",
}


def _value_key(value):
    """A parameter value as something hashable (arrays and dicts by their repr)."""
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def _dtype_name(value):
    try:
        return np.dtype(value).name
    except TypeError:
        return str(value)


def _quick_kernels(name, params):
    """Whether a case's (mode, dtype, build) keeps to QUICK_KERNELS, and its GPU
    architecture to QUICK_ARCHS."""
    if params.get("arch", QUICK_ARCHS[0]) not in QUICK_ARCHS:
        return False
    mode = params.get("mode")
    dtype = next((_dtype_name(params[k]) for k in ("dtype", "half", "storage") if k in params),
                 "bfloat16" if any(word in name for word in BF16_NAMES) else None)
    builds = {v for v in params.values() if v in ("serial", "parallel")}
    if "parallel" in builds and dtype == "float64":
        return False
    for kind in (dtype, *builds):
        if kind in QUICK_KERNELS and mode not in (None, *QUICK_KERNELS[kind]):
            return False
    return True


@pytest.hookimpl(tryfirst=True)   # before the mark plugin deselects by marker
def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parents[1]
    groups = {}
    for item in items:
        name = f"{item.path.relative_to(root).as_posix()}::{item.originalname}"
        case = f"{name}[{item.callspec.id}]" if hasattr(item, "callspec") else name
        if name in EXHAUSTIVE_ONLY or case in EXHAUSTIVE_ONLY:
            item.add_marker(pytest.mark.exhaustive)
        elif hasattr(item, "callspec") and not item.get_closest_marker("exhaustive"):
            if _quick_kernels(item.originalname, item.callspec.params):
                groups.setdefault(name, []).append(item)
            else:
                item.add_marker(pytest.mark.exhaustive)
    for group in groups.values():
        if len(group) <= QUICK_CASES:
            continue
        seen = set()
        for item in group:
            values = {(k, _value_key(v)) for k, v in item.callspec.params.items()}
            if values <= seen:
                item.add_marker(pytest.mark.exhaustive)
            seen |= values
