"""torch.nn as a second opinion: modules loaded from a flat parameter vector (through the
reference's own slicing), run plain or through a PackedSequence, with autograd."""
import numpy as np
import torch

from fusedrnn.config import CELLS

from reference import join_params, to_torch_names


def torch_module(mode, I, H, L, D, P=None, dtype=np.float64):
    common = dict(input_size=I, hidden_size=H, num_layers=L, bidirectional=D == 2)
    cell = CELLS[mode]
    if cell.projection:
        common["proj_size"] = P or 0
    module = cell.torch_module(torch.nn, **common)
    return module.to(torch.float64 if np.dtype(dtype) == np.float64 else torch.float32)


def loaded_module(params, mode, I, H, L, D, P=None):
    """A torch module of params' dtype whose weights are the flat vector `params`."""
    module = torch_module(mode, I, H, L, D, P, params.dtype)
    named = to_torch_names(params, mode, I, H, L, D, P)
    assert set(named) == set(dict(module.named_parameters())), "layout names differ from torch"
    module.load_state_dict({k: torch.from_numpy(v.astype(params.dtype)) for k, v in named.items()})
    return module


def torch_run(module, mode, case, heads=None, lengths=None):
    """Forward (and, given heads, backward of sum(out*dout)+sum(hy*dhy)+sum(cy*dcy)).

    case: data, state, state_cell arrays (the op's shapes). With `lengths`, the sequence
    goes through pack_padded_sequence(enforce_sorted=False) and comes back padded with 0.
    Returns ([out, hy, cy], grads) with cy None unless LSTM; grads is None without heads,
    else {"data", "state", "state_cell", "parameters": {torch name: array}}.
    """
    T = case["data"].shape[0]
    train = heads is not None
    x = torch.from_numpy(case["data"]).requires_grad_(train)
    h0 = torch.from_numpy(case["state"]).requires_grad_(train)
    c0 = (torch.from_numpy(case["state_cell"]).requires_grad_(train)
          if CELLS[mode].has_cell_state else None)
    inp = x
    if lengths is not None:
        inp = torch.nn.utils.rnn.pack_padded_sequence(x, torch.as_tensor(np.asarray(lengths)),
                                                      enforce_sorted=False)
    with torch.set_grad_enabled(train):
        if CELLS[mode].has_cell_state:
            out, (hy, cy) = module(inp, (h0, c0))
        else:
            (out, hy), cy = module(inp, h0), None
        if lengths is not None:
            out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=T)
    outs = [out, hy, cy]
    grads = None
    if train:
        loss = sum((o * torch.from_numpy(heads[k])).sum()
                   for o, k in zip(outs, ("dout", "dhy", "dcy"))
                   if o is not None and heads.get(k) is not None)
        loss.backward()
        grads = dict(data=x.grad.numpy(), state=h0.grad.numpy(),
                     state_cell=None if c0 is None else c0.grad.numpy(),
                     parameters={k: p.grad.numpy() for k, p in module.named_parameters()})
    return [None if o is None else o.detach().numpy() for o in outs], grads


def flat_grads(grads, mode, I, H, L, D, P=None):
    """torch's parameter gradients as one flat vector in the spec's layout."""
    return join_params(grads["parameters"], mode, I, H, L, D, P)
