"""Faults in the middle of a call: an exception raised inside a forward or backward (a
KeyboardInterrupt-like BaseException from a kernel launch, or a MemoryError from an
allocation) propagates, returns nothing partial, and leaves the op cache usable; a
backward that failed can be run again on the same handle."""
from types import SimpleNamespace

import numpy as np
import pytest

import fusedrnn
from fusedrnn.cpu import CpuBackend

from conftest import MODES, POISONED_NUMPY, make_case, rel_err, tolerance
from reference import rnn_reference


class Injected(BaseException):
    """Like KeyboardInterrupt: not an Exception, so no `except Exception` swallows it."""


@pytest.fixture
def fault(monkeypatch):
    """fault["launch"] = k makes the k-th kernel launch from now on raise Injected (cell
    kernels, and the fused layer loops, which run a whole layer and direction each)."""
    state = {"launch": None}
    real = CpuBackend.cell_kernels

    def wrap(kernel):
        def launch(*args, **kw):
            if state["launch"] is not None:
                state["launch"] -= 1
                if state["launch"] < 0:
                    state["launch"] = None
                    raise Injected
            kernel(*args, **kw)
        return launch

    def wrapped_fused(config, dtype, batch, storage=None):
        layer = real_fused(config, dtype, batch, storage)
        if layer is None:
            return None
        return SimpleNamespace(forward_scratch=layer.forward_scratch,
                               backward_scratch=layer.backward_scratch, project=layer.project,
                               projects_input=layer.projects_input,
                               fuses_single_step=layer.fuses_single_step,
                               reads_storage=layer.reads_storage,
                               reads_weights=layer.reads_weights,
                               fuses_input=layer.fuses_input, input_pairs=layer.input_pairs,
                               forward=wrap(layer.forward),
                               forward_single=wrap(layer.forward_single),
                               single_launcher=lambda *sizes: wrap(
                                   layer.single_launcher(*sizes)),
                               backward=wrap(layer.backward))

    real_fused = CpuBackend.fused_layer
    monkeypatch.setattr(CpuBackend, "cell_kernels",
                        staticmethod(lambda mode, dtype: tuple(map(wrap, real(mode, dtype)))))
    monkeypatch.setattr(CpuBackend, "fused_layer", staticmethod(wrapped_fused))
    return state


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("T", [4, 1], ids=["T=4", "T=1"])   # T=1: FusedLayer.forward_single
@pytest.mark.parametrize("at", [0, 1, 3])   # of L*D = 4 launches (one per layer and direction)
@pytest.mark.parametrize("mode", MODES)
def test_fault_in_forward_leaves_the_cache_usable(fault, mode, at, T, dtype):
    case, kw, _ = make_case(mode, T=T, L=2, D=2, seed=at, dtype=dtype)
    fault["launch"] = at
    with pytest.raises(Injected):
        fusedrnn.RNN(**case, **kw, state_outputs=True)
    out, hy, *cy = fusedrnn.RNN(**case, **kw, state_outputs=True)
    ref = rnn_reference(**case, **kw)
    tol = tolerance(dtype)
    assert rel_err(out, ref[0]) <= tol and rel_err(hy, ref[1]) <= tol
    assert fusedrnn.cache_info().entries == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("at", [0, 2, 3])   # of L*D = 4 backward launches
@pytest.mark.parametrize("mode", MODES)
def test_fault_in_backward_can_be_retried(fault, mode, at, dtype):
    case, kw, heads = make_case(mode, L=2, D=2, seed=at, dtype=dtype)
    *_, expected_handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    expected = fusedrnn.rnn_backward(expected_handle, **heads)
    *_, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    fault["launch"] = at
    with pytest.raises(Injected):
        fusedrnn.rnn_backward(handle, **heads)
    assert not handle.released            # the reserve is intact: backward only reads it
    got = fusedrnn.rnn_backward(handle, **heads)
    for a, b in zip(got, expected):
        assert (a is None and b is None) or np.array_equal(a, b)


def test_fault_in_training_forward_then_training_works(fault):
    case, kw, heads = make_case("lstm", L=3, D=2)
    fault["launch"] = 4   # layer 2's first direction
    with pytest.raises(Injected):
        fusedrnn.RNN(**case, **kw, train=True)
    out, handle = fusedrnn.RNN(**case, **kw, train=True)
    grads = fusedrnn.rnn_backward(handle, heads["dout"])
    assert rel_err(out, rnn_reference(**case, **kw)[0]) <= 1e-10
    assert np.isfinite(grads.parameters).all()


def test_allocation_failure_is_a_clean_error(monkeypatch):
    """A MemoryError while building an op (its scratch) inserts nothing into the cache."""
    case, kw, _ = make_case("gru", L=2)
    calls = {"n": 0}

    def empty(shape, dtype=float, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("injected: cannot allocate")
        return POISONED_NUMPY.empty(shape, dtype, **kwargs)

    monkeypatch.setattr(CpuBackend, "xp", type(POISONED_NUMPY)(**dict(vars(POISONED_NUMPY),
                                                                     empty=empty)))
    with pytest.raises(MemoryError):
        fusedrnn.RNN(**case, **kw)
    assert fusedrnn.cache_info().entries == 0
    assert rel_err(fusedrnn.RNN(**case, **kw), rnn_reference(**case, **kw)[0]) <= 1e-10
