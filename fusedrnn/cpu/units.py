"""Each cell's pointwise math for one hidden unit of one sample, forward and backward:
the only place a mode's formulas live on the CPU (cells.py and fused.py drive them).

forward(x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, clip_lo, clip_hi, clip_flags)
        -> (h, c, s0, s1, s2, s3)
    x_g  the input side of gate g's pre-activation, W_x x + b_x (gates past G: unused)
    r_g  the recurrent side, W_h h + b_h (kept apart: GRU's n gate scales it by r)
    h_prev, c_prev  the unit's previous state (h_prev: GRU only, CellSpec.reads_h_prev;
                    c_prev: LSTM only; undefined in the fused loops where unread)
    returns h, c (LSTM; else 0) and the training record s_0..s_{S-1} (the rest 0)

backward(dh, dc, s0, s1, s2, s3, h_prev, c_prev, c_t, clip_lo, clip_hi, clip_flags)
        -> (dx0, dx1, dx2, dx3, dr0, dr1, dr2, dr3, dh_carry, dc_carry)
    dh   all gradient reaching this step's h (output + recurrence + direct carry)
    dc   gradient reaching this step's c from the next step (LSTM only, like c_prev, c_t)
    s_k  the forward's record; h_prev, c_prev, c_t the states around the step (as forward)
    returns each gate's input- (dx_g) and recurrent-side (dr_g) gradient (equal but in
    GRU's n gate), and those reaching h_prev (GRU's z*dh) and c_prev (LSTM's f*dc), or 0

Arithmetic stays in the arguments' precision (mathfn.py's activations) and conditionals
are selects, so the fused loops vectorise (tests/cpu/test_vectorised_cells.py); cells.py
passes clip bounds as Python floats, so there a clipped float32 cell runs in float64.
"""
from __future__ import annotations

import numba as nb

from ..config import CLIP, CLIP_NAN  # the clip_flags bits, defined once
from .lowlevel import one_like, select, sigmoid, tanh, zero_like

__all__ = ["BACKWARD_UNITS", "FORWARD_UNITS", "MODE_INDEX", "backward_unit", "clip",
           "forward_unit", "unclipped"]


@nb.njit(inline="always", cache=True)
def clip(c, lo, hi, flags):
    if flags & CLIP:   # (loop-invariant); per element selects, not branches (lowlevel.select)
        nan_to_lo = (flags & CLIP_NAN) != 0
        c = select(c < lo, lo, select(c > hi, hi, select(nan_to_lo & (c != c), lo, c)))
    return c


@nb.njit(inline="always", cache=True)
def unclipped(c, lo, hi, flags):
    """1 where the clip let c through (its gradient flows), else 0 (also for NaN)."""
    one = one_like(c)
    if flags & CLIP:
        return select((lo <= c) & (c <= hi), one, zero_like(c))
    return one


@nb.njit(inline="always", cache=True)
def relu_forward(x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, lo, hi, flags):
    a = x0 + r0
    z = zero_like(a)
    h = select(a < z, z, a)   # max(a, 0), NaN propagates
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


@nb.njit(inline="always", cache=True)
def relu_backward(dh, dc, s0, s1, s2, s3, h_prev, c_prev, c_t, lo, hi, flags):
    z = zero_like(dh)
    dx = select(s0 > z, dh, z)      # s0 = h
    return dx, z, z, z, dx, z, z, z, z, z


@nb.njit(inline="always", cache=True)
def tanh_backward(dh, dc, s0, s1, s2, s3, h_prev, c_prev, c_t, lo, hi, flags):
    z = zero_like(dh)
    dx = dh * (one_like(dh) - s0 * s0)
    return dx, z, z, z, dx, z, z, z, z, z


@nb.njit(inline="always", cache=True)
def lstm_backward(dh, dc, s0, s1, s2, s3, h_prev, c_prev, c_t, lo, hi, flags):
    i, f, g, o, one = s0, s1, s2, s3, one_like(dh)
    tc = tanh(c_t)
    dc = dc + dh * o * (one - tc * tc)
    # The clip's gradient: 0 where the update left [lo, hi] (recomputed pre-clip value).
    dc = dc * unclipped(f * c_prev + i * g, lo, hi, flags)
    di = dc * g * i * (one - i)
    df = dc * c_prev * f * (one - f)
    dg = dc * i * (one - g * g)
    do = dh * tc * o * (one - o)
    return di, df, dg, do, di, df, dg, do, zero_like(dh), dc * f


@nb.njit(inline="always", cache=True)
def gru_backward(dh, dc, s0, s1, s2, s3, h_prev, c_prev, c_t, lo, hi, flags):
    r, z, n, hn, one = s0, s1, s2, s3, one_like(dh)
    dn = dh * (one - z) * (one - n * n)
    dr = dn * hn * r * (one - r)
    dz = dh * (h_prev - n) * z * (one - z)
    zero = zero_like(dh)
    return dr, dz, dn, zero, dr, dz, dn * r, zero, dh * z, zero


BACKWARD_UNITS = {
    "rnn_relu": relu_backward,
    "rnn_tanh": tanh_backward,
    "lstm": lstm_backward,
    "gru": gru_backward,
}

FORWARD_UNITS = {
    "rnn_relu": relu_forward,
    "rnn_tanh": tanh_forward,
    "lstm": lstm_forward,
    "gru": gru_forward,
}


# The kernels hold a mode's index, not its unit functions: Numba's disk cache keys on a
# closure's pickled cells, and a pickled Numba function differs in every process.
MODE_INDEX = {mode: i for i, mode in enumerate(FORWARD_UNITS)}


@nb.njit(inline="always", cache=True)
def forward_unit(mode, x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, lo, hi, flags):
    if mode == 0:
        return relu_forward(x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, lo, hi, flags)
    if mode == 1:
        return tanh_forward(x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, lo, hi, flags)
    if mode == 2:
        return lstm_forward(x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, lo, hi, flags)
    return gru_forward(x0, x1, x2, x3, r0, r1, r2, r3, h_prev, c_prev, lo, hi, flags)


@nb.njit(inline="always", cache=True)
def backward_unit(mode, dh, dc, s0, s1, s2, s3, h_prev, c_prev, c_t, lo, hi, flags):
    if mode == 0:
        return relu_backward(dh, dc, s0, s1, s2, s3, h_prev, c_prev, c_t, lo, hi, flags)
    if mode == 1:
        return tanh_backward(dh, dc, s0, s1, s2, s3, h_prev, c_prev, c_t, lo, hi, flags)
    if mode == 2:
        return lstm_backward(dh, dc, s0, s1, s2, s3, h_prev, c_prev, c_t, lo, hi, flags)
    return gru_backward(dh, dc, s0, s1, s2, s3, h_prev, c_prev, c_t, lo, hi, flags)


assert list(MODE_INDEX) == ["rnn_relu", "rnn_tanh", "lstm", "gru"] == list(BACKWARD_UNITS)
