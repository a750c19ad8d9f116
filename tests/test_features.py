"""The four features beyond the plain recurrence: sequence lengths, LSTM projection,
cell-state clipping and dropout. Forward against the float64 reference, gradients against
its central differences, and against torch where torch has the feature."""
import numpy as np
import pytest

import fusedrnn

from conftest import CELLS, MODES, make_case, rel_err, tolerance
from reference import finite_difference, loss_reference, param_count, rnn_reference, split_params
from torch_ref import flat_grads, loaded_module, torch_run

FD_TOL = 1e-7  # central differences (eps=1e-6) are good to ~1e-9 absolute on O(1) gradients
GRADS = ("data", "parameters", "state", "state_cell")


def ref_args(feats):
    """The op's feature arguments in the reference's spelling (masks are passed apart)."""
    rename = dict(lstm_state_clip_min="clip_min", lstm_state_clip_max="clip_max",
                  lstm_state_clip_nan="clip_nan", sequence_length="sequence_length")
    return {rename[k]: v for k, v in feats.items() if k in rename}


def dropout_masks(seed, p, T, N, D, R, L, dtype):
    """The documented CPU mask scheme, regenerated from the seed: one draw per layer 0..L-2."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    masks = []
    for _ in range(L - 1):
        keep = rng.random((T, N, D * R), dtype=dtype) >= p
        masks.append(keep.astype(dtype) * dtype.type(1.0 / (1.0 - p)))
    return masks


def proj_case(T=4, N=3, I=4, H=5, P=3, L=1, D=1, dtype=np.float64, seed=0, states=True):
    """make_case for a projected LSTM: state (L*D, N, P), out and hy of width P."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(H)
    case = dict(data=rng.standard_normal((T, N, I)).astype(dtype),
                parameters=rng.uniform(-scale, scale,
                                       param_count("lstm", I, H, L, D, P)).astype(dtype),
                state=(0.5 * rng.standard_normal((L * D, N, P))).astype(dtype) if states else None,
                state_cell=((0.5 * rng.standard_normal((L * D, N, H))).astype(dtype)
                            if states else None))
    kw = dict(mode="lstm", state_size=H, num_layers=L, bidirectional=D == 2, projection_size=P)
    heads = dict(dout=rng.standard_normal((T, N, D * P)).astype(dtype),
                 dhy=rng.standard_normal((L * D, N, P)).astype(dtype),
                 dcy=rng.standard_normal((L * D, N, H)).astype(dtype))
    return case, kw, heads


def check_forward(case, kw, feats, masks=None, state_outputs=True, **op_extra):
    """The op (state_outputs, optionally training) against the reference; returns the op's
    (out, hy, cy) with cy None unless LSTM."""
    dtype = case["data"].dtype
    result = fusedrnn.RNN(**case, **kw, **feats, state_outputs=state_outputs, **op_extra)
    if op_extra.get("train"):
        assert isinstance(result[-1], fusedrnn.TrainingHandle)
        result = result[:-1]
        result = result[0] if len(result) == 1 else result
    outs = list(result) if state_outputs else [result]
    ref = rnn_reference(**case, **kw, **ref_args(feats), dropout_masks=masks)
    assert len(outs) == (3 if CELLS[kw["mode"]].has_cell_state and state_outputs else
                         2 if state_outputs else 1)
    for ours, theirs in zip(outs, ref):
        assert ours.dtype == dtype
        assert rel_err(ours, theirs) <= tolerance(dtype)
    return outs + [None] * (3 - len(outs))


def check_fd_gradients(case, kw, heads, feats, masks=None, **op_extra):
    """Every input's gradient from rnn_backward against FD of the reference (float64, on
    float64 copies of float32 inputs; float32 gradients to float32's tolerance)."""
    *_, handle = fusedrnn.RNN(**case, **kw, **feats, state_outputs=True, train=True, **op_extra)
    grads = fusedrnn.rnn_backward(handle, **heads)
    dtype = case["data"].dtype
    tol = FD_TOL if dtype == np.float64 else tolerance(dtype)
    case = {k: None if v is None else v.astype(np.float64) for k, v in case.items()}
    heads = {k: None if v is None else v.astype(np.float64) for k, v in heads.items()}
    head_list = [heads["dout"], heads["dhy"], heads.get("dcy")]

    def loss():
        return loss_reference(**case, heads=head_list, **kw, **ref_args(feats),
                              dropout_masks=masks)

    for name in GRADS:
        got = getattr(grads, name)
        if case[name] is None:
            assert got is None
            continue
        assert got.shape == case[name].shape and got.dtype == dtype
        assert rel_err(got, finite_difference(loss, case[name])) <= tol, name
    return grads


def clip_margin(case, kw, feats, masks=None):
    """(values clipped, values not clipped, least distance of any pre-clip c to a bound)."""
    trace = []
    rnn_reference(**case, **kw, **ref_args(feats), dropout_masks=masks, trace=trace)
    c = np.concatenate(trace)
    lo, hi = feats["lstm_state_clip_min"], feats["lstm_state_clip_max"]
    clipped = int(np.sum((c < lo) | (c > hi)))
    return clipped, c.size - clipped, float(np.min(np.minimum(np.abs(c - lo), np.abs(c - hi))))


# ---- a. sequence lengths --------------------------------------------------------------
LENS = [3, 5, 1, 4]  # T = 5, N = 4: ragged, unsorted, includes 1 and T


def lengths(dtype=np.int32):
    return dict(sequence_length=np.array(LENS, dtype=dtype), use_sequence_length=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_lengths_forward(mode, L, D, dtype):
    case, kw, _ = make_case(mode, T=5, N=4, I=4, H=5, L=L, D=D, dtype=dtype, seed=L + 5 * D)
    # both integer widths are accepted
    feats = lengths(np.int32 if dtype == np.float32 else np.int64)
    out, hy, cy = check_forward(case, kw, feats)
    for n, length in enumerate(LENS):  # exactly 0 past the length (buffers start NaN)
        assert not out[length:, n].any()
    out_only = fusedrnn.RNN(**case, **kw, **feats)
    assert np.array_equal(out_only, out)
    train_out, handle = fusedrnn.RNN(**case, **kw, **feats, train=True)
    assert np.array_equal(train_out, out)
    handle.release()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_lengths_gradients_fd(mode, L, D, dtype):
    case, kw, heads = make_case(mode, T=5, N=4, I=3, H=3, L=L, D=D, seed=20 + L + D,
                                dtype=dtype)
    grads = check_fd_gradients(case, kw, heads, lengths())
    for n, length in enumerate(LENS):  # steps past the length do not touch the loss
        assert not grads.data[length:, n].any()


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_lengths_match_torch_packed_sequence(mode, L, D):
    I, H = 4, 5
    case, kw, heads = make_case(mode, T=5, N=4, I=I, H=H, L=L, D=D, seed=30 + L + D)
    feats = lengths(np.int64)
    *outs, handle = fusedrnn.RNN(**case, **kw, **feats, state_outputs=True, train=True)
    grads = fusedrnn.rnn_backward(handle, **heads)
    module = loaded_module(case["parameters"], mode, I, H, L, D)
    theirs, t_grads = torch_run(module, mode, case, heads, feats["sequence_length"])
    for ours, t in zip(outs, theirs):  # out, hy (and cy)
        assert rel_err(ours, t) <= 1e-10
    for name in ("data", "state", "state_cell"):
        if case[name] is not None:
            assert rel_err(getattr(grads, name), t_grads[name]) <= 1e-10, name
    assert rel_err(grads.parameters, flat_grads(t_grads, mode, I, H, L, D)) <= 1e-10


# ---- b. projection --------------------------------------------------------------------
@pytest.mark.parametrize("state_outputs", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
def test_projection_forward(L, D, dtype, state_outputs):
    case, kw, _ = proj_case(T=5, N=3, I=4, H=6, P=3, L=L, D=D, dtype=dtype, seed=L + 3 * D)
    out, hy, cy = check_forward(case, kw, {}, state_outputs=state_outputs)
    assert out.shape == (5, 3, D * 3)
    if state_outputs:
        assert hy.shape == (L * D, 3, 3) and cy.shape == (L * D, 3, 6)
    zeros, _, _ = proj_case(T=5, N=3, I=4, H=6, P=3, L=L, D=D, dtype=dtype, states=False)
    check_forward(zeros, kw, {}, state_outputs=state_outputs)  # omitted states are zeros


def test_param_size_with_projection():
    for I, H, P, L, D in [(4, 6, 3, 1, 1), (4, 6, 3, 3, 2), (7, 5, 2, 2, 1), (3, 8, 5, 2, 2)]:
        expected = (D * 4 * H * (I + P + 2) + (L - 1) * D * 4 * H * (D * P + P + 2)
                    + L * D * P * H)
        assert fusedrnn.param_size(mode="lstm", input_size=I, state_size=H, num_layers=L,
                                   bidirectional=D == 2, projection_size=P) == expected


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
def test_projection_matches_torch(L, D):
    I, H, P = 4, 6, 3
    case, kw, heads = proj_case(T=5, N=3, I=I, H=H, P=P, L=L, D=D, seed=40 + L + D)
    *outs, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    grads = fusedrnn.rnn_backward(handle, **heads)
    theirs, t_grads = torch_run(loaded_module(case["parameters"], "lstm", I, H, L, D, P),
                                "lstm", case, heads)
    for ours, t in zip(outs, theirs):
        assert rel_err(ours, t) <= 1e-10
    for name in ("data", "state", "state_cell"):
        assert rel_err(getattr(grads, name), t_grads[name]) <= 1e-10, name
    assert rel_err(grads.parameters, flat_grads(t_grads, "lstm", I, H, L, D, P)) <= 1e-10


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2])
def test_projection_gradients_fd(L, D):
    case, kw, heads = proj_case(T=4, N=2, I=3, H=4, P=2, L=L, D=D, seed=50 + L + D)
    check_fd_gradients(case, kw, heads, {})


# ---- c. clipping ----------------------------------------------------------------------
CLIP = dict(lstm_state_clip_min=-0.2, lstm_state_clip_max=0.2)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2])
def test_clipping_forward(L, D, dtype):
    case, kw, _ = make_case("lstm", T=5, N=3, I=4, H=5, L=L, D=D, dtype=dtype, seed=60 + L + D)
    clipped, unclipped, margin = clip_margin(case, kw, CLIP)
    assert clipped > 0 and unclipped > 0  # the bounds bite, but not everywhere
    assert margin > 1e-5  # no float32-vs-float64 disagreement about which side of a bound
    _, _, cy = check_forward(case, kw, CLIP)
    assert np.abs(cy).max() <= 0.2


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2])
def test_clipping_gradients_fd(L, D):
    case, kw, heads = make_case("lstm", T=4, N=2, I=3, H=3, L=L, D=D, seed=70 + L + D)
    clipped, unclipped, margin = clip_margin(case, kw, CLIP)
    assert clipped > 0 and unclipped > 0
    assert margin > 1e-5  # else a +-eps step crosses the kink and FD is meaningless
    check_fd_gradients(case, kw, heads, CLIP)


def test_gradient_through_clipped_state_is_zero():
    """c0 reaches the loss only through the first step's c', which clips everywhere."""
    case, kw, heads = make_case("lstm", T=3, N=2, I=3, H=4, D=2, seed=80)
    case["state_cell"] = 50.0 * np.sign(case["state_cell"])
    trace = []
    rnn_reference(**case, **kw, clip_min=-0.2, clip_max=0.2, trace=trace)
    first_steps = [trace[(d * 2 + n) * 3] for d in range(2) for n in range(2)]
    assert np.abs(np.concatenate(first_steps)).min() > 0.2 + 1e-3
    *_, handle = fusedrnn.RNN(**case, **kw, **CLIP, state_outputs=True, train=True)
    grads = fusedrnn.rnn_backward(handle, **heads)
    assert np.array_equal(grads.state_cell, np.zeros_like(case["state_cell"]))
    assert np.abs(grads.state).max() > 1e-3  # while h0 still matters


@pytest.mark.parametrize("D", [1, 2])
def test_clip_nan(D):
    case, kw, _ = make_case("lstm", T=4, N=3, L=2, D=D, seed=90)
    case["state_cell"][0, 1, 2] = np.nan  # sample 1's first c' is NaN at one element
    nan_to_bound = dict(CLIP, lstm_state_clip_nan=True)
    outs = check_forward(case, kw, nan_to_bound)  # finite, NaN replaced by the bound
    assert all(np.isfinite(o).all() for o in outs)
    out, hy, cy = fusedrnn.RNN(**case, **kw, **CLIP, state_outputs=True)
    ref = rnn_reference(**case, **kw, **ref_args(CLIP))
    for ours, theirs in zip((out, hy, cy), ref):  # without clip_nan the NaN propagates
        assert np.array_equal(np.isnan(ours), np.isnan(theirs))
        ok = ~np.isnan(theirs)
        assert rel_err(ours[ok], theirs[ok]) <= 1e-10
    assert np.isnan(out[:, 1]).any() and not np.isnan(out[:, 0]).any()


# ---- d. dropout -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_dropout_training_matches_regenerated_masks(mode, L, D, dtype):
    T, N, H, p, seed = 5, 3, 5, 0.3, 1234 + L + D
    case, kw, _ = make_case(mode, T=T, N=N, I=4, H=H, L=L, D=D, dtype=dtype, seed=L + D)
    masks = dropout_masks(seed, p, T, N, D, H, L, dtype)
    outs = check_forward(case, kw, dict(p=p), masks=masks, train=True, seed=seed)
    plain = rnn_reference(**case, **kw)[0]
    assert rel_err(outs[0], plain) > 1e-3  # dropout did something


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_dropout_gradients_fd(mode, L, D):
    """Backward reuses the forward's masks: FD of the reference with those masks fixed."""
    T, N, H, p, seed = 4, 2, 3, 0.4, 77 + L
    case, kw, heads = make_case(mode, T=T, N=N, I=3, H=H, L=L, D=D, seed=100 + L + D)
    masks = dropout_masks(seed, p, T, N, D, H, L, np.float64)
    check_fd_gradients(case, kw, heads, dict(p=p), masks=masks, seed=seed)


def test_dropout_same_seed_identical_and_no_seed_differs():
    case, kw, heads = make_case("lstm", L=3, D=2, seed=5)

    def run(seed):
        out, hy, cy, handle = fusedrnn.RNN(**case, **kw, p=0.5, state_outputs=True,
                                           train=True, seed=seed)
        return (out, hy, cy) + tuple(fusedrnn.rnn_backward(handle, **heads))

    for a, b in zip(run(3), run(3)):
        assert np.array_equal(a, b)
    assert not np.array_equal(run(None)[0], run(None)[0])


def test_dropout_is_ignored_in_inference_and_p0_training():
    case, kw, _ = make_case("gru", L=3, D=2, seed=6)
    plain = fusedrnn.RNN(**case, **kw, state_outputs=True)
    for a, b in zip(fusedrnn.RNN(**case, **kw, p=0.5, seed=1, state_outputs=True), plain):
        assert np.array_equal(a, b)
    *training, handle = fusedrnn.RNN(**case, **kw, p=0.0, seed=1, state_outputs=True, train=True)
    for a, b in zip(training, plain):
        assert np.array_equal(a, b)
    handle.release()


def test_dropout_mask_statistics():
    """A 2-layer relu net built so that out == layer 1's mask: layer 0 outputs relu(b_x) = 1
    everywhere, layer 1 is the identity. The mask is the documented scheme, drops a fraction
    ~p and keeps the mean of the dropped input (1) by its 1/(1-p) scale."""
    T, N, H, D, p, seed = 100, 50, 10, 2, 0.3, 11
    flat = np.zeros(param_count("rnn_relu", 1, H, 2, D))
    blocks = split_params(flat, "rnn_relu", 1, H, 2, D)  # views into flat
    for d in range(D):
        blocks[d]["b_x"][...] = 1.0  # layer 0: all weights 0, so its output is relu(1) = 1
        blocks[D + d]["W_x"][:, d * H:(d + 1) * H] = np.eye(H)  # layer 1 copies its half
    data = np.random.default_rng(0).standard_normal((T, N, 1))
    out, handle = fusedrnn.RNN(data, flat, None, None, state_size=H, num_layers=2, mode="rnn_relu",
                               bidirectional=True, p=p, train=True, seed=seed)
    handle.release()
    assert np.array_equal(out, dropout_masks(seed, p, T, N, D, H, 2, np.float64)[0])
    assert out.size == 100_000 and abs(np.mean(out == 0) - p) <= 0.01
    assert abs(out.mean() - 1.0) <= 0.02  # std of the mean ~0.002
    assert np.all((out == 0) | (np.abs(out - 1 / (1 - p)) < 1e-15))


# ---- e. everything at once ------------------------------------------------------------
def test_projection_lengths_clipping_dropout_together():
    T, N, H, P, L, D, p, seed = 5, 4, 4, 2, 2, 2, 0.25, 5
    feats = dict(lengths(), lstm_state_clip_min=-0.3, lstm_state_clip_max=0.25, p=p)
    for dtype in (np.float32, np.float64):  # the float64 case is kept for the FD check
        case, kw, heads = proj_case(T=T, N=N, I=3, H=H, P=P, L=L, D=D, dtype=dtype, seed=12)
        masks = dropout_masks(seed, p, T, N, D, P, L, dtype)
        out, _, _ = check_forward(case, kw, feats, masks=masks, train=True, seed=seed)
        for n, length in enumerate(LENS):
            assert not out[length:, n].any()
    clipped, unclipped, margin = clip_margin(case, kw, feats, masks)
    assert clipped > 0 and unclipped > 0 and margin > 1e-5
    check_fd_gradients(case, kw, heads, feats, masks=masks, seed=seed)


# ---- f. invalid inputs ----------------------------------------------------------------
CASE, KW, _ = make_case("lstm", T=4, N=3, L=2)


def as_mode(mode):
    """Changes that make CASE a valid call of another mode, so only the feature is wrong."""
    return dict(mode=mode, state_cell=None,
                parameters=make_case(mode, T=4, N=3, L=2)[0]["parameters"])


BAD = [
    (dict(as_mode("gru"), projection_size=3), ValueError, "projection_size"),
    (dict(as_mode("rnn_tanh"), projection_size=3), ValueError, "projection_size"),
    (dict(lstm_state_clip_min=0.5, lstm_state_clip_max=-0.5), ValueError, "lstm_state_clip_min"),
    (dict(lstm_state_clip_min=-0.5), ValueError, "lstm_state_clip"),
    (dict(lstm_state_clip_max=0.5), ValueError, "lstm_state_clip"),
    (dict(as_mode("gru"), **CLIP), ValueError, "lstm_state_clip"),
    (dict(sequence_length=np.array([1, 0, 4], np.int32), use_sequence_length=True), ValueError,
     "sequence_length"),
    (dict(sequence_length=np.array([1, 5, 4], np.int32), use_sequence_length=True), ValueError,
     "sequence_length"),
    (dict(sequence_length=np.array([1.0, 2.0, 4.0]), use_sequence_length=True), TypeError,
     "sequence_length"),
    (dict(sequence_length=np.array([1, 2], np.int32), use_sequence_length=True), ValueError,
     "sequence_length"),
    (dict(sequence_length=np.ones((3, 1), np.int32), use_sequence_length=True), ValueError,
     "sequence_length"),
    (dict(use_sequence_length=True), ValueError, "sequence_length"),
    (dict(p=1.0, train=True), ValueError, r"\bp\b"),
    (dict(p=-0.1, train=True), ValueError, r"\bp\b"),
]


def _id(changes):
    return ",".join(f"{k}={np.asarray(v).tolist() if k == 'sequence_length' else v}"
                    for k, v in changes.items() if k not in ("parameters", "state_cell"))


@pytest.mark.parametrize("changes, error, match", BAD, ids=[_id(c) for c, _, _ in BAD])
def test_invalid_feature_arguments_raise(changes, error, match):
    args = dict(CASE, **KW)
    args.update(changes)
    with pytest.raises(error, match=match):
        fusedrnn.RNN(**args)
