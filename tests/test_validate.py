"""Bad input gets a typed error naming the argument; unbuilt features say so."""
import numpy as np
import pytest

import fusedrnn
from fusedrnn.cpu import BACKEND
from fusedrnn.validate import check_call

from conftest import make_case, param_count, rel_err
from reference import rnn_reference

CASE, KW, HEADS = make_case("lstm", L=2)
GRU_PARAMETERS = make_case("gru", L=2)[0]["parameters"]


def call(**changes):
    args = dict(CASE, **KW)
    args.update(changes)
    return fusedrnn.RNN(**args)


BAD = [
    (dict(data=CASE["data"][0]), ValueError, r"data: expected 3 dimensions, got shape \(3, 5\)"),
    (dict(data=CASE["data"].astype(np.int64)), TypeError,
     "data: expected dtype float32, float64, float16 or bfloat16"),
    (dict(data=CASE["data"].astype(np.complex128)), TypeError, "data: expected dtype float32"),
    (dict(data=CASE["data"].tolist()), TypeError, "data: expected a numpy.ndarray or a cupy.ndarray.*list"),
    (dict(data=CASE["data"][:0]), ValueError, r"data: .*T, N, I >= 1, got \(0, 3, 5\)"),
    (dict(parameters=CASE["parameters"][:-1]), ValueError,
     r"parameters: expected \d+ elements .*D\*G\*H\*\(I\+H\+2\).*got \d+"),
    (dict(parameters=CASE["parameters"].astype(np.float32)), TypeError,
     "parameters: expected dtype float64 .data's dtype., got float32"),
    (dict(parameters=CASE["parameters"].reshape(1, -1)), ValueError, "parameters: expected 1 dim"),
    (dict(state=CASE["state"][:1]), ValueError, r"state: expected shape .* = \(2, 3, 6\), got \(1, 3, 6\)"),
    (dict(state_cell=CASE["state_cell"][:, :1]), ValueError, "state_cell: expected shape"),
    (dict(mode="lstm2"), ValueError, "mode: expected one of rnn_relu, rnn_tanh, lstm, gru, got 'lstm2'"),
    (dict(mode=None), ValueError, "mode: expected one of"),
    (dict(state_size=6.0), TypeError, "state_size: expected a positive int, got float"),
    (dict(state_size=0), ValueError, "state_size: expected a positive int, got 0"),
    (dict(num_layers=True), TypeError, "num_layers: expected a positive int, got bool"),
    (dict(bidirectional="yes"), TypeError, "bidirectional: expected a bool, got str"),
    (dict(state_outputs=1), TypeError, "state_outputs: expected a bool"),
    (dict(p=1.0), ValueError, r"p: expected a dropout probability in \[0, 1\), got 1.0"),
    (dict(p=-0.1), ValueError, "p: expected a dropout probability"),
    (dict(p="0.5"), TypeError, "p: expected a float"),
    (dict(sequence_length=np.ones(3, np.int32)), ValueError,
     "sequence_length: given, but use_sequence_length=False"),
    (dict(mode="gru", state_cell=None, projection_size=3), ValueError,
     "projection_size: only mode='lstm'"),
    # shapes and sizes
    (dict(data=CASE["data"][:, :0]), ValueError, r"data: .*got \(4, 0, 5\)"),
    (dict(data=CASE["data"][:, :, :0]), ValueError, r"data: .*got \(4, 3, 0\)"),
    (dict(data=CASE["data"][None]), ValueError, "data: expected 3 dimensions, got shape"),
    (dict(data=np.float64(1.0)), TypeError, "data: expected a numpy.ndarray"),
    (dict(data=CASE["data"].astype(np.float16)), TypeError, r"parameters: expected dtype "
     r"float16 \(data's dtype\), got float64"),
    (dict(data=CASE["data"].astype(np.int16)), TypeError, "data: expected dtype float32, "
     "float64, float16 or bfloat16, got int16"),
    (dict(data=CASE["data"] > 0), TypeError, "data: expected dtype float32, float64, float16 "
     "or bfloat16, got bool"),
    (dict(parameters=CASE["parameters"].astype(np.int64)), TypeError, "parameters: expected dtype"),
    (dict(parameters=list(CASE["parameters"])), TypeError, "parameters: expected a numpy.ndarray"),
    (dict(state_size=2 ** 40), ValueError, r"parameters: expected \d+ elements"),  # no allocation
    (dict(state=CASE["state"].tolist()), TypeError, "state: expected a numpy.ndarray like data"),
    (dict(state=CASE["state"].astype(np.int32)), TypeError, "state: expected dtype float64"),
    (dict(state=CASE["state"][0]), ValueError, "state: expected 3 dimensions"),
    (dict(state_cell=CASE["state_cell"][0]), ValueError, "state_cell: expected 3 dimensions"),
    (dict(state_cell=CASE["state_cell"].astype(np.float32)), TypeError, "state_cell: expected dtype"),
    # options
    (dict(num_layers=0), ValueError, "num_layers: expected a positive int, got 0"),
    (dict(num_layers="2"), TypeError, "num_layers: expected a positive int, got str"),
    (dict(state_size=-3), ValueError, "state_size: expected a positive int, got -3"),
    (dict(mode="LSTM"), ValueError, "mode: expected one of .*got 'LSTM'"),
    (dict(bidirectional=1), TypeError, "bidirectional: expected a bool, got int"),
    (dict(p=float("nan")), ValueError, "p: expected a dropout probability in"),
    (dict(train="yes"), TypeError, "train: expected a bool, got str"),
    (dict(seed=-1), ValueError, "seed: expected None or a non-negative int, got -1"),
    (dict(seed=1.5), ValueError, "seed: expected None or a non-negative int"),
    (dict(projection_size=0), ValueError, "projection_size: expected a positive int, got 0"),
    (dict(projection_size="3"), TypeError, "projection_size: expected a positive int"),
    (dict(lstm_state_clip_min=1.0, lstm_state_clip_max=-1.0), ValueError,
     "lstm_state_clip_min: expected min <= max"),
    (dict(lstm_state_clip_min=-1.0), ValueError, "give both bounds or neither"),
    (dict(lstm_state_clip_min=float("nan"), lstm_state_clip_max=1.0), ValueError,
     "lstm_state_clip_min: expected a number, got NaN"),
    (dict(lstm_state_clip_min="-1", lstm_state_clip_max=1.0), TypeError,
     "lstm_state_clip_min: expected a float"),
    (dict(lstm_state_clip_nan="yes"), TypeError, "lstm_state_clip_nan: expected a bool"),
    (dict(mode="gru", state_cell=None, parameters=GRU_PARAMETERS, lstm_state_clip_min=-1.0,
          lstm_state_clip_max=1.0),
     ValueError, "only mode='lstm' has a cell state to clip"),
    # sequence lengths
    (dict(use_sequence_length=True), ValueError, "sequence_length: use_sequence_length=True "
     "needs"),
    (dict(use_sequence_length=True, sequence_length=np.array([4.0, 1.0, 2.0])), TypeError,
     "sequence_length: expected an integer dtype, got float64"),
    (dict(use_sequence_length=True, sequence_length=np.array([4, 1])), ValueError,
     r"sequence_length: expected shape \(N,\) = \(3,\), got \(2,\)"),
    (dict(use_sequence_length=True, sequence_length=np.array([4, 0, 2])), ValueError,
     "sequence_length: expected every length in 1..T = 1..4, got values from 0 to 4"),
    (dict(use_sequence_length=True, sequence_length=np.array([5, 1, 2])), ValueError,
     "sequence_length: expected every length in 1..T = 1..4"),
    (dict(use_sequence_length=True, sequence_length=[4, 1, 2]), TypeError,
     "sequence_length: expected a numpy.ndarray like data, got builtins.list"),
]


@pytest.mark.parametrize("changes, error, message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_input_raises_and_leaves_cache_usable(changes, error, message):
    with pytest.raises(error, match=message):
        call(**changes)
    out = call()
    assert rel_err(out, rnn_reference(**CASE, **KW)[0]) <= 1e-10


def test_corpus_is_large():
    assert len(BAD) >= 40


def test_nan_and_inf_in_data_propagate_without_harm():
    """Documented result: non-finite inputs are not errors; they propagate through the
    arithmetic like in torch.nn (a NaN reaches every later step of its sample)."""
    data = CASE["data"].copy()
    data[1, 0, 0] = np.nan
    data[2, 2, 1] = np.inf
    out = call(data=data)
    assert np.isnan(out[1:, 0]).all() and np.isfinite(out[0]).all()
    assert np.isfinite(out[:, 1]).all()            # other samples are untouched
    assert rel_err(call(), rnn_reference(**CASE, **KW)[0]) <= 1e-10


def test_state_cell_is_lstm_only():
    case, kw, _ = make_case("gru")
    with pytest.raises(ValueError, match="state_cell: only mode='lstm'"):
        fusedrnn.RNN(**dict(case, state_cell=CASE["state_cell"]), **kw)


def test_state_dtype_must_match():
    with pytest.raises(TypeError, match="state: expected dtype float64"):
        call(state=CASE["state"].astype(np.float32))


def test_dropout_is_ignored_in_inference_and_for_one_layer():
    assert np.array_equal(call(p=0.5), call())
    case, kw, _ = make_case("gru", L=1)
    out, _ = fusedrnn.RNN(**case, **kw, p=0.5, train=True)
    assert np.array_equal(out, fusedrnn.RNN(**case, **kw))


def test_torch_tensors_are_checked_like_arrays():
    import torch
    tensors = {k: torch.from_numpy(v) for k, v in CASE.items()}
    with pytest.raises(TypeError, match="data: expected dtype float32, float64, float16 or "
                                        "bfloat16, got int32"):
        call(**dict(tensors, data=tensors["data"].int()))
    with pytest.raises(TypeError, match=r"parameters: expected dtype float16 \(data's dtype\)"):
        call(**dict(tensors, data=tensors["data"].half()))
    with pytest.raises(TypeError, match="parameters: expected a torch.Tensor like data, got numpy"):
        call(**dict(tensors, parameters=CASE["parameters"]))


def test_backward_head_gradients_are_checked():
    _, handle = call(train=True)
    with pytest.raises(ValueError, match=r"dout: expected shape \(4, 3, 6\), got \(1, 3, 6\)"):
        fusedrnn.rnn_backward(handle, HEADS["dout"][:1])
    with pytest.raises(TypeError, match="dout: expected dtype float64 .data's dtype., got float32"):
        fusedrnn.rnn_backward(handle, HEADS["dout"].astype(np.float32))
    with pytest.raises(ValueError, match="dhy: this forward has no such output"):
        fusedrnn.rnn_backward(handle, HEADS["dout"], dhy=HEADS["dhy"])
    with pytest.raises(TypeError, match="dout: expected a numpy.ndarray like data"):
        fusedrnn.rnn_backward(handle, HEADS["dout"].tolist())
    with pytest.raises(TypeError, match="handle: expected the TrainingHandle"):
        fusedrnn.rnn_backward(object(), HEADS["dout"])
    grads = fusedrnn.rnn_backward(handle, HEADS["dout"])   # the handle is still good
    assert np.isfinite(grads.parameters).all()


def test_absurd_sizes_are_refused_fast_and_exactly():
    import time
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"parameters: expected \d+ elements"):
        call(num_layers=10 ** 8)
    assert time.perf_counter() - start < 1.0              # no per-layer work before the check
    exact = param_count("lstm", 5, 2 ** 31, 2, 1)         # > 2**63: int64 would overflow
    assert exact > 2 ** 63
    with pytest.raises(ValueError, match=f"parameters: expected {exact} elements"):
        call(state_size=2 ** 31)


def test_lengths_are_copied_so_later_changes_cannot_reach_backward():
    case, kw, heads = make_case("gru", L=2)
    lens = np.array([4, 1, 2], np.int64)
    _, handle = fusedrnn.RNN(**case, **kw, sequence_length=lens, use_sequence_length=True,
                             train=True)
    expected = fusedrnn.rnn_backward(handle, heads["dout"], retain=True)
    lens[:] = 4
    got = fusedrnn.rnn_backward(handle, heads["dout"])
    assert np.array_equal(got.data, expected.data)


def test_a_remembered_config_never_answers_for_an_argument_of_another_type():
    """check_config remembers its results per argument values and types: after a good
    call, True for num_layers (equal to 1, and hashed alike) is still refused, and an
    unhashable argument still gets its own message."""
    case, kw, _ = make_case("lstm")
    fusedrnn.RNN(**case, **kw)
    for bad, error in ((True, TypeError), (1.0, TypeError), ([1], TypeError)):
        with pytest.raises(error, match="num_layers: expected a positive int"):
            fusedrnn.RNN(**case, **dict(kw, num_layers=bad))
    with pytest.raises(TypeError, match="bidirectional: expected a bool"):
        fusedrnn.RNN(**case, **dict(kw, bidirectional=0))
    fusedrnn.RNN(**case, **kw)


def test_remembered_scalars_never_answer_for_another_type_or_config():
    """The other arguments' checks are remembered per values and types: after good
    calls, 1 for a bool and True for p are still refused, a clip range is still refused for
    GRU after LSTM took it, and a remembered p still gives dropout only where it applies."""
    case, kw, _ = make_case("lstm", L=2)
    clip = dict(lstm_state_clip_min=-1.0, lstm_state_clip_max=1.0)
    fusedrnn.RNN(**case, **kw, **clip, state_outputs=True, train=False, p=0.0)
    for name, bad in (("state_outputs", 1), ("train", 1), ("lstm_state_clip_nan", 0),
                      ("use_sequence_length", 0)):
        with pytest.raises(TypeError, match=f"{name}: expected a bool"):
            fusedrnn.RNN(**case, **kw, **clip, **{name: bad})
    with pytest.raises(TypeError, match="p: expected a float"):
        fusedrnn.RNN(**case, **kw, p=True)
    with pytest.raises(TypeError, match="lstm_state_clip_min: expected a float"):
        fusedrnn.RNN(**case, **kw, **dict(clip, lstm_state_clip_min=[1]))
    gru_case, gru_kw, _ = make_case("gru", L=2)
    with pytest.raises(ValueError, match="only mode='lstm' has a cell state to clip"):
        fusedrnn.RNN(**gru_case, **gru_kw, **clip)
    call = check_call(BACKEND, case["data"], case["parameters"], None, None, None, **kw,
                      p=0.25, state_outputs=False, projection_size=None,
                      lstm_state_clip_min=None, lstm_state_clip_max=None,
                      lstm_state_clip_nan=False, use_sequence_length=False, train=False)
    assert call.options.dropout == 0.0   # (inference: no dropout)
    call = check_call(BACKEND, case["data"], case["parameters"], None, None, None, **kw,
                      p=0.25, state_outputs=False, projection_size=None,
                      lstm_state_clip_min=None, lstm_state_clip_max=None,
                      lstm_state_clip_nan=False, use_sequence_length=False, train=True)
    assert call.options.dropout == 0.25


def test_bfloat16_is_told_apart_from_other_two_byte_voids():
    """The dtype's name decides (validate._array, through config.dtype_name's memory)."""
    import ml_dtypes
    case, kw, _ = make_case("lstm")
    for dtype in (np.dtype("V2"), np.dtype(ml_dtypes.bfloat16), np.dtype("V2")):
        half = {k: None if v is None else v.astype(ml_dtypes.bfloat16).view(dtype)
                for k, v in case.items()}
        if dtype == np.dtype("V2"):
            with pytest.raises(TypeError, match="data: expected dtype"):
                fusedrnn.RNN(**half, **kw)
        else:
            assert fusedrnn.RNN(**half, **kw).dtype == dtype
