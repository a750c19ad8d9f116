"""Each cell's forward pointwise math for one hidden unit of one sample: the only place a
mode's forward formula lives on the CPU. The per-step kernels (cells.py) and the fused
layer loops (fused.py) both drive these.

forward(x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, clip_lo, clip_hi, clip_flags)
        -> (h, c, s0, s1, s2, s3)
    x_g  the input side of gate g's pre-activation, W_x x + b_x (gates past G: unused)
    r_g  the recurrent side, W_h h + b_h (kept apart: GRU's n gate scales it by r)
    h_prev, c_prev  the unit's previous state (c: LSTM only; 0 where absent)
    returns the new state h, the new cell state c (LSTM; else 0) and the training record
    s_0..s_{S-1} (CellSpec.saved values; the rest 0)

All arithmetic stays in the data's precision (the activations come from mathfn), so a
loop over units vectorises.
"""
from __future__ import annotations

import numba as nb

from ..recurrence import CLIP, CLIP_NAN  # the clip_flags bits, defined once
from .mathfn import one_like, sigmoid, tanh, zero_like

__all__ = ["FORWARD_UNITS", "clip", "unclipped"]


@nb.njit(inline="always", cache=True)
def clip(c, lo, hi, flags):
    if flags & CLIP:
        if c < lo:
            c = lo
        elif c > hi:
            c = hi
        elif flags & CLIP_NAN and c != c:
            c = lo
    return c


@nb.njit(inline="always", cache=True)
def unclipped(c, lo, hi, flags):
    """1 where the clip let c through (its gradient flows), else 0 (also for NaN)."""
    if flags & CLIP:
        return 1.0 if (lo <= c <= hi) else 0.0
    return 1.0


@nb.njit(inline="always", cache=True)
def relu_forward(x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, lo, hi, flags):
    a = x0 + r0
    z = zero_like(a)
    h = z if a < z else a   # max(a, 0), NaN propagates
    return h, z, h, z, z, z


@nb.njit(inline="always", cache=True)
def tanh_forward(x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, lo, hi, flags):
    h = tanh(x0 + r0)
    z = zero_like(h)
    return h, z, h, z, z, z


@nb.njit(inline="always", cache=True)
def lstm_forward(x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, lo, hi, flags):
    i = sigmoid(x0 + r0)
    f = sigmoid(x1 + r1)
    g = tanh(x2 + r2)
    o = sigmoid(x3 + r3)
    c = clip(f * c_prev + i * g, lo, hi, flags)
    return o * tanh(c), c, i, f, g, o


@nb.njit(inline="always", cache=True)
def gru_forward(x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, lo, hi, flags):
    r = sigmoid(x0 + r0)
    z = sigmoid(x1 + r1)
    n = tanh(x2 + r * r2)   # "linear before reset": r scales W_hn h + b_hn
    h = (one_like(z) - z) * n + z * h_prev
    return h, zero_like(h), r, z, n, r2


FORWARD_UNITS = {
    "rnn_relu": relu_forward,
    "rnn_tanh": tanh_forward,
    "lstm": lstm_forward,
    "gru": gru_forward,
}
