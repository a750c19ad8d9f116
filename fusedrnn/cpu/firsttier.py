"""The CPU's first tier, for calls before the fused kernels are ready (warm.py): the
per-step path on numpy's BLAS, the cell math units.py's own source run with numpy helpers
over whole (N, H) blocks (cells.py's contract), so a mode's formulas live in one place.
"""
from __future__ import annotations

import types

import numpy as np

from ..config import CELLS
from . import units
from .threads import BLAS_SPARE_ONE

__all__ = ["cell_kernels", "FirstTierBackend"]


def _array_helpers():
    """units.py's globals with the lowlevel helpers replaced by their numpy forms."""
    def sigmoid(x):
        with np.errstate(over="ignore"):   # exp(-x) overflows to inf: sigmoid saturates at 0
            return 1 / (1 + np.exp(-x))

    def like(value):
        return lambda x: np.asarray(x).dtype.type(value)   # x's precision, as the kernels'

    names = dict(vars(units))
    names.update(sigmoid=sigmoid, tanh=np.tanh, select=np.where, one_like=like(1),
                 zero_like=like(0))
    for name in ("clip", "unclipped"):
        names[name] = _on_arrays(getattr(units, name), names)
    return names


def _on_arrays(unit, names):
    """The unit's Python function, its global names looked up in `names`."""
    py = unit.py_func
    return types.FunctionType(py.__code__, names, py.__name__, py.__defaults__, py.__closure__)


_NAMES = _array_helpers()
_FORWARD = {mode: _on_arrays(unit, _NAMES) for mode, unit in units.FORWARD_UNITS.items()}
_BACKWARD = {mode: _on_arrays(unit, _NAMES) for mode, unit in units.BACKWARD_UNITS.items()}


def _given(a):
    return a.shape[0] != 0


def _active(lengths, t):
    """(N, 1) bool, where each sample is inside its length at step t; None: all are."""
    if lengths.shape[0] == 0:
        return None
    return (t < lengths).reshape(-1, 1)


def _gate(a, g, H, last):
    """Gate g's (N, H) block of a (N, G*H) array; past the cell's gates, its last."""
    g = min(g, last)
    return a[:, g * H:(g + 1) * H]


def cell_kernels(mode, dtype):
    """(forward_step, backward_step) of cells.py's contract, in numpy."""
    spec = CELLS[mode]
    G, S, last = spec.gates, spec.saved, spec.gates - 1
    forward_unit, backward_unit = _FORWARD[mode], _BACKWARD[mode]
    zero = np.dtype(dtype).type(0)

    def forward_step(gx, gh, bx, bh, h_prev, c_prev, h_next, c_next, y, saved, lengths, t,
                     clip_lo, clip_hi, clip_flags):
        H = gx.shape[1] // G
        xs = [_gate(gx, g, H, last) + bx[min(g, last) * H:(min(g, last) + 1) * H]
              for g in range(4)]
        rs = [_gate(gh, g, H, last) + bh[min(g, last) * H:(min(g, last) + 1) * H]
              for g in range(4)]
        hp = h_prev if _given(h_prev) else zero
        cp = c_prev if _given(c_prev) else zero
        h, c, *record = forward_unit(*xs, *rs, hp, cp, clip_lo, clip_hi, clip_flags)
        active = _active(lengths, t)
        if active is not None:   # past its length a sample's state is carried, y is 0
            h = np.where(active, h, hp)
            c = np.where(active, c, cp)
        h_next[...] = h
        y[...] = h if active is None else np.where(active, h, zero)   # (y may alias h_next)
        if _given(c_next):
            c_next[...] = c
        if _given(saved):
            for k in range(S):
                saved[:, k * H:(k + 1) * H] = record[k]

    def backward_step(dy, dh_rec, dh_carry_in, dc_carry_in, saved, h_prev, c_prev, c_t, dgx,
                      dgh, dh_carry_out, dc_carry_out, lengths, t, clip_lo, clip_hi,
                      clip_flags):
        H = dgx.shape[1] // G
        dh_pass = zero   # what reaches h_t besides the output: the recurrence, the carry
        if _given(dh_rec):
            dh_pass = dh_pass + dh_rec
        if _given(dh_carry_in):
            dh_pass = dh_pass + dh_carry_in
        dh = dy + dh_pass
        dc_in = dc_carry_in if _given(dc_carry_in) else zero
        record = [saved[:, k * H:(k + 1) * H] if k < S else zero for k in range(4)]
        grads = backward_unit(dh, dc_in, *record, h_prev if _given(h_prev) else zero,
                              c_prev if _given(c_prev) else zero,
                              c_t if _given(c_t) else zero, clip_lo, clip_hi, clip_flags)
        dxs, drs, dh_carry, dc_carry = grads[:4], grads[4:8], grads[8], grads[9]
        active = _active(lengths, t)
        if active is not None:   # an inactive step passes dh and dc straight through
            dxs = [np.where(active, d, zero) for d in dxs]
            drs = [np.where(active, d, zero) for d in drs]
            dh_carry = np.where(active, dh_carry, dh_pass)
            dc_carry = np.where(active, dc_carry, dc_in)
        for g in range(G):
            dgx[:, g * H:(g + 1) * H] = dxs[g]
            if spec.split_gate_grads:
                dgh[:, g * H:(g + 1) * H] = drs[g]
        if _given(dh_carry_out):
            dh_carry_out[...] = dh_carry
        if _given(dc_carry_out):
            dc_carry_out[...] = dc_carry

    return forward_step, backward_step


class FirstTierBackend:
    """The CPU backend with nothing compiled: numpy's GEMMs and cell_kernels above, no fused
    layer or half-precision products; the rest is `cpu`'s (which imports this module)."""

    name = "cpu-first-tier"

    def __init__(self, cpu):
        self._cpu = cpu

    def __getattr__(self, name):   # arrays, devices, random: the CPU backend's
        return getattr(self._cpu, name)

    @staticmethod
    def cell_kernels(mode, dtype):
        return cell_kernels(mode, dtype)

    @staticmethod
    def fused_layer(config, dtype, batch, storage=None):
        return None

    @staticmethod
    def pair_products(storage):
        return False

    @staticmethod
    def step_products(dtype, work):
        """Never: numpy's GEMMs one by one (nothing to compile)."""
        return False

    @staticmethod
    def sequence_products(dtype, rows, work):
        return False

    @staticmethod
    def pair_projection(rows):
        return False

    @staticmethod
    def blas_scope(config, seq_len, batch, own_gemms=False):
        """BLAS one thread short in every program: a core for the background compile (two
        threads on two cores, one descheduled in turn, waited for each other at every GEMM).
        Measured: bench/results/cpu-kernel-notes.md#first-use-where-the-compile-goes"""
        return BLAS_SPARE_ONE

    @staticmethod
    def matmul(a, b, out, transpose_a=False, pairs=None, a_paired=False, half=None):
        """out = a @ b, or a^T @ b, on numpy's BLAS (in a torch program too: its pool would
        spin against the background compile); an outer product (a^T @ b over one row) as
        numpy's multiply: numpy's matmul runs that in a scalar loop, not in BLAS.
        Measured: bench/results/cpu-kernel-notes.md#gemm-an-outer-product"""
        if transpose_a and a.shape[0] == 1:
            return np.multiply(a.reshape(-1, 1), b, out=out)
        return np.matmul(a.T if transpose_a else a, b, out=out)

    @staticmethod
    def astype(array, dtype, out=None):
        """numpy's (and ml_dtypes') own conversions: no kernel to compile."""
        if out is None:
            return np.asarray(array).astype(dtype)
        out[...] = array
        return out
