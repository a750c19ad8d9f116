"""The flat parameter layout: sizes, views, and torch state_dict conversion."""
import numpy as np
import pytest
import torch  # noqa: E402  (installed by the `test` extra)

import fusedrnn

from conftest import CELLS, MODES, param_count


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("L", [1, 2, 5])
@pytest.mark.parametrize("mode", MODES)
def test_param_size_is_mxnets_formula(mode, L, bidirectional):
    D = 2 if bidirectional else 1
    got = fusedrnn.param_size(mode=mode, input_size=7, state_size=3, num_layers=L,
                              bidirectional=bidirectional)
    assert got == param_count(mode, 7, 3, L, D)


def test_spec_example():
    assert fusedrnn.param_size(mode="lstm", input_size=4, state_size=6) == 288


def test_views_tile_the_vector_in_spec_order():
    layout = fusedrnn.param_layout(mode="gru", input_size=4, state_size=3, num_layers=2,
                                   bidirectional=True)
    flat = np.arange(layout.size, dtype=np.float64)
    views = layout.views(flat)
    # weights of all (layer, direction) first, then biases, each block contiguous
    order = [(0, 0, "W_x"), (0, 0, "W_h"), (0, 1, "W_x"), (0, 1, "W_h"), (1, 0, "W_x"),
             (1, 0, "W_h"), (1, 1, "W_x"), (1, 1, "W_h"), (0, 0, "b_x"), (0, 0, "b_h"),
             (0, 1, "b_x"), (0, 1, "b_h"), (1, 0, "b_x"), (1, 0, "b_h"), (1, 1, "b_x"),
             (1, 1, "b_h")]
    assert list(views) == order
    assert np.array_equal(np.concatenate([views[k].ravel() for k in order]), flat)
    assert views[(1, 0, "W_x")].shape == (9, 6)      # layer 1 reads D*H features
    assert views[(0, 1, "W_h")].shape == (9, 3)
    views[(0, 0, "b_h")][0] = -1                      # views, not copies
    assert flat[layout.blocks[(0, 0, "b_h")][0]] == -1


@pytest.mark.parametrize("mode", MODES)
def test_torch_state_dict_round_trip(mode):
    module = CELLS[mode].torch_module(torch.nn, input_size=5, hidden_size=4, num_layers=2,
                                      bidirectional=True)
    layout = fusedrnn.param_layout(mode=mode, input_size=5, state_size=4, num_layers=2,
                                   bidirectional=True)
    flat = layout.from_torch_state_dict(module.state_dict())
    assert flat.shape == (layout.size,) and flat.dtype == np.float32
    back = layout.to_torch_state_dict(flat)
    assert set(back) == set(module.state_dict())
    for name, value in module.state_dict().items():
        assert np.array_equal(back[name], value.numpy())


def test_torch_module_without_bias_gives_zero_biases():
    module = torch.nn.GRU(input_size=3, hidden_size=2, bias=False)
    layout = fusedrnn.param_layout(mode="gru", input_size=3, state_size=2)
    flat = layout.from_torch_state_dict(module.state_dict())
    assert np.count_nonzero(layout.view(flat, 0, 0, "b_x")) == 0
    assert np.array_equal(layout.view(flat, 0, 0, "W_h"), module.weight_hh_l0.detach().numpy())


def test_state_dict_mismatch_names_the_problem():
    layout = fusedrnn.param_layout(mode="lstm", input_size=3, state_size=2)
    module = torch.nn.LSTM(input_size=3, hidden_size=2, num_layers=2)
    with pytest.raises(ValueError, match="unexpected.*weight_ih_l1"):
        layout.from_torch_state_dict(module.state_dict())
    wrong = torch.nn.LSTM(input_size=4, hidden_size=2).state_dict()
    with pytest.raises(ValueError, match=r"weight_ih_l0.*expected shape \(8, 3\)"):
        layout.from_torch_state_dict(wrong)
