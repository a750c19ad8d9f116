"""The same call on CuPy arrays equals the CPU result (needs a CUDA device; skipped
cleanly without one). Run on a GPU machine: PYTHONPATH=. python3 -m pytest -m gpu"""
import json
import types

import numpy as np
import pytest

import fusedrnn

from conftest import CELLS, GOLDEN_DIR, MODES, MXNET_ROUNDS_TO_FLOAT32, make_case, rel_err

pytestmark = pytest.mark.gpu


def _cuda_available():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001  (no CuPy, no driver, no device: all mean "no GPU")
        return False


if not _cuda_available():
    pytest.skip("no CUDA device (or no CuPy)", allow_module_level=True)

import cupy  # noqa: E402

from fusedrnn import gpu  # noqa: E402


@pytest.fixture(autouse=True)
def per_step_path(monkeypatch):
    """Tests run the per-step path unless they choose the persistent kernels (the
    persistent_selected fixture, or `path`), so both paths stay covered."""
    from fusedrnn.gpu import persistent
    monkeypatch.setenv(persistent.ENV, "0")


@pytest.fixture(autouse=True)
def poison_gpu_buffers(monkeypatch):
    """Every buffer the GPU backend allocates starts as NaN."""
    def empty(shape, dtype=float, **kwargs):
        a = cupy.empty(shape, dtype=dtype, **kwargs)
        a.fill(np.nan if a.dtype.kind == "f" else np.iinfo(a.dtype).min)
        return a
    members = {k: getattr(cupy, k) for k in dir(cupy) if not k.startswith("__")}
    monkeypatch.setattr(gpu.backend(), "xp", types.SimpleNamespace(**dict(members, empty=empty)))
    fusedrnn.clear_cache()
    yield
    fusedrnn.clear_cache()


def _on_gpu(tree):
    return {k: None if v is None else cupy.asarray(v) for k, v in tree.items()}


def _run(case, kw, heads):
    *outs, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    return outs, fusedrnn.rnn_backward(handle, **heads)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_equals_cpu(mode, L, D, dtype):
    case, kw, heads = make_case(mode, T=7, N=5, I=6, H=9, L=L, D=D, dtype=dtype, seed=L * D)
    _assert_gpu_equals_cpu(case, kw, heads, dtype)


def _assert_gpu_equals_cpu(case, kw, heads, dtype):
    """The same call on the GPU and the CPU: outputs and every gradient agree."""
    cpu_outs, cpu_grads = _run(case, kw, heads)
    gpu_outs, gpu_grads = _run(_on_gpu(case), kw, _on_gpu(heads))
    assert all(isinstance(o, cupy.ndarray) for o in gpu_outs)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for a, b in zip(gpu_outs, cpu_outs):
        assert rel_err(cupy.asnumpy(a), b) <= tol
    for a, b in zip(gpu_grads, cpu_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel_err(cupy.asnumpy(a), b) <= tol


CASES = json.loads((GOLDEN_DIR / "manifest.json").read_text())["cases"]


@pytest.mark.parametrize("persistent", ["0", "1"], ids=["per-step", "persistent"])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_on_gpu(case, persistent, monkeypatch):
    from fusedrnn.gpu.persistent import ENV
    monkeypatch.setenv(ENV, persistent)
    arrays = np.load(GOLDEN_DIR / case["file"])
    kwargs = case["rnn_kwargs"]
    lstm = CELLS[kwargs["mode"]].has_cell_state
    inputs = [cupy.asarray(arrays[name]) for name in case["rnn_array_args"]]
    *outs, handle = fusedrnn.RNN(*inputs, **kwargs, train=True)
    grads = fusedrnn.rnn_backward(handle, cupy.asarray(arrays["dout"]), cupy.asarray(arrays["dhy"]),
                                  cupy.asarray(arrays["dcy"]) if lstm else None)
    tol = 1e-6 if kwargs["mode"] in MXNET_ROUNDS_TO_FLOAT32 else 1e-10  # tests/test_golden.py
    for name, got in zip(("out", "hy", "cy"), outs):
        assert rel_err(cupy.asnumpy(got), arrays[name]) <= tol
    for field in ("data", "parameters", "state", "state_cell"):
        if f"grad_{field}" in arrays.files:
            assert rel_err(cupy.asnumpy(getattr(grads, field)), arrays[f"grad_{field}"]) <= tol


def test_runs_on_the_current_stream():
    case, kw, _ = make_case("lstm", L=2, D=2)
    expected = fusedrnn.RNN(**case, **kw)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = fusedrnn.RNN(**_on_gpu(case), **kw)
        result = cupy.asnumpy(out, stream=stream)
    stream.synchronize()
    assert rel_err(result, expected) <= 1e-12


def test_mixed_devices_are_refused():
    case, kw, _ = make_case("gru")
    gpu_case = _on_gpu(case)
    with pytest.raises(TypeError, match="parameters: expected a cupy.ndarray like data"):
        fusedrnn.RNN(**dict(gpu_case, parameters=case["parameters"]), **kw)
    with pytest.raises(TypeError, match="data: expected"):
        fusedrnn.RNN(**dict(case, data=[1.0]), **kw)
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            other = cupy.asarray(case["state"])
        with pytest.raises(ValueError, match="state: expected an array on data's device"):
            fusedrnn.RNN(**dict(gpu_case, state=other), **kw)


def test_cache_keys_on_device():
    case, kw, _ = make_case("gru")
    fusedrnn.RNN(**case, **kw)
    fusedrnn.RNN(**_on_gpu(case), **kw)
    assert fusedrnn.cache_info().entries == 2


FEATURES = {
    "lengths": dict(use_sequence_length=True),
    "clip": dict(lstm_state_clip_min=-0.3, lstm_state_clip_max=0.25, lstm_state_clip_nan=True),
    "projection": dict(projection_size=3),
}


def _with_features(mode, names, D, dtype, seed=0):
    """make_case plus the named features (projection resizes parameters and states)."""
    case, kw, heads = make_case(mode, T=6, N=4, I=5, H=7, L=2, D=D, dtype=dtype, seed=seed)
    for name in names:
        kw.update(FEATURES[name])
    if "lengths" in names:
        case["sequence_length"] = np.array([6, 1, 4, 2], np.int32)
    if "projection" in names:
        P = FEATURES["projection"]["projection_size"]
        size = fusedrnn.param_size(mode=mode, input_size=5, state_size=7, num_layers=2,
                                   bidirectional=D == 2, projection_size=P)
        case["parameters"] = np.random.default_rng(seed).uniform(-0.4, 0.4, size).astype(dtype)
        case["state"] = case["state"][..., :P].copy()
        heads = dict(heads, dout=heads["dout"][..., :D * P].copy(), dhy=heads["dhy"][..., :P].copy())
    return case, kw, heads


# Clipping and projection exist for LSTM only (other modes refuse them, test_validate.py).
VALID = [(mode, ("lengths",)) for mode in MODES] + [
    ("lstm", names) for names in [("clip",), ("projection",), ("lengths", "clip", "projection")]]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("mode, names", VALID, ids=[f"{m}-{'+'.join(n)}" for m, n in VALID])
def test_features_gpu_equals_cpu(mode, names, D, dtype):
    _assert_gpu_equals_cpu(*_with_features(mode, names, D, dtype), dtype)


@pytest.mark.parametrize("mode, names", VALID, ids=[f"{m}-{'+'.join(n)}" for m, n in VALID])
def test_float16_features_within_the_half_bound(mode, names):
    """Lengths, clipping and projection in float16 as the GPU runs half data by default
    (the tensor-core products and the half GEMMs), two layers, both directions: every
    output and gradient within test_precision's bound of the float64 op on the same
    rounded inputs. (Dropout in half: the CPU's test_precision; on the GPU its masks come
    from CuPy's generator, test_dropout_on_gpu_is_reproducible_and_uses_its_masks.)"""
    _assert_float16_case_within_the_half_bound(*_with_features(mode, names, 2, np.float64,
                                                               seed=6))


@pytest.mark.parametrize("mode", MODES)
def test_dropout_on_gpu_is_reproducible_and_uses_its_masks(mode):
    case, kw, heads = make_case(mode, T=6, N=4, I=5, H=7, L=3, D=2, seed=3)
    gpu_case = _on_gpu(case)
    first = fusedrnn.RNN(**gpu_case, **kw, p=0.4, train=True, seed=11)
    second = fusedrnn.RNN(**gpu_case, **kw, p=0.4, train=True, seed=11)
    assert cupy.array_equal(first[0], second[0])
    masks = [cupy.asnumpy(m) for m in first[-1]._reserve.masks]
    assert len(masks) == 2
    kept = np.concatenate([m.ravel() for m in masks]) != 0
    assert 0.45 < kept.mean() < 0.75
    # The same computation on the CPU with those masks: forward and gradients agree.
    from reference import rnn_reference
    ref_out, _, _ = rnn_reference(**case, **kw, dropout_masks=masks)
    assert rel_err(cupy.asnumpy(first[0]), ref_out) <= 1e-12


@pytest.mark.parametrize("mode", MODES)
def test_float16_dropout_on_gpu_within_the_half_bound(mode):
    """Dropout in float16 as the GPU runs half data by default: the training forward's
    outputs within test_precision's bound of the float64 reference given the masks the
    op drew (CuPy's generator: the CPU cannot draw the same ones, so the gradients under
    dropout are the float32 test's and the CPU's test_precision's)."""
    from test_precision import (
        assert_within,
        clear_of_the_kink,
        kink_clearance,
        longest_product,
        rounded,
    )

    from reference import rnn_reference
    case, kw, _ = make_case(mode, T=6, N=4, I=5, H=24, L=2, D=2, seed=8)
    half, exact = rounded(clear_of_the_kink(case, kw), np.float16)
    outs = fusedrnn.RNN(**_on_gpu(half), **kw, p=0.4, train=True, seed=5, state_outputs=True)
    masks = [cupy.asnumpy(m).astype(np.float64) for m in outs[-1]._reserve.masks]
    assert len(masks) == 1 and 0.4 < (masks[0] != 0).mean() < 0.8
    # the masks scale layer 1's inputs: relu still clear of its kink (0.18 at the least
    # over 60 of the CPU's draws at this size; the products move it by ~4e-4)
    assert kink_clearance(exact, kw, dropout_masks=masks) >= 2.0 ** -4
    want = rnn_reference(**exact, **kw, dropout_masks=masks)
    for name, a, b in zip(("out", "hy", "cy"), outs[:-1], want):
        if b is not None:
            assert_within(cupy.asnumpy(a), b, np.float16, longest_product(kw, 5), name)


@pytest.mark.parametrize("path", ["0", "1"], ids=["per-step", "persistent"])
@pytest.mark.parametrize("mode", MODES)
def test_float16_gpu_equals_cpu(mode, path, monkeypatch):
    """CuPy float16 on the float32 products and GEMMs (FUSEDRNN_GPU_TENSOR_CORES=0,
    FUSEDRNN_GPU_HALF_GEMMS=0): the op's
    conversions around the float32 kernels, as on the CPU: one unit in float16's last
    place of the larger of the two, plus 2^-18 of the array's largest value. The float32
    sums inside differ by up to ~K 2^-24 of their terms (K <= T*N = 35 here): for a result
    that cancels to near 0, more than a unit of its own last place (with the relative
    bound alone this test failed for rnn_tanh's dparameters on an H200, 2026-11-26)."""
    from fusedrnn.gpu import halfgemm, persistent
    monkeypatch.setenv(persistent.ENV, path)
    monkeypatch.setenv(persistent.TENSOR_CORES_ENV, "0")
    monkeypatch.setenv(halfgemm.HALF_GEMMS_ENV, "0")
    case, kw, heads = make_case(mode, T=7, N=5, I=6, H=16, L=2, D=2, seed=5)
    case = {k: None if v is None else v.astype(np.float16) for k, v in case.items()}
    heads = {k: None if v is None else v.astype(np.float16) for k, v in heads.items()}
    cpu_outs, cpu_grads = _run(case, kw, heads)
    gpu_outs, gpu_grads = _run(_on_gpu(case), kw, _on_gpu(heads))
    for a, b in zip([*gpu_outs, *gpu_grads], [*cpu_outs, *cpu_grads]):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == np.float16
            a, b = cupy.asnumpy(a).astype(np.float64), b.astype(np.float64)
            excess = np.abs(a - b) - (2.0 ** -10 * np.maximum(np.abs(a), np.abs(b)) +
                                      2.0 ** -18 * np.abs(b).max())
            worst = np.unravel_index(np.argmax(excess), excess.shape)
            assert excess[worst] <= 0, (worst, a[worst], b[worst], np.abs(b).max())


@pytest.mark.parametrize("L,D", [(1, 1), (2, 2)])
@pytest.mark.parametrize("mode", MODES)
def test_float16_on_tensor_cores_within_the_half_bound(mode, L, D, monkeypatch):
    """CuPy float16 through the persistent kernels' tensor-core products (tensorcore.cuh):
    every output and gradient within test_precision's bound of the float64 op on the same
    rounded inputs; the layers did take the tensor-core plan."""
    from fusedrnn.gpu import halfgemm, persistent
    monkeypatch.setenv(persistent.ENV, "1")
    monkeypatch.setenv(persistent.TENSOR_CORES_ENV, "1")
    monkeypatch.setenv(halfgemm.HALF_GEMMS_ENV, "0")   # the products alone (both: below)
    plans = []
    real = persistent.cupy_persistent_layer

    def spy(*args):
        layer = real(*args)
        plans.append(None if layer is None else layer.plan.precision)
        return layer
    monkeypatch.setattr(gpu, "cupy_persistent_layer", spy)
    _assert_float16_within_the_half_bound(mode, L, D, seed=3)
    assert plans and set(plans) == {"float16"}


def _assert_float16_within_the_half_bound(mode, L, D, seed):
    _assert_float16_case_within_the_half_bound(
        *make_case(mode, T=9, N=20, I=6, H=40, L=L, D=D, seed=seed))


def _assert_float16_case_within_the_half_bound(case, kw, heads):
    """CuPy float16 through the op as the environment sets it up: every output and
    gradient within test_precision's bound of the float64 op on the same rounded inputs
    (a case's sequence_length goes to both as it is)."""
    from test_precision import assert_within, clear_of_the_kink, longest_product, rounded
    case = dict(case)
    lengths = case.pop("sequence_length", None)
    case = clear_of_the_kink(case, kw, sequence_length=lengths)
    half, exact = rounded(case, np.float16)
    half_heads, exact_heads = rounded(heads, np.float16)
    if not CELLS[kw["mode"]].has_cell_state:
        half_heads["dcy"] = exact_heads["dcy"] = None
    on_gpu = dict(_on_gpu(half), sequence_length=None if lengths is None else cupy.asarray(lengths))
    got_outs, got_grads = _run(on_gpu, kw, _on_gpu(half_heads))
    want_outs, want_grads = _run(dict(exact, sequence_length=lengths), kw, exact_heads)
    K = longest_product(kw, case["data"].shape[2])
    names = ("out", "hy", "cy")[:len(got_outs)] + ("ddata", "dparameters", "dstate",
                                                   "dstate_cell")
    for name, a, b in zip(names, [*got_outs, *got_grads], [*want_outs, *want_grads]):
        assert (a is None) == (b is None)
        if a is not None:
            assert_within(cupy.asnumpy(a), b, np.float16, K, name)


@pytest.mark.parametrize("path", ["0", "1"], ids=["per-step", "persistent"])
@pytest.mark.parametrize("mode", MODES)
def test_float16_half_gemms_within_the_half_bound(mode, path, monkeypatch):
    """CuPy float16 with the large GEMMs in half (FUSEDRNN_GPU_HALF_GEMMS=1: halfgemm.py's
    rounding kernel and cublasGemmEx), on the per-step path and on the persistent
    kernels with their tensor-core products: every output and gradient within
    test_precision's bound of the float64 op; the half GEMMs did run."""
    from fusedrnn.gpu import halfgemm, persistent
    monkeypatch.setenv(persistent.ENV, path)
    monkeypatch.setenv(persistent.TENSOR_CORES_ENV, path)
    monkeypatch.setenv(halfgemm.HALF_GEMMS_ENV, "1")
    calls = []
    real = halfgemm.HalfGemm.matmul
    monkeypatch.setattr(halfgemm.HalfGemm, "matmul",
                        lambda self, *args, **kw: calls.append(args[5]) or real(self, *args, **kw))
    _assert_float16_within_the_half_bound(mode, 2, 2, seed=4)
    assert len(calls) == 2 * (1 + 1 + 2 * 2) and set(calls) == {"float16"}


# ---- the persistent kernels (fusedrnn/gpu/persistent.cuh), selected explicitly ----

@pytest.fixture
def persistent_selected(monkeypatch):
    """FUSEDRNN_GPU_PERSISTENT=1, and a record of which ops got a persistent layer."""
    from fusedrnn.gpu import persistent
    monkeypatch.setenv(persistent.ENV, "1")
    chosen = []
    real = persistent.cupy_persistent_layer

    def spy(*args):
        chosen.append(real(*args))
        return chosen[-1]
    monkeypatch.setattr(gpu, "cupy_persistent_layer", spy)
    fusedrnn.clear_cache()
    return chosen


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_persistent_gpu_equals_cpu(persistent_selected, mode, L, D, dtype):
    case, kw, heads = make_case(mode, T=7, N=5, I=6, H=9, L=L, D=D, dtype=dtype, seed=L * D)
    _assert_gpu_equals_cpu(case, kw, heads, dtype)
    assert persistent_selected and all(layer is not None for layer in persistent_selected)


@pytest.mark.parametrize("mode, names", VALID[:5], ids=[f"{m}-{'+'.join(n)}" for m, n in VALID[:5]])
def test_persistent_features_gpu_equals_cpu(persistent_selected, mode, names):
    _assert_gpu_equals_cpu(*_with_features(mode, names, 2, np.float64), np.float64)
    assert persistent_selected and all(layer is not None for layer in persistent_selected)


def _boundary_sizes(gates, itemsize, batch):
    """The largest H the rule runs persistent on this GPU, and the next one up."""
    from fusedrnn.gpu.persistent import DeviceLimits, persistent_plan, tile_setting
    limits = DeviceLimits.of_current_cupy_device(cupy)
    fits = [h for h in range(16, 4096, 16)
            if persistent_plan(gates, h, batch, itemsize, limits, *tile_setting())]
    return max(fits), max(fits) + 16


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_persistent_at_the_selection_boundary(persistent_selected, mode):
    """Sizes either side of the rule's edge: the largest persistent one and the first that
    falls back to the per-step path both equal the CPU (float32, N=20)."""
    gates = CELLS[mode].gates
    for H, expect_persistent in zip(_boundary_sizes(gates, 4, 20), (True, False)):
        persistent_selected.clear()
        case, kw, heads = make_case(mode, T=5, N=20, I=8, H=H, L=1, D=2, dtype=np.float32,
                                    seed=H)
        _assert_gpu_equals_cpu(case, kw, heads, np.float32)
        assert len(persistent_selected) == 1
        assert (persistent_selected[0] is not None) == expect_persistent


@pytest.mark.parametrize("N, expect_persistent", [(5, True), (4096, False)])
def test_persistent_is_the_default_where_it_fits(monkeypatch, N, expect_persistent):
    """With FUSEDRNN_GPU_PERSISTENT unset, a layer that fits on chip runs persistent and
    one whose staged state does not (N=4096) takes the per-step path; both are right."""
    from fusedrnn.gpu import persistent
    monkeypatch.delenv(persistent.ENV)
    chosen = []
    real = persistent.cupy_persistent_layer
    monkeypatch.setattr(gpu, "cupy_persistent_layer", lambda *a: chosen.append(real(*a)) or chosen[-1])
    case, kw, heads = make_case("gru", T=3, N=N, I=4, H=64, L=1, D=1, dtype=np.float32, seed=N)
    _assert_gpu_equals_cpu(case, kw, heads, np.float32)
    assert len(chosen) == 1 and (chosen[0] is not None) == expect_persistent
