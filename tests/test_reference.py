"""The float64 reference itself (tests/reference.py), checked where it can be against torch:
projection against nn.LSTM(proj_size=...), sequence lengths against PackedSequence,
dropout masks against single-layer torch modules stacked by hand. Clipping has no torch
counterpart; it is checked by hand on one step and by its invariants."""
import numpy as np
import pytest
import torch

from conftest import CELLS, MODES, make_case
from reference import (
    finite_difference,
    join_params,
    loss_reference,
    param_count,
    rnn_reference,
    sigmoid,
    split_params,
    to_torch_names,
)
from torch_ref import loaded_module, torch_module, torch_run

TOL = 1e-12  # both sides are float64 with the same math; only summation order differs


def max_rel(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-300)


def run_torch(module, mode, case, lengths=None):
    outs, _ = torch_run(module, mode, case, lengths=lengths)
    return outs


def proj_case(T, N, I, H, P, L, D, seed):
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(H)
    return dict(data=rng.standard_normal((T, N, I)),
                parameters=rng.uniform(-scale, scale, param_count("lstm", I, H, L, D, P)),
                state=0.5 * rng.standard_normal((L * D, N, P)),
                state_cell=0.5 * rng.standard_normal((L * D, N, H)))


def test_param_count_and_layout_round_trip():
    assert param_count("lstm", 4, 6, 1, 1) == 288  # the spec's example
    for mode in MODES:
        flat = np.arange(param_count(mode, 3, 4, 2, 2), dtype=np.float64)
        assert np.array_equal(join_params(to_torch_names(flat, mode, 3, 4, 2, 2), mode, 3, 4, 2, 2),
                              flat)
    flat = np.arange(param_count("lstm", 3, 4, 3, 2, P=2), dtype=np.float64)
    blocks = split_params(flat, "lstm", 3, 4, 3, 2, P=2)
    # the spec's order: W_x, W_h, W_r for each (l, d), then all biases
    assert blocks[0]["W_x"].shape == (16, 3) and blocks[0]["W_h"].shape == (16, 2)
    assert blocks[0]["W_r"].shape == (2, 4) and blocks[2]["W_x"].shape == (16, 4)
    assert blocks[1]["W_x"][0, 0] == 16 * 3 + 16 * 2 + 2 * 4
    assert np.array_equal(join_params(to_torch_names(flat, "lstm", 3, 4, 3, 2, 2),
                                      "lstm", 3, 4, 3, 2, 2), flat)


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
def test_projection_matches_torch(L, D):
    T, N, I, H, P = 5, 3, 4, 6, 3
    case = proj_case(T, N, I, H, P, L, D, seed=L * 10 + D)
    module = loaded_module(case["parameters"], "lstm", I, H, L, D, P)
    ours = rnn_reference(**case, mode="lstm", state_size=H, num_layers=L, bidirectional=D == 2,
                         projection_size=P)
    theirs = run_torch(module, "lstm", case)
    assert ours[0].shape == (T, N, D * P) and ours[1].shape == (L * D, N, P)
    assert ours[2].shape == (L * D, N, H)
    for a, b in zip(ours, theirs):
        assert max_rel(a, b) <= TOL


LENGTHS = [5, 1, 3, 5, 2]  # ragged, unsorted, includes 1 and T


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_sequence_lengths_match_torch_packed(mode, L, D):
    T, N, I, H = 5, len(LENGTHS), 4, 5
    case, kw, _ = make_case(mode, T=T, N=N, I=I, H=H, L=L, D=D, seed=L + 3 * D)
    module = loaded_module(case["parameters"], mode, I, H, L, D)
    lengths = np.array(LENGTHS)
    ours = rnn_reference(**case, **kw, sequence_length=lengths)
    theirs = run_torch(module, mode, case, lengths)
    for a, b in zip(ours, theirs):
        assert (a is None and b is None) or max_rel(a, b) <= TOL
    for n, length in enumerate(LENGTHS):  # past its length a sample's output is exactly 0
        assert not ours[0][length:, n].any()


@pytest.mark.parametrize("D", [1, 2])
def test_sequence_lengths_with_projection_match_torch(D):
    T, N, I, H, P, L = 5, len(LENGTHS), 4, 6, 2, 2
    case = proj_case(T, N, I, H, P, L, D, seed=5 + D)
    module = loaded_module(case["parameters"], "lstm", I, H, L, D, P)
    lengths = np.array(LENGTHS, dtype=np.int32)
    ours = rnn_reference(**case, mode="lstm", state_size=H, num_layers=L, bidirectional=D == 2,
                         projection_size=P, sequence_length=lengths)
    theirs = run_torch(module, "lstm", case, lengths)
    for a, b in zip(ours, theirs):
        assert max_rel(a, b) <= TOL


def test_full_lengths_equal_no_lengths():
    case, kw, _ = make_case("gru", T=4, N=3, L=2, D=2)
    full = rnn_reference(**case, **kw, sequence_length=np.full(3, 4))
    for a, b in zip(full, rnn_reference(**case, **kw)):
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_dropout_masks_match_stacked_torch_layers(mode, D):
    """Layer l+1 reads layer l's output times mask l; hy/cy and the top output are undropped."""
    T, N, I, H, L = 4, 3, 4, 5, 3
    case, kw, _ = make_case(mode, T=T, N=N, I=I, H=H, L=L, D=D, seed=D)
    rng = np.random.default_rng(1)
    masks = [(rng.random((T, N, D * H)) >= 0.4) / 0.6 for _ in range(L - 1)]
    ours = rnn_reference(**case, **kw, dropout_masks=masks)
    x, hy, cy = case["data"], [], []
    for layer in range(L):
        n_in = I if layer == 0 else D * H
        params = split_params(case["parameters"], mode, I, H, L, D)[layer * D:(layer + 1) * D]
        named = {f"{base}_l0{'_reverse' if d else ''}": torch.from_numpy(np.array(p[kind]))
                 for d, p in enumerate(params)
                 for kind, base in (("W_x", "weight_ih"), ("W_h", "weight_hh"),
                                    ("b_x", "bias_ih"), ("b_h", "bias_hh"))}
        module = torch_module(mode, n_in, H, 1, D)
        module.load_state_dict(named)
        s = slice(layer * D, (layer + 1) * D)
        out, h, c = run_torch(module, mode, dict(
            data=x, state=case["state"][s],
            state_cell=case["state_cell"][s] if CELLS[mode].has_cell_state else None))
        hy.append(h)
        cy.append(c)
        x = out * masks[layer] if layer < L - 1 else out
    assert max_rel(ours[0], x) <= TOL
    assert max_rel(ours[1], np.concatenate(hy)) <= TOL
    if CELLS[mode].has_cell_state:
        assert max_rel(ours[2], np.concatenate(cy)) <= TOL
    all_ones = rnn_reference(**case, **kw, dropout_masks=[np.ones((T, N, D * H))] * (L - 1))
    assert np.array_equal(all_ones[0], rnn_reference(**case, **kw)[0])


def test_clipping_one_step_by_hand():
    """T=1: c' = clip(f*c0 + i*g), h' = o*tanh(c'), written out with whole-batch numpy."""
    case, kw, _ = make_case("lstm", T=1, N=4, I=3, H=5, seed=2)
    case["state_cell"] *= 4  # so that c' exceeds the bounds on both sides
    lo, hi = -0.2, 0.3
    out, hy, cy = rnn_reference(**case, **kw, clip_min=lo, clip_max=hi)
    (w,) = split_params(case["parameters"], "lstm", 3, 5, 1, 1)
    a = case["data"][0] @ w["W_x"].T + w["b_x"] + case["state"][0] @ w["W_h"].T + w["b_h"]
    i, f, g, o = sigmoid(a[:, :5]), sigmoid(a[:, 5:10]), np.tanh(a[:, 10:15]), sigmoid(a[:, 15:])
    c = f * case["state_cell"][0] + i * g
    assert (c < lo).any() and (c > hi).any() and ((c > lo) & (c < hi)).any()
    c = np.clip(c, lo, hi)
    assert max_rel(cy[0], c) <= TOL
    assert max_rel(hy[0], o * np.tanh(c)) <= TOL and np.array_equal(out[0], hy[0])


def test_clipping_invariants():
    case, kw, _ = make_case("lstm", T=6, N=3, L=2, D=2, seed=4)
    plain = rnn_reference(**case, **kw)
    wide = rnn_reference(**case, **kw, clip_min=-1e6, clip_max=1e6)
    for a, b in zip(plain, wide):
        assert np.array_equal(a, b)
    trace = []
    clipped = rnn_reference(**case, **kw, clip_min=-0.1, clip_max=0.1, trace=trace)
    assert len(trace) == 6 * 3 * 2 * 2 and np.abs(np.concatenate(trace)).max() > 0.1
    assert np.abs(clipped[2]).max() <= 0.1 and not np.allclose(clipped[0], plain[0])


def test_clip_nan():
    """A NaN in c' becomes clip_min with clip_nan=True, and propagates without it."""
    case, kw, _ = make_case("lstm", T=1, N=2, L=1, seed=6)
    case["state_cell"][0, 1, 2] = np.nan  # c' = f*NaN + i*g is NaN at this element
    out, hy, cy = rnn_reference(**case, **kw, clip_min=-0.5, clip_max=0.5, clip_nan=True)
    assert cy[0, 1, 2] == -0.5 and np.isfinite(out).all() and np.isfinite(hy).all()
    case, kw, _ = make_case("lstm", T=3, N=2, L=2, D=2, seed=6)
    case["state_cell"][0, 1, 2] = np.nan
    out, hy, cy = rnn_reference(**case, **kw, clip_min=-0.5, clip_max=0.5, clip_nan=True)
    assert np.isfinite(out).all() and np.isfinite(hy).all() and np.isfinite(cy).all()
    out, hy, cy = rnn_reference(**case, **kw, clip_min=-0.5, clip_max=0.5)
    # sample 1's forward chain is NaN and feeds both directions of layer 1; sample 0 is clean
    assert np.isnan(out[:, 1]).all() and np.isfinite(out[:, 0]).all()


@pytest.mark.parametrize("mode", MODES)
def test_finite_differences_with_lengths_and_projection_match_torch_autograd(mode):
    """The FD gradients test_features.py trusts, against torch autograd (lengths, projection)."""
    T, N, I, H, L, D = 4, 3, 3, 4, 2, 2
    P = 2 if CELLS[mode].projection else None
    if P:
        case = proj_case(T, N, I, H, P, L, D, seed=9)
    else:
        case, _, _ = make_case(mode, T=T, N=N, I=I, H=H, L=L, D=D, seed=9)
    R = P or H
    rng = np.random.default_rng(10)
    heads = dict(dout=rng.standard_normal((T, N, D * R)), dhy=rng.standard_normal((L * D, N, R)),
                 dcy=rng.standard_normal((L * D, N, H)) if CELLS[mode].has_cell_state else None)
    lengths = np.array([2, 4, 1])
    kw = dict(mode=mode, state_size=H, num_layers=L, bidirectional=True, projection_size=P,
              sequence_length=lengths)
    _, grads = torch_run(loaded_module(case["parameters"], mode, I, H, L, D, P), mode, case,
                         heads, lengths)

    def loss():
        return loss_reference(**case, heads=[heads["dout"], heads["dhy"], heads["dcy"]], **kw)

    theirs = dict(grads, parameters=join_params(grads["parameters"], mode, I, H, L, D, P))
    for name in ("data", "parameters", "state", "state_cell"):
        if case.get(name) is not None:
            assert max_rel(finite_difference(loss, case[name]), theirs[name]) <= 1e-7, name
