"""fusedrnn.recurrence: the FusedLayer contract both backends implement, and the choice
between the two drivers. (What the drivers compute is checked everywhere else: the
fused path against the per-step path in tests/cpu/test_fused.py, the persistent layer
inside the recurrence in tests/gpu/test_persistent.py.)"""
import inspect

import numpy as np
import pytest

import fusedrnn
from conftest import MODES, make_case, rel_err
from fusedrnn.config import RNNConfig
from fusedrnn.cpu import BACKEND as CPU, CpuBackend
from fusedrnn.cpu.fused import FusedLayer as CpuFusedLayer, fused_layer
from fusedrnn.gpu.persistent import DeviceLimits, PersistentLayer, persistent_plan
from fusedrnn.recurrence import (FusedDriver, FusedLayer, InputProjection, RecurrentOp,
                                 SingleStep, StepDriver)
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
