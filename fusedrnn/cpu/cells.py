"""Per-step pointwise cell math for the CPU backend, one forward/backward pair per cell.

Every cell has the same two entry points, so the recurrence driver (driver.py) never
branches on the mode. Shapes below: N batch, H state_size, G gates, S = CellSpec.saved.
All arrays are 2-D and of the data's dtype; any row stride is accepted (views of
larger buffers are passed straight in). Unused arguments (e.g. c_* for a GRU) are
(0, 0) placeholders.

forward_step(gx, gh, bx, bh, h_prev, c_prev, h_next, c_next, y, saved)
    gx      (N, G*H) in   input projection W_x x_t, without bias
    gh      (N, G*H) in   recurrent projection W_h h_prev, without bias
    bx, bh  (G*H,)   in   the two biases (kept apart: GRU's n gate needs b_hn alone)
    h_prev  (N, H)   in   previous state;  c_prev (N, H) in: previous cell state (LSTM)
    h_next  (N, H)   out  new state;       c_next (N, H) out: new cell state (LSTM)
    y       (N, H)   out  this step's slice of the layer output (a second copy of h_next)
    saved   (N, S*H) out  training record for backward; (0, 0) in inference
    Outputs must not alias inputs.

backward_step(dy, dh_rec, dcarry_in, saved, h_prev, c_prev, c_t, dgx, dgh, dcarry_out)
    dy         (N, H)   in   gradient from the layer output at this step
    dh_rec     (N, H)   in   gradient from the next step through W_h (dhy at the last step)
    dcarry_in  (N, H)   in   the cell's carried gradient (LSTM dc, GRU z*dh); see CellSpec.carry
    saved      (N, S*H) in   the forward's training record of this step
    h_prev, c_prev, c_t (N, H) in   states before and (c_t) after this step
    dgx        (N, G*H) out  gradient w.r.t. the pre-activations fed by W_x x + b_x
    dgh        (N, G*H) out  the same for W_h h + b_h; GRU only, (0, 0) for cells where
                             it equals dgx (CellSpec.split_gate_grads is False)
    dcarry_out (N, H)   out  carried gradient for the previous step; may alias dcarry_in
                             (each element is read before it is written)
"""
from __future__ import annotations

import math
import threading

import numba as nb
import numpy as np
from numba import prange

from ..config import CELLS
from .threads import LAUNCH_LOCK

__all__ = ["cell_kernels"]


@nb.njit(inline="always", cache=True)
def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


@nb.njit(inline="always", cache=True)
def _preact(gx, gh, bx, bh, n, col):
    return gx[n, col] + bx[col] + gh[n, col] + bh[col]


def _make_rnn_cell(relu: bool):
    # `relu` is frozen into the compiled code (Numba reads closure cells as constants,
    # and its cache keys on them), so the two plain RNN cells share one source.
    def forward_step(gx, gh, bx, bh, h_prev, c_prev, h_next, c_next, y, saved):
        N, H = gx.shape[0], gx.shape[1]
        train = saved.shape[0] != 0
        for k in prange(N * H):
            n, j = k // H, k % H
            a = _preact(gx, gh, bx, bh, n, j)
            h = max(a, 0.0) if relu else math.tanh(a)
            h_next[n, j] = h
            y[n, j] = h
            if train:
                saved[n, j] = h

    def backward_step(dy, dh_rec, dcarry_in, saved, h_prev, c_prev, c_t, dgx, dgh, dcarry_out):
        N, H = dgx.shape[0], dgx.shape[1]
        for k in prange(N * H):
            n, j = k // H, k % H
            h = saved[n, j]
            dh = dy[n, j] + dh_rec[n, j]
            if relu:
                dgx[n, j] = dh if h > 0.0 else 0.0
            else:
                dgx[n, j] = dh * (1.0 - h * h)

    return forward_step, backward_step


def lstm_forward_step(gx, gh, bx, bh, h_prev, c_prev, h_next, c_next, y, saved):
    N, H = gx.shape[0], gx.shape[1] // 4
    train = saved.shape[0] != 0
    for k in prange(N * H):
        n, j = k // H, k % H
        i = _sigmoid(_preact(gx, gh, bx, bh, n, j))
        f = _sigmoid(_preact(gx, gh, bx, bh, n, H + j))
        g = math.tanh(_preact(gx, gh, bx, bh, n, 2 * H + j))
        o = _sigmoid(_preact(gx, gh, bx, bh, n, 3 * H + j))
        c = f * c_prev[n, j] + i * g
        h = o * math.tanh(c)
        c_next[n, j] = c
        h_next[n, j] = h
        y[n, j] = h
        if train:
            saved[n, j] = i
            saved[n, H + j] = f
            saved[n, 2 * H + j] = g
            saved[n, 3 * H + j] = o


def lstm_backward_step(dy, dh_rec, dcarry_in, saved, h_prev, c_prev, c_t, dgx, dgh, dcarry_out):
    N, H = dgx.shape[0], dgx.shape[1] // 4
    for k in prange(N * H):
        n, j = k // H, k % H
        i, f = saved[n, j], saved[n, H + j]
        g, o = saved[n, 2 * H + j], saved[n, 3 * H + j]
        tc = math.tanh(c_t[n, j])
        dh = dy[n, j] + dh_rec[n, j]
        dc = dcarry_in[n, j] + dh * o * (1.0 - tc * tc)
        dgx[n, j] = dc * g * i * (1.0 - i)
        dgx[n, H + j] = dc * c_prev[n, j] * f * (1.0 - f)
        dgx[n, 2 * H + j] = dc * i * (1.0 - g * g)
        dgx[n, 3 * H + j] = dh * tc * o * (1.0 - o)
        dcarry_out[n, j] = dc * f


def gru_forward_step(gx, gh, bx, bh, h_prev, c_prev, h_next, c_next, y, saved):
    N, H = gx.shape[0], gx.shape[1] // 3
    train = saved.shape[0] != 0
    for k in prange(N * H):
        n, j = k // H, k % H
        r = _sigmoid(_preact(gx, gh, bx, bh, n, j))
        z = _sigmoid(_preact(gx, gh, bx, bh, n, H + j))
        hn = gh[n, 2 * H + j] + bh[2 * H + j]  # "linear before reset": r scales W_hn h + b_hn
        nn = math.tanh(gx[n, 2 * H + j] + bx[2 * H + j] + r * hn)
        h = (1.0 - z) * nn + z * h_prev[n, j]
        h_next[n, j] = h
        y[n, j] = h
        if train:
            saved[n, j] = r
            saved[n, H + j] = z
            saved[n, 2 * H + j] = nn
            saved[n, 3 * H + j] = hn


def gru_backward_step(dy, dh_rec, dcarry_in, saved, h_prev, c_prev, c_t, dgx, dgh, dcarry_out):
    N, H = dgx.shape[0], dgx.shape[1] // 3
    for k in prange(N * H):
        n, j = k // H, k % H
        r, z = saved[n, j], saved[n, H + j]
        nn, hn = saved[n, 2 * H + j], saved[n, 3 * H + j]
        dh = dy[n, j] + dh_rec[n, j] + dcarry_in[n, j]
        dn = dh * (1.0 - z) * (1.0 - nn * nn)
        dr = dn * hn * r * (1.0 - r)
        dz = dh * (h_prev[n, j] - nn) * z * (1.0 - z)
        dgx[n, j] = dr
        dgx[n, H + j] = dz
        dgx[n, 2 * H + j] = dn
        dgh[n, j] = dr
        dgh[n, H + j] = dz
        dgh[n, 2 * H + j] = dn * r
        dcarry_out[n, j] = dh * z


_SOURCES = {
    "rnn_relu": _make_rnn_cell(relu=True),
    "rnn_tanh": _make_rnn_cell(relu=False),
    "lstm": (lstm_forward_step, lstm_backward_step),
    "gru": (gru_forward_step, gru_backward_step),
}
assert set(_SOURCES) == set(CELLS)

_compiled: dict = {}
_compile_lock = threading.Lock()


def _signature(dtype, ndims):
    scalar = nb.from_dtype(np.dtype(dtype))
    return nb.void(*(nb.types.Array(scalar, nd, "A") for nd in ndims))


# Each kernel is compiled once per dtype, on first use (not at import), for arrays of
# any layout ("A"): one specialisation serves contiguous buffers and strided views
# alike, so a cold process compiles at most 2 kernels per (mode, dtype).
_FORWARD_NDIMS = (2, 2, 1, 1, 2, 2, 2, 2, 2, 2)
_BACKWARD_NDIMS = (2,) * 10


def _guarded(kernel):
    def launch(*args):
        with LAUNCH_LOCK:
            kernel(*args)
    launch.kernel = kernel
    return launch


def cell_kernels(mode: str, dtype):
    """(forward_step, backward_step) for `mode`, compiled for `dtype` (cached on disk),
    each launch guarded as threads.py requires."""
    key = (mode, np.dtype(dtype).str)
    kernels = _compiled.get(key)
    if kernels is None:
        with _compile_lock:
            kernels = _compiled.get(key)
            if kernels is None:
                forward, backward = _SOURCES[mode]
                options = dict(parallel=True, cache=True, nogil=True)
                kernels = (
                    _guarded(nb.njit(_signature(dtype, _FORWARD_NDIMS), **options)(forward)),
                    _guarded(nb.njit(_signature(dtype, _BACKWARD_NDIMS), **options)(backward)))
                _compiled[key] = kernels
    return kernels
