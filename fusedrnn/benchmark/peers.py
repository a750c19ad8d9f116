"""Who fusedrnn is measured against. Each peer turns a Case into a zero-argument callable
that runs one call (inference, or forward + backward), or returns None where it has no
such mode (the naive loops have no backward)."""
from __future__ import annotations

import numpy as np

import fusedrnn


class Inputs:
    """Random inputs (never zeros) for one case on one device, shared by every peer."""

    def __init__(self, case, xp, dtype, seed=0):
        rng = np.random.default_rng(seed)
        self.case, self.xp = case, xp
        self.layout = fusedrnn.param_layout(mode=case.mode, input_size=case.I,
                                            state_size=case.H, num_layers=case.L,
                                            bidirectional=case.bidirectional)
        scale = case.H ** -0.5
        host = {
            "data": rng.standard_normal((case.T, case.N, case.I)).astype(dtype),
            "params": rng.uniform(-scale, scale, self.layout.size).astype(dtype),
            "dout": rng.standard_normal((case.T, case.N, case.D * case.H)).astype(dtype),
        }
        self.host = host
        for name, value in host.items():
            setattr(self, name, xp.asarray(value))


def fusedrnn_peer(inputs):
    c = inputs.case
    kw = dict(state_size=c.H, num_layers=c.L, mode=c.mode, bidirectional=c.bidirectional)
    if not c.train:
        return lambda: fusedrnn.RNN(inputs.data, inputs.params, **kw)

    def step():
        out, handle = fusedrnn.RNN(inputs.data, inputs.params, **kw, train=True)
        return fusedrnn.rnn_backward(handle, inputs.dout)
    return step


def torch_peer(inputs, device):
    import torch
    c = inputs.case
    cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}.get(c.mode, torch.nn.RNN)
    extra = {} if c.mode in ("lstm", "gru") else {"nonlinearity": c.mode[4:]}
    dtype = torch.float64 if inputs.host["data"].dtype == np.float64 else torch.float32
    module = cls(c.I, c.H, num_layers=c.L, bidirectional=c.bidirectional, **extra)
    module = module.to(device=device, dtype=dtype)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in
                            inputs.layout.to_torch_state_dict(inputs.host["params"]).items()})
    x = torch.from_numpy(inputs.host["data"]).to(device)
    if not c.train:
        def infer():
            with torch.no_grad():
                return module(x)
        return infer
    x.requires_grad_(True)
    dout = torch.from_numpy(inputs.host["dout"]).to(device)

    def train():
        module.zero_grad(set_to_none=True)
        x.grad = None
        out = module(x)[0]
        (out * dout).sum().backward()
    return train


def naive_peer(inputs, hoisted):
    """The textbook loop: per step x[t] @ W_x.T + h @ W_h.T and the cell in array ops;
    `hoisted` computes every step's x @ W_x.T in one GEMM first."""
    if inputs.case.train:
        return None
    return lambda: naive_forward(inputs, hoisted)


def naive_forward(inputs, hoisted):
    xp, c, lay, params = inputs.xp, inputs.case, inputs.layout, inputs.params
    x = inputs.data
    for layer in range(c.L):
        outs = []
        for d in range(c.D):
            wx, wh, bx, bh = (lay.view(params, layer, d, k) for k in ("W_x", "W_h", "b_x", "b_h"))
            h = xp.zeros((c.N, c.H), x.dtype)
            cell = xp.zeros_like(h)
            y = xp.empty((c.T, c.N, c.H), x.dtype)
            gx_all = (x.reshape(c.T * c.N, -1) @ wx.T + bx).reshape(c.T, c.N, -1) if hoisted else None
            for t in (range(c.T) if d == 0 else range(c.T - 1, -1, -1)):
                gx = gx_all[t] if hoisted else x[t] @ wx.T + bx
                h, cell = _naive_cell(xp, c.mode, gx, h @ wh.T + bh, h, cell)
                y[t] = h
            outs.append(y)
        x = xp.concatenate(outs, axis=2) if c.D == 2 else outs[0]
    return x


def _naive_cell(xp, mode, gx, gh, h, c):
    sigmoid = lambda v: 1 / (1 + xp.exp(-v))  # noqa: E731
    if mode == "lstm":
        i, f, g, o = xp.split(gx + gh, 4, axis=1)
        c = sigmoid(f) * c + sigmoid(i) * xp.tanh(g)
        return sigmoid(o) * xp.tanh(c), c
    if mode == "gru":
        xr, xz, xn = xp.split(gx, 3, axis=1)
        hr, hz, hn = xp.split(gh, 3, axis=1)
        r, z = sigmoid(xr + hr), sigmoid(xz + hz)
        n = xp.tanh(xn + r * hn)
        return (1 - z) * n + z * h, c
    a = gx + gh
    return (xp.maximum(a, 0) if mode == "rnn_relu" else xp.tanh(a)), c
