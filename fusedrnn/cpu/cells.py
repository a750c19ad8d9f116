"""Per-step pointwise cell math for the CPU backend, one forward/backward pair per cell.

The same two entry points for every cell: recurrence.py never branches on the mode. N
batch, H state_size, G gates, S = CellSpec.saved; arrays of the data's dtype (lengths
int64), 2-D, any row stride; "optional": may be (0, 0), read as zeros or not written.

forward_step(gx, gh, bx, bh, h_prev, c_prev, h_next, c_next, y, saved,
             lengths, t, clip_lo, clip_hi, clip_flags)
    gx      (N, G*H) in   input projection W_x x_t, without bias
    gh      (N, G*H) in   recurrent projection W_h h_prev, without bias
    bx, bh  (G*H,)   in   the two biases (kept apart: GRU's n gate needs b_hn alone)
    h_prev  (N, H)   in   previous state (optional for LSTM: the projected path)
    c_prev  (N, H)   in   previous cell state (LSTM)
    h_next  (N, H)   out  new state;  c_next (N, H) out: new cell state (LSTM)
    y       (N, H)   out  this step's slice of the layer output; may alias h_next
    saved   (N, S*H) out  training record for backward; optional (inference)
    lengths (N,)     in   per-sample lengths; (0,) = all T. At t >= lengths[n] the state
                          is carried (h_next = h_prev or 0; c_next = c_prev), y = 0
    t       int           this step's time index
    clip_lo, clip_hi, clip_flags   LSTM cell-state clipping: bit 0 clips c to [clip_lo,
                          clip_hi] after the update, bit 1 turns a NaN into clip_lo
    Outputs other than y must not alias inputs.

backward_step(dy, dh_rec, dh_carry_in, dc_carry_in, saved, h_prev, c_prev, c_t, dgx, dgh,
              dh_carry_out, dc_carry_out, lengths, t, clip_lo, clip_hi, clip_flags)
    dy           (N, H)   in   gradient from this step's output (or from the projection)
    dh_rec       (N, H)   in   gradient from the next step through W_h; optional
    dh_carry_in  (N, H)   in   gradient reaching h directly (GRU's z*dh, inactive steps)
    dc_carry_in  (N, H)   in   gradient reaching c from the next step (LSTM)
    saved        (N, S*H) in   the forward's training record of this step
    h_prev, c_prev, c_t (N, H) in  states before and (c_t) after this step
    dgx          (N, G*H) out  gradient w.r.t. the pre-activations fed by W_x x + b_x
    dgh          (N, G*H) out  the same for W_h h + b_h; optional where it equals dgx
                               (CellSpec.split_gate_grads is False)
    dh_carry_out (N, H)   out  optional; may alias dh_carry_in
    dc_carry_out (N, H)   out  (LSTM); may alias dc_carry_in
    lengths, t, clip_*    as in forward_step; the gradient through a clipped c is 0
    Each element of an aliased carry is read before it is written.
"""
from __future__ import annotations

import threading

import numba as nb
import numpy as np
from numba import prange

from ..config import CELLS
from .lowlevel import zero_like
from .threads import KERNEL_OPTIONS, LAUNCH_LOCK, serial_only, serial_twin
from .units import BACKWARD_UNITS, FORWARD_UNITS, MODE_INDEX, backward_unit, forward_unit

__all__ = ["cell_kernels"]
assert set(CELLS) == set(FORWARD_UNITS) == set(BACKWARD_UNITS)


@nb.njit(inline="always", cache=True)
def _given(a):
    return a.shape[0] != 0


@nb.njit(inline="always", cache=True)
def _active(lengths, n, t):
    return lengths.shape[0] == 0 or t < lengths[n]


@nb.njit(inline="always", cache=True)
def _carry_state(h_prev, c_prev, h_next, c_next, y, n, j):
    """An inactive step (past the sample's length): the state passes through unchanged."""
    h_next[n, j] = h_prev[n, j] if _given(h_prev) else 0.0
    y[n, j] = 0.0
    if _given(c_next):
        c_next[n, j] = c_prev[n, j]


@nb.njit(inline="always", cache=True)
def _carry_grads(gates, H, dh_rec, dh_carry_in, dc_carry_in, dgx, dgh, dh_carry_out,
                 dc_carry_out, n, j):
    """Backward of an inactive step: no gate gradient, dh and dc pass straight through."""
    for g in range(gates):
        dgx[n, g * H + j] = 0.0
        if _given(dgh):
            dgh[n, g * H + j] = 0.0
    if _given(dh_carry_out):
        dh = dh_rec[n, j] if _given(dh_rec) else 0.0
        dh_carry_out[n, j] = dh + (dh_carry_in[n, j] if _given(dh_carry_in) else 0.0)
    if _given(dc_carry_out):
        dc_carry_out[n, j] = dc_carry_in[n, j]


@nb.njit(inline="always", cache=True)
def _dh(dy, dh_rec, dh_carry_in, n, j):
    """All gradient reaching h_t: output, recurrence, and the direct carry."""
    dh = dy[n, j]
    if _given(dh_rec):
        dh += dh_rec[n, j]
    if _given(dh_carry_in):
        dh += dh_carry_in[n, j]
    return dh


def _make_forward_step(mode, gates, saved_width):
    """The per-step forward kernel of the cell MODE_INDEX `mode` (units.py); the closure's
    ints are constants to Numba, and its cache keys on them."""
    last = gates - 1

    def forward_step(gx, gh, bx, bh, h_prev, c_prev, h_next, c_next, y, saved,
                     lengths, t, clip_lo, clip_hi, clip_flags):
        N, H = gx.shape[0], gx.shape[1] // gates
        for k in prange(N * H):
            n, j = k // H, k % H
            if not _active(lengths, n, t):
                _carry_state(h_prev, c_prev, h_next, c_next, y, n, j)
                continue
            # Gates past the cell's count repeat its last one; the unit ignores them.
            c0, c1, c2, c3 = j, min(1, last) * H + j, min(2, last) * H + j, last * H + j
            h, c, s0, s1, s2, s3 = forward_unit(
                mode,
                gx[n, c0] + bx[c0], gx[n, c1] + bx[c1], gx[n, c2] + bx[c2], gx[n, c3] + bx[c3],
                gh[n, c0] + bh[c0], gh[n, c1] + bh[c1], gh[n, c2] + bh[c2], gh[n, c3] + bh[c3],
                h_prev[n, j] if _given(h_prev) else zero_like(h_prev),
                c_prev[n, j] if _given(c_prev) else zero_like(c_prev),
                clip_lo, clip_hi, clip_flags)
            h_next[n, j] = h
            y[n, j] = h
            if _given(c_next):
                c_next[n, j] = c
            if _given(saved):
                saved[n, j] = s0
                if saved_width > 1:
                    saved[n, H + j] = s1
                    saved[n, 2 * H + j] = s2
                    saved[n, 3 * H + j] = s3

    return forward_step


def _make_backward_step(mode, gates, saved_width, split_gate_grads):
    """The per-step backward kernel of the cell MODE_INDEX `mode` (units.py)."""
    last = gates - 1

    def backward_step(dy, dh_rec, dh_carry_in, dc_carry_in, saved, h_prev, c_prev, c_t, dgx,
                      dgh, dh_carry_out, dc_carry_out, lengths, t, clip_lo, clip_hi, clip_flags):
        N, H = dgx.shape[0], dgx.shape[1] // gates
        for k in prange(N * H):
            n, j = k // H, k % H
            if not _active(lengths, n, t):
                _carry_grads(gates, H, dh_rec, dh_carry_in, dc_carry_in, dgx, dgh,
                             dh_carry_out, dc_carry_out, n, j)
                continue
            zero = zero_like(dgx)
            s1 = saved[n, H + j] if saved_width > 1 else zero
            s2 = saved[n, 2 * H + j] if saved_width > 2 else zero
            s3 = saved[n, 3 * H + j] if saved_width > 3 else zero
            dx0, dx1, dx2, dx3, dr0, dr1, dr2, dr3, dh_carry, dc_carry = backward_unit(
                mode,
                _dh(dy, dh_rec, dh_carry_in, n, j),
                dc_carry_in[n, j] if _given(dc_carry_in) else zero, saved[n, j], s1, s2, s3,
                h_prev[n, j] if _given(h_prev) else zero,
                c_prev[n, j] if _given(c_prev) else zero,
                c_t[n, j] if _given(c_t) else zero, clip_lo, clip_hi, clip_flags)
            dgx[n, j] = dx0
            if gates > 1:
                dgx[n, H + j] = dx1
            if gates > 2:
                dgx[n, 2 * H + j] = dx2
            if gates > 3:
                dgx[n, 3 * H + j] = dx3
            if split_gate_grads:
                dgh[n, j] = dr0
                dgh[n, H + j] = dr1
                dgh[n, min(2, last) * H + j] = dr2
            if _given(dh_carry_out):
                dh_carry_out[n, j] = dh_carry
            if _given(dc_carry_out):
                dc_carry_out[n, j] = dc_carry

    return backward_step


_compiled: dict = {}
_compile_lock = threading.Lock()


def _signature(dtype, arrays):
    """arrays: (ndim, only read) per array; those only read take read-only arrays too."""
    scalar = nb.from_dtype(np.dtype(dtype))
    typed = (nb.types.Array(scalar, nd, "A", readonly=read) for nd, read in arrays)
    # lengths, t, clip_lo, clip_hi, clip_flags
    tail = (nb.types.Array(nb.int64, 1, "A", readonly=True), nb.int64, nb.float64,
            nb.float64, nb.int64)
    return nb.void(*typed, *tail)


# Compiled on first use for arrays of any layout ("A"): one specialisation serves buffers
# and strided views alike, at most 2 kernels per (mode, dtype).
_FORWARD_ARRAYS = ((2, True), (2, True), (1, True), (1, True), (2, True), (2, True),
                   (2, False), (2, False), (2, False), (2, False))
# (the carries in may alias the carries out: writable)
_BACKWARD_ARRAYS = ((2, True), (2, True), (2, False), (2, False), (2, True), (2, True),
                    (2, True), (2, True), (2, False), (2, False), (2, False), (2, False))


def _guarded(kernel, python_function):
    """kernel's launcher, under LAUNCH_LOCK; in a serial-only process (threads.serial_only)
    a serial build of the same function, compiled there on first use."""
    serial = []

    def launch(*args):
        build = kernel
        if serial_only():
            if not serial:
                with _compile_lock:
                    if not serial:
                        serial.append(nb.njit(list(kernel.signatures), **KERNEL_OPTIONS)(
                            serial_twin(python_function)))
            build = serial[0]
        with LAUNCH_LOCK:
            build(*args)
    launch.kernel = kernel
    return launch


def cell_kernels(mode: str, dtype):
    """(forward_step, backward_step) for `mode` and `dtype`, launches guarded (threads.py)."""
    key = (mode, np.dtype(dtype).str)
    kernels = _compiled.get(key)
    if kernels is None:
        with _compile_lock:
            kernels = _compiled.get(key)
            if kernels is None:
                spec = CELLS[mode]
                forward = _make_forward_step(MODE_INDEX[mode], spec.gates, spec.saved)
                backward = _make_backward_step(MODE_INDEX[mode], spec.gates, spec.saved,
                                               spec.split_gate_grads)
                options = dict(parallel=True, **KERNEL_OPTIONS)
                kernels = (
                    _guarded(nb.njit(_signature(dtype, _FORWARD_ARRAYS), **options)(forward),
                             forward),
                    _guarded(nb.njit(_signature(dtype, _BACKWARD_ARRAYS), **options)(backward),
                             backward))
                _compiled[key] = kernels
    return kernels
