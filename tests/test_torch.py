"""fusedrnn.RNN against torch.nn.RNN/LSTM/GRU with the same weights (state_dict mapped)."""
import numpy as np
import pytest

import fusedrnn
from conftest import CELLS, MODES, make_case, rel_err, tolerance
from torch_ref import torch_module

import torch  # noqa: E402  (installed by the `test` extra)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_matches_torch_forward_and_backward(mode, L, D, dtype):
    T, N, I, H = 6, 4, 5, 7
    case, kw, heads = make_case(mode, T=T, N=N, I=I, H=H, L=L, D=D, dtype=dtype, seed=L + 3 * D)
    module = torch_module(mode, I, H, L, D, dtype=dtype)
    layout = fusedrnn.param_layout(mode=mode, input_size=I, state_size=H, num_layers=L,
                                   bidirectional=D == 2)
    module.load_state_dict({k: torch.from_numpy(v)
                            for k, v in layout.to_torch_state_dict(case["parameters"]).items()})

    *outs, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    grads = fusedrnn.rnn_backward(handle, **heads)

    x = torch.from_numpy(case["data"]).requires_grad_()
    h0 = torch.from_numpy(case["state"]).requires_grad_()
    if CELLS[mode].has_cell_state:
        c0 = torch.from_numpy(case["state_cell"]).requires_grad_()
        t_out, (t_hy, t_cy) = module(x, (h0, c0))
        t_outs = (t_out, t_hy, t_cy)
    else:
        t_out, t_hy = module(x, h0)
        t_outs = (t_out, t_hy)
    loss = sum((o * torch.from_numpy(heads[k])).sum() for o, k in zip(t_outs, ("dout", "dhy", "dcy")))
    loss.backward()

    tol = tolerance(dtype)
    for ours, theirs in zip(outs, t_outs):
        assert rel_err(ours, theirs.detach().numpy()) <= tol
    assert rel_err(grads.data, x.grad.numpy()) <= tol
    assert rel_err(grads.state, h0.grad.numpy()) <= tol
    if CELLS[mode].has_cell_state:
        assert rel_err(grads.state_cell, c0.grad.numpy()) <= tol
    torch_grads = {k: p.grad.numpy() for k, p in module.named_parameters()}
    assert rel_err(grads.parameters, layout.from_torch_state_dict(torch_grads)) <= tol
