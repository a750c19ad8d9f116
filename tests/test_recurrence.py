"""fusedrnn.recurrence: the FusedLayer contract both backends implement, and the choice
between the two drivers. (What the drivers compute is checked everywhere else: the
fused path against the per-step path in tests/cpu/test_fused.py, the persistent layer
inside the recurrence in tests/gpu/test_persistent.py.)"""
import inspect

import numpy as np
import pytest

import fusedrnn
from fusedrnn.config import RNNConfig
from fusedrnn.cpu import BACKEND as CPU
from fusedrnn.cpu import CpuBackend
from fusedrnn.cpu.fused import FusedLayer as CpuFusedLayer
from fusedrnn.cpu.fused import fused_layer
from fusedrnn.gpu.persistent import DeviceLimits, PersistentLayer, persistent_plan
from fusedrnn.recurrence import (
    FusedDriver,
    FusedLayer,
    InputProjection,
    RecurrentOp,
    SingleStep,
    StepDriver,
)

from conftest import MODES, make_case, rel_err
from reference import rnn_reference


def _persistent_layer(mode):
    plan = persistent_plan(4, 32, 3, 4, DeviceLimits(132, 227 * 1024))
    return PersistentLayer(mode, plan, np, lambda *a: None, lambda *a: None)


IMPLEMENTATIONS = {"cpu": lambda mode: fused_layer(mode, np.float32),
                   "gpu": _persistent_layer}


def _protocol_methods(protocol):
    return {name: member for name, member in vars(protocol).items()
            if inspect.isfunction(member) and not name.startswith("_")}


@pytest.mark.parametrize("backend", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("mode", MODES)
def test_each_backend_layer_implements_the_protocol_it_declares(backend, mode):
    """isinstance checks names only; the parameter names must match too, since the
    driver passes some by keyword and a reordered list would bind wrong arrays."""
    layer = IMPLEMENTATIONS[backend](mode)
    assert isinstance(layer, FusedLayer)
    assert isinstance(layer, InputProjection) == layer.projects_input
    assert isinstance(layer, SingleStep) == layer.fuses_single_step
    for protocol in (FusedLayer, InputProjection, SingleStep):
        if not isinstance(layer, protocol):
            continue
        for name, member in _protocol_methods(protocol).items():
            want = list(inspect.signature(member).parameters)[1:]
            got = list(inspect.signature(getattr(layer, name)).parameters)
            assert got == want, (backend, name)


def test_cpu_layer_declares_both_optional_forms():
    layer = fused_layer("gru", np.float32)
    assert isinstance(layer, CpuFusedLayer) and layer.projects_input and layer.fuses_single_step


@pytest.mark.parametrize("projection", [None, 3])
def test_the_driver_is_the_fused_layer_where_the_backend_has_one(monkeypatch, projection):
    """Fused where the backend offers a layer (every CPU cell without a projection), the
    per-step driver else; the fused driver never asks for the per-step kernels (on the
    CPU compiling them would only lengthen a first call)."""
    def no_step_kernels(mode, dtype):
        raise AssertionError("per-step kernels built for a fused op")

    if projection is None:
        monkeypatch.setattr(CpuBackend, "cell_kernels", staticmethod(no_step_kernels))
    config = RNNConfig(mode="lstm", input_size=4, state_size=6, num_layers=1,
                       bidirectional=False, projection_size=projection)
    op = RecurrentOp(CPU, config, 3, 2, np.dtype(np.float64))
    assert isinstance(op.driver, StepDriver if projection else FusedDriver)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("mode", MODES)
def test_fused_driver_scratch_is_carved_for_the_layer_alone(mode, T):
    """The layer's forward scratch is part of the op's one allocation and reaches the
    layer under its own names; backward adds its own beside forward's."""
    case, kw, heads = make_case(mode, T=T, N=3, I=4, H=17, L=2, D=2)
    op = RecurrentOp(CPU, RNNConfig(mode=mode, input_size=4, state_size=17, num_layers=2,
                                    bidirectional=True), T, 3, np.dtype(np.float64))
    layer_shapes = op.driver.layer.forward_scratch(op.config, T, 3)
    views = op.driver._forward_views()
    assert sorted(vars(views)) == sorted(layer_shapes)
    for name, shape in layer_shapes.items():
        assert getattr(views, name).shape == shape
        assert np.shares_memory(getattr(views, name), op.scratch.xproj) is False
    reserve = op.take_reserve()
    inputs = (case["data"], case["parameters"], case["state"], case["state_cell"],
              fusedrnn.config.CallOptions())
    out, *_ = op.forward(*inputs, reserve)
    op.backward(reserve, *inputs, heads["dout"], heads["dhy"], heads["dcy"])
    both = vars(op.driver._all_scratch)
    assert set(both) == set(layer_shapes) | set(op.driver.layer.backward_scratch(op.config, 3))
    assert {"wpack_rows", "wpairs_rows", "dg16"} <= set(both)   # (empty but for bf16)
    assert rel_err(out, rnn_reference(**case, **kw)[0]) <= 1e-10


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16])
def test_carved_views_start_on_cache_lines(dtype):
    """Every view of one carving starts 64-byte aligned whatever the sizes before it
    (the GPU's 16-byte staging loads need 16: persistent.cuh's stage_half_rows_wide), and
    the views do not overlap."""
    from fusedrnn.recurrence import _carve
    views, nbytes = _carve(np, dtype, {"a": (3, 5), "b": (7,), "empty": (0, 4), "c": (2, 9)})
    for name in ("a", "b", "c"):
        view = getattr(views, name)
        assert view.ctypes.data % 64 == 0 and view.flags.c_contiguous, name
        view[...] = {"a": 1, "b": 2, "c": 3}[name]
    assert (views.a == 1).all() and (views.b == 2).all() and (views.c == 3).all()
    assert views.empty.shape == (0, 4) and nbytes >= (15 + 7 + 18) * np.dtype(dtype).itemsize


# ---- the precision plan: decided once per op, pinned for each dtype and backend ---------
def _plan(backend, dtype, T, N, mode="lstm", stored_as=None):
    cfg = RNNConfig(mode=mode, input_size=16, state_size=16, num_layers=1,
                    bidirectional=False)
    return RecurrentOp(backend, cfg, T, N, np.dtype(dtype), stored_as).plan


def _plans(**flags):
    return {name: flags.get(name, False) for name in
            ("half_gemms", "projects_in_half", "data_in_place", "weights_in_place",
             "trains_in_place", "fuses_input")}


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_the_cpu_backends_precision_plans(mode):
    """float32 and float64 are held and multiplied as they come; float16 is widened at the
    edges, the fused loop reading the data in place from T=2; bfloat16 on AVX512-BF16
    multiplies pairs everywhere, in place, and from FUSED_INPUT_ROWS rows projects inside
    the loop (without it, as float16)."""
    from dataclasses import asdict

    import ml_dtypes

    from fusedrnn.cpu.fused import FUSED_INPUT_ROWS
    from fusedrnn.cpu.lowlevel import HAS_BF16
    rows = FUSED_INPUT_ROWS
    for dtype in (np.float64, np.float32):
        for T, N in ((1, 4), (20, 4), (20, rows)):
            plan = _plan(CPU, dtype, T, N, mode)
            assert (plan.io, plan.compute, plan.storage, plan.converts) == (
                np.dtype(dtype).name, np.dtype(dtype).name, None, False)
            assert {k: v for k, v in asdict(plan).items() if k in _plans()} == _plans()
    bf16 = np.dtype(ml_dtypes.bfloat16)
    expected = {
        ("float16", 1, 4): _plans(),
        ("float16", 20, 4): _plans(data_in_place=True),
        ("float16", 20, rows): _plans(data_in_place=True),
        ("bfloat16", 1, 4): _plans(half_gemms=True, weights_in_place=True) if HAS_BF16
        else _plans(),
        ("bfloat16", 20, rows - 1): _plans(half_gemms=True, data_in_place=True,
                                           weights_in_place=True, trains_in_place=True)
        if HAS_BF16 else _plans(data_in_place=True),
        ("bfloat16", 20, rows): _plans(half_gemms=True, data_in_place=True,
                                       weights_in_place=True, trains_in_place=True,
                                       fuses_input=True)
        if HAS_BF16 else _plans(data_in_place=True),
    }
    for (name, T, N), flags in expected.items():
        plan = _plan(CPU, bf16 if name == "bfloat16" else np.float16, T, N, mode)
        assert (plan.io, plan.compute, plan.storage, plan.converts) == (
            name, "float32", name, True), (name, T, N)
        assert {k: v for k, v in asdict(plan).items() if k in flags} == flags, (name, T, N)


class _CupyStandIn:
    """numpy, with the one CuPy fact GpuBackend.pair_products reads: the device's compute
    capability."""

    def __init__(self, capability):
        from types import SimpleNamespace
        device = SimpleNamespace(compute_capability=str(capability))
        self.cuda = SimpleNamespace(Device=lambda: device)

    def __getattr__(self, name):
        return getattr(np, name)


class _GpuPlanBackend:
    """GpuBackend's precision decisions (its pair_products and pair_projection) with the
    persistent layer's plan for an H100, its launches never run."""

    def __init__(self, capability):
        from fusedrnn.gpu import GpuBackend
        self.gpu = GpuBackend(_CupyStandIn(capability))
        self.xp = self.gpu.xp
        self.pair_products, self.pair_projection = (self.gpu.pair_products,
                                                    self.gpu.pair_projection)
        self.pair_scratch = self.gpu.pair_scratch
        self.blas_scope = self.gpu.blas_scope

    def fused_layer(self, config, dtype, batch, storage=None):
        from fusedrnn.gpu.persistent import op_plan
        plan = op_plan(config.cell.gates, config.state_size, batch, np.dtype(dtype).itemsize,
                       DeviceLimits(132, 227 * 1024, 90), storage)
        return PersistentLayer(config.mode, plan, np, lambda *a: None, lambda *a: None)


def test_the_gpu_backends_precision_plans(monkeypatch):
    """float32 is held and multiplied as it comes; float16, and float32 standing for
    bfloat16 (torch's CUDA bfloat16), run their large GEMMs in half from compute
    capability 8.0, the input projection from MIN_PROJECTION_ROWS rows; the persistent
    layer reads nothing in place. FUSEDRNN_GPU_HALF_GEMMS=0 keeps them float32."""
    from dataclasses import asdict

    from fusedrnn.gpu.halfgemm import HALF_GEMMS_ENV, MIN_PROJECTION_ROWS
    monkeypatch.delenv(HALF_GEMMS_ENV, raising=False)
    gpu, old = _GpuPlanBackend(90), _GpuPlanBackend(75)
    big, small = (MIN_PROJECTION_ROWS // 4, 4), (MIN_PROJECTION_ROWS // 4 - 1, 4)

    def flags(plan):
        return {k: v for k, v in asdict(plan).items() if k in _plans()}

    for T, N in (big, small):
        plan = _plan(gpu, np.float32, T, N)
        assert (plan.storage, plan.converts, flags(plan)) == (None, False, _plans())
        for dtype, stored_as, storage in ((np.float16, None, "float16"),
                                          (np.float32, "bfloat16", "bfloat16")):
            plan = _plan(gpu, dtype, T, N, stored_as=stored_as)
            assert plan.storage == storage and plan.converts == (dtype == np.float16)
            assert flags(plan) == _plans(half_gemms=True,
                                         projects_in_half=(T, N) == big), (dtype, T, N)
            assert flags(_plan(old, dtype, T, N, stored_as=stored_as)) == _plans()
    monkeypatch.setenv(HALF_GEMMS_ENV, "0")
    assert flags(_plan(gpu, np.float16, *big)) == _plans()
