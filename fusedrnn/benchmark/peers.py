"""Who fusedrnn is measured against. Each peer turns a Case into a zero-argument callable
that runs one call (inference, or forward + backward), or returns None where it has no
such mode (the naive loops have no backward). A train-step case's callable is a whole
training step through the torch modules; its peer also carries a `neighbour`: torch ops
of the program's own, timed apart."""
from __future__ import annotations

import numpy as np

import fusedrnn

from ..config import CELLS

# Peers of the op: fusedrnn's call, torch.nn's module, the textbook loops.
OP_PEERS = ("fusedrnn", "torch", "torch-strict", "naive", "naive-hoisted")
# torch.nn's float32 RNNs on CUDA run cuDNN with TF32 tensor cores allowed by default
# (torch.backends.cudnn.allow_tf32): "torch" is that default, "torch-strict" the same
# module with TF32 off, the same math as fusedrnn's float32 (the fair anchor). Elsewhere
# (the CPU, other dtypes) the flag changes nothing and the strict peer does not run.
STRICT = "torch-strict"
# The train-step group has two: fusedrnn.torch's module and torch.nn's, in the same model.
STEP_PEERS = ("fusedrnn", "torch")
# --dtype names numpy spells through ml_dtypes (the CPU's half precision: fusedrnn takes
# ml_dtypes.bfloat16 arrays, torch its own bfloat16).
HALF_DTYPES = ("bfloat16",)


def numpy_dtype(name):
    if name in HALF_DTYPES:
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def to_torch(array):
    """A host array as a torch tensor (bfloat16 through its bits: torch.from_numpy has
    no ml_dtypes)."""
    import torch
    if array.dtype.name in HALF_DTYPES:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(
            getattr(torch, array.dtype.name))
    return torch.from_numpy(array)


class Inputs:
    """Random inputs (never zeros) for one case on one device, shared by every peer."""

    def __init__(self, case, xp, dtype, seed=0):
        rng = np.random.default_rng(seed)
        self.case, self.xp = case, xp
        self.layout = fusedrnn.param_layout(mode=case.mode, input_size=case.I,
                                            state_size=case.H, num_layers=case.L,
                                            bidirectional=case.bidirectional)
        scale = case.H ** -0.5
        dtype = numpy_dtype(dtype)
        host = {
            "data": rng.standard_normal((case.T, case.N, case.I)).astype(dtype),
            "params": rng.uniform(-scale, scale, self.layout.size).astype(dtype),
            "dout": rng.standard_normal((case.T, case.N, case.D * case.H)).astype(dtype),
        }
        self.host = host
        for name, value in host.items():
            setattr(self, name, xp.asarray(value))


def make(name, case, xp, dtype, torch_device):
    """The callable of peer `name` for `case`, or None where the peer has no such mode."""
    if case.model:
        return train_step(name, case, torch_device)
    inputs = Inputs(case, xp, dtype)
    if name == "fusedrnn":
        return fusedrnn_peer(inputs)
    if name == "torch":
        return torch_peer(inputs, torch_device)
    if name == STRICT:
        return torch_peer(inputs, torch_device, strict=True) if strict_differs(
            torch_device, dtype) else None
    return naive_peer(inputs, hoisted=name == "naive-hoisted")


def fusedrnn_peer(inputs):
    c = inputs.case
    kw = dict(state_size=c.H, num_layers=c.L, mode=c.mode, bidirectional=c.bidirectional)
    if not c.train:
        return lambda: fusedrnn.RNN(inputs.data, inputs.params, **kw)

    def step():
        out, handle = fusedrnn.RNN(inputs.data, inputs.params, **kw, train=True)
        return fusedrnn.rnn_backward(handle, inputs.dout)
    return step


def torch_module(mode, *args, fused=False, **kwargs):
    """torch.nn's RNN/LSTM/GRU for `mode`, or fusedrnn.torch's drop-in with `fused`."""
    if fused:
        import fusedrnn.torch as nn
    else:
        from torch import nn
    return CELLS[mode].torch_module(nn, *args, **kwargs)


def strict_differs(torch_device, dtype):
    """Whether torch's TF32 switch changes torch.nn's math for this device and dtype."""
    return torch_device == "cuda" and numpy_dtype(dtype) == np.float32


def torch_peer(inputs, device, strict=False):
    """torch.nn's module on `device`; strict: with cuDNN's TF32 off in this (the peer's
    own) process, set before the first call."""
    import torch
    if strict:   # (the flag sets cuDNN's fp32 precision to IEEE for its RNNs and convs
        torch.backends.cudnn.allow_tf32 = False   # alike; the per-op setting alone would
        torch.backends.cuda.matmul.allow_tf32 = False   # leave the flag unreadable)
    c = inputs.case
    dtype = getattr(torch, inputs.host["data"].dtype.name)   # the peers' dtype
    module = torch_module(c.mode, c.I, c.H, num_layers=c.L, bidirectional=c.bidirectional)
    module = module.to(device=device, dtype=dtype)
    module.load_state_dict({k: to_torch(v) for k, v in
                            inputs.layout.to_torch_state_dict(inputs.host["params"]).items()})
    x = to_torch(inputs.host["data"]).to(device)
    if not c.train:
        def infer():
            with torch.no_grad():
                return module(x)
        return infer
    x.requires_grad_(True)
    dout = to_torch(inputs.host["dout"]).to(device)

    def train():
        module.zero_grad(set_to_none=True)
        x.grad = None
        out = module(x)[0]
        (out * dout).sum().backward()
    return train


# The head's classes (a tagger's tag set, say) and the neighbour's output width.
HEAD_CLASSES = 32
NEIGHBOUR_WIDTH = 512


class TrainStep:
    """One model's training step, a callable, with `neighbour`: a torch Linear + loss,
    forward and backward, on features of the RNN output's shape, that the loop runs after
    each step and times apart (the runner asks for it)."""

    def __init__(self, peer, case, device):
        import torch
        gen = torch.Generator().manual_seed(0)
        width = case.D * case.H
        shape = (case.mode, case.I, case.H)
        kw = dict(num_layers=case.L, bidirectional=case.bidirectional)
        torch.manual_seed(0)  # both peers start from torch.nn's initial weights
        self.rnn = torch_module(*shape, **kw)
        self.head = torch.nn.Linear(width, HEAD_CLASSES)
        if peer == "fusedrnn":
            fused = torch_module(*shape, **kw, fused=True)
            fused.load_state_dict(self.rnn.state_dict())
            self.rnn = fused
        self.rnn.to(device)
        self.head.to(device)
        params = list(self.rnn.parameters()) + list(self.head.parameters())
        self.opt = torch.optim.Adam(params, lr=1e-3)
        self.x = torch.randn(case.T, case.N, case.I, generator=gen).to(device)
        self.y = torch.randint(0, HEAD_CLASSES, (case.T * case.N,), generator=gen).to(device)
        self.features = torch.randn(case.T * case.N, width, generator=gen).to(device)
        self.other = torch.nn.Linear(width, NEIGHBOUR_WIDTH).to(device)
        self.other_y = torch.randint(0, NEIGHBOUR_WIDTH, (case.T * case.N,),
                                     generator=gen).to(device)
        self.loss = torch.nn.functional.cross_entropy

    def __call__(self):
        self.opt.zero_grad(set_to_none=True)
        out = self.rnn(self.x)[0]
        loss = self.loss(self.head(out.reshape(-1, out.shape[-1])), self.y)
        loss.backward()
        self.opt.step()
        return loss

    def neighbour(self):
        self.other.zero_grad(set_to_none=True)
        self.loss(self.other(self.features), self.other_y).backward()


def train_step(peer, case, device):
    return TrainStep(peer, case, device) if peer in STEP_PEERS else None


def naive_peer(inputs, hoisted):
    """The textbook loop: per step x[t] @ W_x.T + h @ W_h.T and the cell in array ops;
    `hoisted` computes every step's x @ W_x.T in one GEMM first. Inference of one layer
    only: it has no backward, and its multi-layer figures cost minutes and say nothing
    the single-layer ones do not. None in bfloat16 (ml_dtypes' arithmetic is element by
    element in Python's speed class: not a loop anyone runs)."""
    if (inputs.case.train or inputs.case.L > 1 or inputs.case.mode not in NAIVE_CELLS or
            inputs.host["data"].dtype.name in HALF_DTYPES):   # numpy has no bfloat16 math
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
                h, cell = NAIVE_CELLS[c.mode](xp, gx, h @ wh.T + bh, h, cell)
                y[t] = h
            outs.append(y)
        x = xp.concatenate(outs, axis=2) if c.D == 2 else outs[0]
    return x


def _sigmoid(xp, v):
    return 1 / (1 + xp.exp(-v))


def _naive_lstm(xp, gx, gh, h, c):
    i, f, g, o = xp.split(gx + gh, 4, axis=1)
    c = _sigmoid(xp, f) * c + _sigmoid(xp, i) * xp.tanh(g)
    return _sigmoid(xp, o) * xp.tanh(c), c


def _naive_gru(xp, gx, gh, h, c):
    xr, xz, xn = xp.split(gx, 3, axis=1)
    hr, hz, hn = xp.split(gh, 3, axis=1)
    r, z = _sigmoid(xp, xr + hr), _sigmoid(xp, xz + hz)
    n = xp.tanh(xn + r * hn)
    return (1 - z) * n + z * h, c


# The textbook cells, (xp, gx, gh, h, c) -> (h, c). Optional per mode: a mode without
# one has no naive peer (make returns None), so adding a mode need not touch this file.
NAIVE_CELLS = {
    "rnn_relu": lambda xp, gx, gh, h, c: (xp.maximum(gx + gh, 0), c),
    "rnn_tanh": lambda xp, gx, gh, h, c: (xp.tanh(gx + gh), c),
    "lstm": _naive_lstm,
    "gru": _naive_gru,
}
