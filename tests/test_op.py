"""fusedrnn.RNN forward and backward against the plain float64 reference in tests/."""
import numpy as np
import pytest

import fusedrnn

from conftest import CELLS, MODES, make_case, rel_err, tolerance
from reference import finite_difference, loss_reference, rnn_reference


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_forward_matches_reference(mode, L, D, dtype):
    case, kw, _ = make_case(mode, T=5, N=3, I=4, H=5, L=L, D=D, dtype=dtype, seed=L * 10 + D)
    out, hy, *cy = fusedrnn.RNN(**case, **kw, state_outputs=True)
    ref_out, ref_hy, ref_cy = rnn_reference(**case, **kw)
    assert out.dtype == hy.dtype == dtype
    assert rel_err(out, ref_out) <= tolerance(dtype)
    assert rel_err(hy, ref_hy) <= tolerance(dtype)
    if CELLS[mode].has_cell_state:
        assert rel_err(cy[0], ref_cy) <= tolerance(dtype)
    else:
        assert cy == []


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_backward_matches_finite_differences_of_reference(mode, L, D, dtype):
    """Gradients of every input, float64 central differences of the reference as truth."""
    case, kw, heads = make_case(mode, T=4, N=2, I=3, H=3, L=L, D=D, dtype=dtype, seed=7 + L + D)
    *outs, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    grads = fusedrnn.rnn_backward(handle, **heads)
    # The reference runs in float64 on the (possibly float32) inputs, made float64 here.
    ref_case = {k: (None if v is None else v.astype(np.float64)) for k, v in case.items()}
    ref_heads = [None if heads[k] is None else heads[k].astype(np.float64)
                 for k in ("dout", "dhy", "dcy")]

    def loss():
        return loss_reference(**ref_case, heads=ref_heads, **kw)

    # FD error ~1e-9 absolute on O(1) gradients; float32 carries its own rounding.
    tol = 1e-7 if dtype == np.float64 else 1e-5
    for name in ("data", "parameters", "state", "state_cell"):
        got = getattr(grads, name)
        if ref_case[name] is None:
            assert got is None
            continue
        assert got.dtype == dtype and got.shape == case[name].shape
        assert rel_err(got, finite_difference(loss, ref_case[name])) <= tol, name


@pytest.mark.parametrize("mode", MODES)
def test_backward_is_deterministic(mode):
    """Repeat runs give bit-identical gradients (finite differences above are only good
    to ~1e-9; the tight 1e-10 gradient checks are test_golden.py and
    tests/torch/test_autograd.py)."""
    case, kw, heads = make_case(mode, L=2, D=2)
    *_, h1 = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    g1 = fusedrnn.rnn_backward(h1, **heads)
    *_, h2 = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    g2 = fusedrnn.rnn_backward(h2, **heads)
    for a, b in zip(g1, g2):  # deterministic: bit-identical on repeat
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_missing_states_default_to_zero(mode):
    case, kw, _ = make_case(mode, L=2, D=2, states=False)
    out = fusedrnn.RNN(**case, **kw)
    zeros = np.zeros((4, 3, 6))
    ref_out, _, _ = rnn_reference(case["data"], case["parameters"], zeros,
                                  zeros if CELLS[mode].has_cell_state else None, **kw)
    assert rel_err(out, ref_out) <= 1e-10


@pytest.mark.parametrize("mode", MODES)
def test_output_arity_like_mxnet(mode):
    case, kw, _ = make_case(mode)
    assert isinstance(fusedrnn.RNN(**case, **kw), np.ndarray)
    outs = fusedrnn.RNN(**case, **kw, state_outputs=True)
    assert len(outs) == (3 if CELLS[mode].has_cell_state else 2)
    *outs, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    assert isinstance(handle, fusedrnn.TrainingHandle)
    out, handle = fusedrnn.RNN(**case, **kw, train=True)
    assert isinstance(handle, fusedrnn.TrainingHandle)


@pytest.mark.parametrize("mode", MODES)
def test_training_forward_equals_inference(mode):
    case, kw, _ = make_case(mode, L=3, D=2)
    inference = fusedrnn.RNN(**case, **kw, state_outputs=True)
    *training, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    for a, b in zip(inference, training):
        assert np.array_equal(a, b)


def test_head_gradients_may_be_omitted():
    case, kw, heads = make_case("lstm", L=2)
    *_, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    only_dhy = fusedrnn.rnn_backward(handle, dhy=heads["dhy"])
    ref = [finite_difference(lambda: loss_reference(**case, heads=[None, heads["dhy"], None],
                                                    **kw), case["state"])]
    assert rel_err(only_dhy.state, ref[0]) <= 1e-7
    out, handle = fusedrnn.RNN(**case, **kw, train=True)
    none = fusedrnn.rnn_backward(handle)
    assert all(np.count_nonzero(g) == 0 for g in none)


def test_strided_and_negative_stride_inputs_are_read_correctly():
    case, kw, _ = make_case("gru", L=2, D=2)
    expected = fusedrnn.RNN(**case, **kw)
    reversed_copy = np.ascontiguousarray(case["data"][::-1])[::-1]      # negative strides
    wide = np.zeros((4, 3, 10))
    wide[:, :, ::2] = case["data"][:, :, :5]                             # non-contiguous
    strided = dict(case, data=reversed_copy)
    assert np.array_equal(fusedrnn.RNN(**strided, **kw), expected)
    assert wide[:, :, ::2].flags.c_contiguous is False
    strided = dict(case, data=wide[:, :, ::2])
    assert np.array_equal(fusedrnn.RNN(**strided, **kw), expected)


@pytest.mark.parametrize("T, projection", [(4, None), (1, None), (4, 3), (1, 3)])
def test_read_only_inputs_give_the_results_of_writable_ones(T, projection):
    """Read-only arrays (a memory map, np.frombuffer): every input, on the fused loop, its
    T=1 form and the projected per-step path, training included. The per-step kernels'
    signatures once refused the read-only biases with a TypeError."""
    case, kw, heads = make_case("lstm", T=T, N=3, I=5, H=6, L=2, D=2, seed=11)
    if projection:
        rng = np.random.default_rng(12)
        case["parameters"] = rng.uniform(-0.4, 0.4, fusedrnn.param_size(
            input_size=5, projection_size=projection, **kw))
        case["state"] = case["state"][..., :projection].copy()
        heads["dout"] = heads["dout"][..., :2 * projection].copy()
    lengths = np.array([T, 1, max(1, T - 1)], np.int64)
    extra = dict(projection_size=projection, sequence_length=lengths,
                 use_sequence_length=True, state_outputs=True)
    expected = fusedrnn.RNN(**case, **kw, **extra, train=True)
    expected_grads = fusedrnn.rnn_backward(expected[-1], heads["dout"])
    fixed = {k: v.copy() for k, v in case.items() if v is not None}
    for array in (*fixed.values(), lengths):
        array.setflags(write=False)
    extra["sequence_length"] = lengths
    got = fusedrnn.RNN(**fixed, **kw, **extra, train=True)
    grads = fusedrnn.rnn_backward(got[-1], heads["dout"])
    for a, b in zip((*got[:-1], *grads), (*expected[:-1], *expected_grads)):
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("stored_as", ["bfloat16", "float16", "float32", 3])
def test_stored_as_is_refused_outside_cupy_float32_data(stored_as):
    """op.RNN's private _stored_as (torch's CUDA bfloat16 arriving as float32) applies to
    CuPy float32 data only; numpy data is refused, naming it, whatever it says."""
    case, kw, _ = make_case("gru", dtype=np.float32)
    with pytest.raises(ValueError, match="_stored_as: expected None, or 'bfloat16'"):
        fusedrnn.RNN(**case, **kw, _stored_as=stored_as)
    assert fusedrnn.RNN(**case, **kw, _stored_as=None).dtype == np.float32
