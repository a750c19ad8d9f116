"""The recurrence that drives a cell over layers, directions and time steps.

Written once against an array module `xp` (numpy or cupy) and a backend's per-step
cell kernels (fusedrnn/cpu/cells.py documents their contract), so CPU and GPU share it.

Per layer: all time steps' input projections in one GEMM (both directions at once);
per step one recurrent GEMM and one fused pointwise kernel (plus, for a projected
LSTM, the W_r GEMM). Backward mirrors it and computes the weight gradients as one GEMM
over all steps per direction.

State-sequence indexing: for direction d, `hs[d]` has T+1 rows. The forward direction
keeps its initial state in row 0 and h_t in row t+1; the backward direction keeps h_t in
row t and its initial state in row T. So for either direction the state before step t is
row t + PREV[d], the state after it row t + NEXT[d], the T "previous states" that W_h's
gradient needs are one contiguous block (rows PREV[d] .. PREV[d]+T), and the layer
output of the direction is rows NEXT[d] .. NEXT[d]+T in time order.

Sequence lengths: a sample past its length is "inactive" at that step; the kernels carry
its state through unchanged and write 0 to the output, which gives both directions the
spec's semantics (the backward direction of a sample starts at t = len-1 from its
initial state) at the cost of the padded batch, with no per-sample loop.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .layout import ParamLayout

PREV = (0, 1)   # row offset of h_{t-1} (in processing order) for direction 0 / 1
NEXT = (1, 0)   # row offset of h_t
# `opts` below is a config.CallOptions (validate builds it; config: why it lives there).


def _carve(xp, dtype, shapes):
    """One allocation split into named C-contiguous views; returns (namespace, nbytes)."""
    sizes = {name: _prod(shape) for name, shape in shapes.items()}
    flat = xp.empty(sum(sizes.values()), dtype=dtype)
    views, offset = {}, 0
    for name, shape in shapes.items():
        views[name] = flat[offset:offset + sizes[name]].reshape(shape)
        offset += sizes[name]
    return SimpleNamespace(**views), flat.nbytes


def _prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n


class RecurrentOp:
    """One op instance for fixed (config, T, N, dtype) on one backend.

    Holds the compiled cell kernels, scratch buffers reused by every call (their
    contents never outlive a call), and a small pool of training reserves. A reserve
    belongs to exactly one training forward until its backward hands it back.
    """

    RESERVE_POOL = 1  # reserves kept for reuse; a training loop needs one

    def __init__(self, backend, config, seq_len, batch, dtype):
        self.backend, self.config, self.xp = backend, config, backend.xp
        self.T, self.N, self.dtype = seq_len, batch, dtype
        self.layout = ParamLayout(config)
        self.forward_step, self.backward_step = backend.cell_kernels(config.mode, dtype)
        self.fused = backend.fused_layer(config, dtype, batch)
        T, N, L, D = seq_len, batch, config.num_layers, config.directions
        GH, H, R = config.gate_rows, config.state_size, config.recurrent_size
        lstm, proj = config.cell.has_cell_state, bool(config.projection_size)
        max_in = max(config.layer_input_size(layer) for layer in range(L))
        shapes = {
            "xproj": (T * N, D * GH),
            "gh": (N, GH),
            "wx_packed": (D * GH * max_in if D > 1 else 0,),
            "hs": (D, T + 1, N, R),        # inference only: training uses the reserve's
            "cs": (D, T + 1, N, H if lstm else 0),
            "hraw": (N, H if proj else 0),  # the unprojected h of one step (inference)
            "ys": (min(L - 1, 2), T, N, D * R),
            "empty": (0, 0),
            "no_record": (0, 0, 0, 0),
        }
        if self.fused is not None:   # the fused layer's own (its forward_scratch)
            shapes.update(self.fused.forward_scratch(config, T, N))
        self.scratch, self.nbytes = _carve(self.xp, dtype, shapes)
        self.no_lengths = self.xp.empty(0, dtype="int64")
        self._backward_scratch = None
        self._reserve_pool = []

    # -- reserves ---------------------------------------------------------------------
    def take_reserve(self):
        if self._reserve_pool:
            reserve = self._reserve_pool.pop()
            self.nbytes -= reserve.nbytes
            return reserve
        cfg, T, N = self.config, self.T, self.N
        L, D, H, R = cfg.num_layers, cfg.directions, cfg.state_size, cfg.recurrent_size
        reserve, nbytes = _carve(self.xp, self.dtype, {
            "hs": (L, D, T + 1, N, R),
            "cs": (L, D, T + 1, N, H if cfg.cell.has_cell_state else 0),
            "hraw": (L, D, T, N, H if cfg.projection_size else 0),
            "saved": (L, D, T, N, cfg.cell.saved * H),
            "ys": (L - 1, T, N, D * R),    # inputs of layers 1..L-1 (after dropout)
        })
        reserve.nbytes, reserve.masks = nbytes, []
        return reserve

    def give_back_reserve(self, reserve):
        reserve.masks = []
        if len(self._reserve_pool) < self.RESERVE_POOL:
            self._reserve_pool.append(reserve)
            self.nbytes += reserve.nbytes

    # -- helpers ----------------------------------------------------------------------
    def _packed_wx(self, params, layer):
        """(D*G*H, In) input weights of both directions, contiguous, for one GEMM."""
        D = self.config.directions
        if D == 1:
            return self.layout.view(params, layer, 0, "W_x")
        GH, n_in = self.config.gate_rows, self.config.layer_input_size(layer)
        packed = self.scratch.wx_packed[:D * GH * n_in].reshape(D * GH, n_in)
        for d in range(D):
            packed[d * GH:(d + 1) * GH] = self.layout.view(params, layer, d, "W_x")
        return packed

    def _project_input(self, layer, x, params):
        """scratch.xproj = W_x x_t of every step and both directions, one GEMM: the fused
        layer's own where it has one (cpu/lowlevel/gemm.py: why), else the backend's BLAS."""
        T, N, D = self.T, self.N, self.config.directions
        x2d = x.reshape(T * N, -1)
        if self.fused is not None and self.fused.projects_input:
            w_xs = [self.layout.view(params, layer, d, "W_x") for d in range(D)]
            self.fused.project(x2d, w_xs, self.scratch.wx_panels, self.scratch.xproj,
                               self.scratch.spill)
        else:
            self.xp.matmul(x2d, self._packed_wx(params, layer).T, out=self.scratch.xproj)

    def _steps(self, d):
        return range(self.T) if d == 0 else range(self.T - 1, -1, -1)

    def _step_tail(self, opts, t):
        lengths = self.no_lengths if opts.lengths is None else opts.lengths
        return lengths, t, opts.clip_lo, opts.clip_hi, opts.clip_flags

    def _length_masks(self, opts):
        """(active as data's dtype, inactive as bool), both (T, N, 1): the projected
        path masks outside the kernels; None without lengths."""
        if opts.lengths is None or not self.config.projection_size:
            return None, None
        xp = self.xp
        active = xp.arange(self.T).reshape(self.T, 1) < opts.lengths.reshape(1, self.N)
        return active.astype(self.dtype)[:, :, None], ~active[:, :, None]

    def _dropout_masks(self, opts):
        """Masks for the inputs of layers 1..L-1: keep with probability 1-p, scaled by
        1/(1-p), drawn in layer order from the backend's generator seeded by opts.seed."""
        cfg, T, N = self.config, self.T, self.N
        rng = self.backend.random(opts.seed)
        scale = np.dtype(self.dtype).type(1.0 / (1.0 - opts.dropout))
        shape = (T, N, cfg.directions * cfg.recurrent_size)
        return [(rng.random(shape, dtype=self.dtype) >= opts.dropout).astype(self.dtype) * scale
                for _ in range(cfg.num_layers - 1)]

    # -- forward ----------------------------------------------------------------------
    def forward(self, data, params, h0, c0, opts, reserve=None):
        """Returns (out, hy, cy); cy is None without a cell state. With a reserve,
        records what backward needs into it."""
        xp, cfg, T, N = self.xp, self.config, self.T, self.N
        L, D, H, R = cfg.num_layers, cfg.directions, cfg.state_size, cfg.recurrent_size
        lstm = cfg.cell.has_cell_state
        out = xp.empty((T, N, D * R), dtype=self.dtype)
        hy = xp.empty((L * D, N, R), dtype=self.dtype)
        cy = xp.empty((L * D, N, H), dtype=self.dtype) if lstm else None
        masks = self._length_masks(opts)
        dropout = self._dropout_masks(opts) if reserve is not None and opts.dropout > 0 else []
        x = data
        for layer in range(L):
            if layer == L - 1:
                y = out
            else:
                y = reserve.ys[layer] if reserve is not None else self.scratch.ys[layer % 2]
            training = reserve is not None
            hs = reserve.hs[layer] if training else self.scratch.hs
            cs = reserve.cs[layer] if training else self.scratch.cs
            self._layer_forward(layer, x, params, h0, c0, y, opts, masks, hs, cs,
                                hraw=reserve.hraw[layer] if training else None,
                                saved=reserve.saved[layer] if training else None)
            for d in range(D):
                last = T if d == 0 else 0
                hy[layer * D + d] = hs[d, last]
                if lstm:
                    cy[layer * D + d] = cs[d, last]
            if dropout and layer < L - 1:
                y *= dropout[layer]
            x = y
        if reserve is not None:
            reserve.masks = dropout
        return out, hy, cy

    def _layer_forward(self, layer, x, params, h0, c0, y, opts, masks, hs, cs, hraw, saved):
        xp, cfg, T, N = self.xp, self.config, self.T, self.N
        D, GH, R = cfg.directions, cfg.gate_rows, cfg.recurrent_size
        lstm, proj = cfg.cell.has_cell_state, bool(cfg.projection_size)
        empty, s, lay = self.scratch.empty, self.scratch, self.layout
        if self.fused is not None:
            self._fused_layer_forward(layer, x, params, h0, c0, y, opts, hs, cs, saved)
            return
        xproj = s.xproj.reshape(T, N, D * GH)
        self._project_input(layer, x, params)
        active, inactive = masks
        for d in range(D):
            w_h, b_x, b_h = (lay.view(params, layer, d, k) for k in ("W_h", "b_x", "b_h"))
            w_r = lay.view(params, layer, d, "W_r") if proj else None
            prev, nxt = PREV[d], NEXT[d]
            self._initial_state(layer, d, h0, c0, hs, cs)
            for t in self._steps(d):
                xp.matmul(hs[d, t + prev], w_h.T, out=s.gh)
                c_prev = cs[d, t + prev] if lstm else empty
                c_next = cs[d, t + nxt] if lstm else empty
                record = saved[d, t] if saved is not None else empty
                if proj:
                    # The cell yields h (N, H); the state and output are r = W_r h (N, P).
                    h = hraw[d, t] if hraw is not None else s.hraw
                    self.forward_step(xproj[t, :, d * GH:(d + 1) * GH], s.gh, b_x, b_h, empty,
                                      c_prev, h, c_next, h, record, *self._step_tail(opts, t))
                    xp.matmul(h, w_r.T, out=hs[d, t + nxt])
                    if inactive is not None:
                        xp.copyto(hs[d, t + nxt], hs[d, t + prev], where=inactive[t])
                else:
                    self.forward_step(xproj[t, :, d * GH:(d + 1) * GH], s.gh, b_x, b_h,
                                      hs[d, t + prev], c_prev, hs[d, t + nxt], c_next,
                                      y[t, :, d * R:(d + 1) * R], record,
                                      *self._step_tail(opts, t))
            if proj:  # the layer output is the state sequence, zero past each length
                states = hs[d, nxt:nxt + T]
                if active is not None:
                    xp.multiply(states, active, out=y[:, :, d * R:(d + 1) * R])
                else:
                    y[:, :, d * R:(d + 1) * R] = states

    def _initial_state(self, layer, d, h0, c0, hs, cs):
        idx, first = layer * self.config.directions + d, (0 if d == 0 else self.T)
        hs[d, first] = h0[idx] if h0 is not None else 0
        if self.config.cell.has_cell_state:
            cs[d, first] = c0[idx] if c0 is not None else 0

    def _fused_layer_forward(self, layer, x, params, h0, c0, y, opts, hs, cs, saved):
        """The backend's whole-layer loop (cpu/fused.py), one call per direction; at T=1
        its single-region form where it has one (FusedLayer.forward_single: why)."""
        cfg, T, N, s, lay = self.config, self.T, self.N, self.scratch, self.layout
        D, GH = cfg.directions, cfg.gate_rows
        lengths = self.no_lengths if opts.lengths is None else opts.lengths
        record = s.no_record if saved is None else saved
        tail = (lengths, opts.clip_lo, opts.clip_hi, opts.clip_flags)
        single = T == 1 and self.fused.fuses_single_step
        xproj = s.xproj.reshape(T, N, D * GH)
        if not single:   # the T=1 form projects its input itself
            self._project_input(layer, x, params)
        for d in range(D):
            self._initial_state(layer, d, h0, c0, hs, cs)
            w_h, b_x, b_h = (lay.view(params, layer, d, k) for k in ("W_h", "b_x", "b_h"))
            if single:
                self.fused.forward_single(x.reshape(N, -1), d, lay.view(params, layer, d, "W_x"),
                                          w_h, b_x, b_h, hs, cs, y, record, s.tiles,
                                          s.x_cols, s.h_cols, *tail)
            else:
                self.fused.forward(xproj, d, self.fused.pack(w_h, s.wpack), b_x, b_h, hs, cs,
                                   y, record, s.tiles, *tail)

    # -- backward ---------------------------------------------------------------------
    def _backward_buffers(self):
        if self._backward_scratch is None:
            cfg, T, N = self.config, self.T, self.N
            D, GH, H, R = cfg.directions, cfg.gate_rows, cfg.state_size, cfg.recurrent_size
            proj = bool(cfg.projection_size)
            self._backward_scratch, nbytes = _carve(self.xp, self.dtype, {
                "dgx": (T * N, D * GH),
                "dgh": (T * N, D * GH if cfg.cell.split_gate_grads else 0),
                "dys": (T, N, D * R if cfg.num_layers > 1 else 0),
                "dy_masked": (T, N, D * R if proj else 0),
                "zeros_out": (T, N, D * R),
                "dr": (T, N, R if proj else 0),        # gradient w.r.t. each step's r
                "dhraw": (N, H if proj else 0),
                "dh_rec": (N, R),
                "dh_carry": (N, R),
                "dc_carry": (N, H if cfg.cell.has_cell_state else 0),
                **(self.fused.backward_scratch(cfg, N) if self.fused
                   else {"wpack_rows": (0,)}),
            })
            self.nbytes += nbytes
        return self._backward_scratch

    def backward(self, reserve, data, params, h0, c0, opts, dout, dhy, dcy):
        """Gradients (data, parameters, state, state_cell) of sum(out*dout) + sum(hy*dhy)
        + sum(cy*dcy); any head gradient may be None (zero)."""
        xp, cfg, T, N = self.xp, self.config, self.T, self.N
        L, D, H, R = cfg.num_layers, cfg.directions, cfg.state_size, cfg.recurrent_size
        cell, lay = cfg.cell, self.layout
        b = self._backward_buffers()
        g_params = xp.empty(lay.size, dtype=self.dtype)
        g_data = xp.empty(data.shape, dtype=self.dtype)
        g_h0 = xp.empty((L * D, N, R), dtype=self.dtype)
        g_c0 = xp.empty((L * D, N, H), dtype=self.dtype) if cell.has_cell_state else None
        masks = self._length_masks(opts)
        if dout is None:
            b.zeros_out[...] = 0
            dout = b.zeros_out
        dy = dout
        for layer in range(L - 1, -1, -1):
            x2d = (data if layer == 0 else reserve.ys[layer - 1]).reshape(T * N, -1)
            if cfg.projection_size and masks[0] is not None:
                xp.multiply(dy, masks[0], out=b.dy_masked)  # y is constant 0 past a length
                dy = b.dy_masked
            for d in range(D):
                self._direction_backward(layer, d, reserve, params, g_params, x2d, dy, dhy, dcy,
                                         opts, masks, b, g_h0, g_c0)
            dx = g_data if layer == 0 else b.dys
            xp.matmul(b.dgx, self._packed_wx(params, layer), out=dx.reshape(T * N, -1))
            if layer > 0 and reserve.masks:
                b.dys *= reserve.masks[layer - 1]
            dy = b.dys
        return g_data, g_params, g_h0, g_c0

    def _direction_backward(self, layer, d, reserve, params, g_params, x2d, dy, dhy, dcy,
                            opts, masks, b, g_h0, g_c0):
        xp, cfg, T, N, lay = self.xp, self.config, self.T, self.N, self.layout
        D, GH, R = cfg.directions, cfg.gate_rows, cfg.recurrent_size
        cell, empty, proj = cfg.cell, self.scratch.empty, bool(cfg.projection_size)
        hs, cs, saved = reserve.hs[layer], reserve.cs[layer], reserve.saved[layer]
        lstm = cell.has_cell_state
        dgh = b.dgh if cell.split_gate_grads else b.dgx
        dgx3, dgh3 = b.dgx.reshape(T, N, D * GH), dgh.reshape(T, N, D * GH)
        idx, prev, cols = layer * D + d, PREV[d], slice(d * GH, (d + 1) * GH)
        w_h = lay.view(params, layer, d, "W_h")
        w_r = lay.view(params, layer, d, "W_r") if proj else None
        # dh_carry: gradient reaching h_{t-1} directly (GRU's z*dh; inactive steps pass
        # dh through). The projected path passes inactive steps' dr through below instead.
        use_h_carry = not proj and (cell.carry == "h" or opts.lengths is not None)
        h_carry = b.dh_carry if use_h_carry else empty
        c_carry = b.dc_carry if lstm else empty
        b.dh_rec[...] = dhy[idx] if dhy is not None else 0
        if use_h_carry:
            b.dh_carry[...] = 0
        if lstm:
            b.dc_carry[...] = dcy[idx] if dcy is not None else 0
        if self.fused is not None:
            self._fused_direction_backward(d, w_h, dy, hs, cs, saved, dgx3, dgh3, b, opts,
                                           zero_carry=not use_h_carry)
            use_h_carry = True   # the fused loop always returns a direct carry
        else:
            self._generic_direction_backward(d, w_h, w_r, dy, hs, cs, saved, dgx3, dgh3, b,
                                             opts, masks, h_carry, c_carry)
        g_h0[idx] = b.dh_rec
        if use_h_carry:
            g_h0[idx] += b.dh_carry
        if lstm:
            g_c0[idx] = b.dc_carry
        # Weight gradients: one GEMM over all T*N rows per direction.
        xp.matmul(b.dgx[:, cols].T, x2d, out=lay.view(g_params, layer, d, "W_x"))
        xp.matmul(dgh[:, cols].T, hs[d, prev:prev + T].reshape(T * N, R),
                  out=lay.view(g_params, layer, d, "W_h"))
        if proj:
            xp.matmul(b.dr.reshape(T * N, R).T, reserve.hraw[layer, d].reshape(T * N, -1),
                      out=lay.view(g_params, layer, d, "W_r"))
        xp.sum(b.dgx[:, cols], axis=0, out=lay.view(g_params, layer, d, "b_x"))
        xp.sum(dgh[:, cols], axis=0, out=lay.view(g_params, layer, d, "b_h"))

    def _generic_direction_backward(self, d, w_h, w_r, dy, hs, cs, saved, dgx3, dgh3, b, opts,
                                    masks, h_carry, c_carry):
        """Per step: the cell's backward kernel, then dh_rec = dg @ W_h (numpy's GEMM)."""
        xp, cfg, R = self.xp, self.config, self.config.recurrent_size
        cell, empty, proj, lstm = cfg.cell, self.scratch.empty, bool(cfg.projection_size), \
            cfg.cell.has_cell_state
        prev, nxt, GH = PREV[d], NEXT[d], cfg.gate_rows
        cols, inactive = slice(d * GH, (d + 1) * GH), masks[1]
        for t in reversed(self._steps(d)):
            c_prev = cs[d, t + prev] if lstm else empty
            c_t = cs[d, t + nxt] if lstm else empty
            if proj:
                xp.add(dy[t, :, d * R:(d + 1) * R], b.dh_rec, out=b.dr[t])
                xp.matmul(b.dr[t], w_r, out=b.dhraw)
                self.backward_step(b.dhraw, empty, empty, c_carry, saved[d, t], empty, c_prev,
                                   c_t, dgx3[t, :, cols], empty, empty, c_carry,
                                   *self._step_tail(opts, t))
                xp.matmul(dgx3[t, :, cols], w_h, out=b.dh_rec)
                if inactive is not None:
                    xp.copyto(b.dh_rec, b.dr[t], where=inactive[t])
            else:
                self.backward_step(dy[t, :, d * R:(d + 1) * R], b.dh_rec, h_carry, c_carry,
                                   saved[d, t], hs[d, t + prev], c_prev, c_t, dgx3[t, :, cols],
                                   dgh3[t, :, cols] if cell.split_gate_grads else empty,
                                   h_carry, c_carry, *self._step_tail(opts, t))
                xp.matmul(dgh3[t, :, cols], w_h, out=b.dh_rec)

    def _fused_direction_backward(self, d, w_h, dy, hs, cs, saved, dgx3, dgh3, b, opts,
                                  zero_carry):
        """The backend's whole-direction backward loop (cpu/fused.py), then the last
        dh_rec = dg @ W_h of the direction's first step."""
        xp, T, N, GH = self.xp, self.T, self.N, self.config.gate_rows
        if zero_carry:
            b.dh_carry[...] = 0
        w_h_rows = self.fused.pack_rows(w_h, b.wpack_rows)
        split = self.config.cell.split_gate_grads
        self.fused.backward(xp.ascontiguousarray(dy), d, w_h_rows, hs, cs, saved, dgx3,
                            dgh3 if split else b.dgh.reshape(T, N, 0), b.dh_rec, b.dh_carry,
                            b.dc_carry, self.scratch.tiles,
                            self.no_lengths if opts.lengths is None else opts.lengths,
                            opts.clip_lo, opts.clip_hi, opts.clip_flags)
        first = 0 if d == 0 else T - 1
        xp.matmul(dgh3[first, :, d * GH:(d + 1) * GH], w_h, out=b.dh_rec)
