"""The recurrence that drives a cell over layers, directions and time steps.

Written once against an array module `xp` (numpy or cupy) and a backend's per-step
cell kernels (see fusedrnn/cpu/cells.py for their contract), so CPU and GPU share it.

Per layer: all time steps' input projections in one GEMM (both directions at once);
per step one recurrent GEMM and one fused pointwise kernel. Backward mirrors it, and
computes the weight gradients as one GEMM over all steps per direction.

State-sequence indexing: for direction d, `hs[d]` has T+1 rows. The forward direction
keeps its initial state in row 0 and h_t in row t+1; the backward direction keeps h_t in
row t and its initial state in row T. So for either direction the state before step t is
row t + PREV[d], the state after it row t + NEXT[d], and the T "previous states" that
W_h's gradient needs are one contiguous block, rows PREV[d] .. PREV[d] + T.
"""
from __future__ import annotations

from types import SimpleNamespace

from .layout import ParamLayout

PREV = (0, 1)   # row offset of h_{t-1} (in processing order) for direction 0 / 1
NEXT = (1, 0)   # row offset of h_t


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
        T, N, L, D = seq_len, batch, config.num_layers, config.directions
        GH, H, R = config.gate_rows, config.state_size, config.recurrent_size
        lstm = config.cell.has_cell_state
        max_in = max(config.layer_input_size(layer) for layer in range(L))
        shapes = {
            "xproj": (T * N, D * GH),
            "gh": (N, GH),
            "wx_packed": (D * GH * max_in if D > 1 else 0,),
            "hs": (D, T + 1, N, R),        # inference only: training uses the reserve's
            "cs": (D, T + 1, N, H if lstm else 0),
            "ys": (min(L - 1, 2), T, N, D * R),
            "empty": (0, 0),
        }
        self.scratch, self.nbytes = _carve(self.xp, dtype, shapes)
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
            "saved": (L, D, T, N, cfg.cell.saved * H),
            "ys": (L - 1, T, N, D * R),    # inputs of layers 1..L-1, for W_x's gradient
        })
        reserve.nbytes = nbytes
        return reserve

    def give_back_reserve(self, reserve):
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

    def _steps(self, d):
        return range(self.T) if d == 0 else range(self.T - 1, -1, -1)

    # -- forward ----------------------------------------------------------------------
    def forward(self, data, params, h0, c0, reserve=None):
        """Returns (out, hy, cy); cy is None without a cell state. With a reserve,
        records what backward needs into it."""
        xp, cfg, T, N = self.xp, self.config, self.T, self.N
        L, D, H, R = cfg.num_layers, cfg.directions, cfg.state_size, cfg.recurrent_size
        lstm = cfg.cell.has_cell_state
        out = xp.empty((T, N, D * R), dtype=self.dtype)
        hy = xp.empty((L * D, N, R), dtype=self.dtype)
        cy = xp.empty((L * D, N, H), dtype=self.dtype) if lstm else None
        x = data
        for layer in range(L):
            if layer == L - 1:
                y = out
            else:
                y = reserve.ys[layer] if reserve is not None else self.scratch.ys[layer % 2]
            hs = reserve.hs[layer] if reserve is not None else self.scratch.hs
            cs = reserve.cs[layer] if reserve is not None else self.scratch.cs
            saved = reserve.saved[layer] if reserve is not None else None
            self._layer_forward(layer, x, params, h0, c0, y, hs, cs, saved)
            for d in range(D):
                last = T if d == 0 else 0
                hy[layer * D + d] = hs[d, last]
                if lstm:
                    cy[layer * D + d] = cs[d, last]
            x = y
        return out, hy, cy

    def _layer_forward(self, layer, x, params, h0, c0, y, hs, cs, saved):
        xp, cfg, T, N = self.xp, self.config, self.T, self.N
        D, GH, R = cfg.directions, cfg.gate_rows, cfg.recurrent_size
        lstm, empty, s = cfg.cell.has_cell_state, self.scratch.empty, self.scratch
        xp.matmul(x.reshape(T * N, -1), self._packed_wx(params, layer).T, out=s.xproj)
        xproj = s.xproj.reshape(T, N, D * GH)
        for d in range(D):
            w_h = self.layout.view(params, layer, d, "W_h")
            b_x = self.layout.view(params, layer, d, "b_x")
            b_h = self.layout.view(params, layer, d, "b_h")
            first, prev, nxt = (0 if d == 0 else T), PREV[d], NEXT[d]
            idx = layer * D + d
            hs[d, first] = h0[idx] if h0 is not None else 0
            if lstm:
                cs[d, first] = c0[idx] if c0 is not None else 0
            for t in self._steps(d):
                xp.matmul(hs[d, t + prev], w_h.T, out=s.gh)
                self.forward_step(
                    xproj[t, :, d * GH:(d + 1) * GH], s.gh, b_x, b_h,
                    hs[d, t + prev], cs[d, t + prev] if lstm else empty,
                    hs[d, t + nxt], cs[d, t + nxt] if lstm else empty,
                    y[t, :, d * R:(d + 1) * R],
                    saved[d, t] if saved is not None else empty)

    # -- backward ---------------------------------------------------------------------
    def _backward_buffers(self):
        if self._backward_scratch is None:
            cfg, T, N = self.config, self.T, self.N
            D, GH, H, R = cfg.directions, cfg.gate_rows, cfg.state_size, cfg.recurrent_size
            self._backward_scratch, nbytes = _carve(self.xp, self.dtype, {
                "dgx": (T * N, D * GH),
                "dgh": (T * N, D * GH if cfg.cell.split_gate_grads else 0),
                "dys": (T, N, D * R if cfg.num_layers > 1 else 0),
                "zeros_out": (T, N, D * R),
                "dh_rec": (N, R),
                "dcarry": (N, H if cfg.cell.carry else 0),
            })
            self.nbytes += nbytes
        return self._backward_scratch

    def backward(self, reserve, data, params, h0, c0, dout, dhy, dcy):
        """Gradients (data, parameters, state, state_cell) of sum(out*dout) + sum(hy*dhy)
        + sum(cy*dcy); any head gradient may be None (zero)."""
        xp, cfg, T, N = self.xp, self.config, self.T, self.N
        L, D, GH, R = cfg.num_layers, cfg.directions, cfg.gate_rows, cfg.recurrent_size
        cell, empty, lay = cfg.cell, self.scratch.empty, self.layout
        b = self._backward_buffers()
        g_params = xp.empty(lay.size, dtype=self.dtype)
        g_data = xp.empty(data.shape, dtype=self.dtype)
        g_h0 = xp.empty((L * D, N, R), dtype=self.dtype)
        g_c0 = xp.empty((L * D, N, cfg.state_size), dtype=self.dtype) if cell.has_cell_state else None
        dgh = b.dgh if cell.split_gate_grads else b.dgx
        if dout is None:
            b.zeros_out[...] = 0
            dout = b.zeros_out
        dy = dout
        for layer in range(L - 1, -1, -1):
            x2d = (data if layer == 0 else reserve.ys[layer - 1]).reshape(T * N, -1)
            hs, cs, saved = reserve.hs[layer], reserve.cs[layer], reserve.saved[layer]
            dgx3, dgh3 = b.dgx.reshape(T, N, D * GH), dgh.reshape(T, N, D * GH)
            for d in range(D):
                idx, prev, nxt, cols = layer * D + d, PREV[d], NEXT[d], slice(d * GH, (d + 1) * GH)
                w_h = lay.view(params, layer, d, "W_h")
                b.dh_rec[...] = dhy[idx] if dhy is not None else 0
                if cell.carry:
                    b.dcarry[...] = dcy[idx] if (dcy is not None and cell.carry == "c") else 0
                carry = b.dcarry if cell.carry else empty
                for t in reversed(self._steps(d)):
                    self.backward_step(
                        dy[t, :, d * R:(d + 1) * R], b.dh_rec, carry, saved[d, t],
                        hs[d, t + prev],
                        cs[d, t + prev] if cell.has_cell_state else empty,
                        cs[d, t + nxt] if cell.has_cell_state else empty,
                        dgx3[t, :, cols], dgh3[t, :, cols] if cell.split_gate_grads else empty,
                        carry)
                    xp.matmul(dgh3[t, :, cols], w_h, out=b.dh_rec)
                g_h0[idx] = b.dh_rec
                if cell.carry == "h":
                    g_h0[idx] += b.dcarry
                elif cell.carry == "c":
                    g_c0[idx] = b.dcarry
                # Weight gradients: one GEMM over all T*N rows per direction.
                xp.matmul(b.dgx[:, cols].T, x2d, out=lay.view(g_params, layer, d, "W_x"))
                xp.matmul(dgh[:, cols].T, hs[d, prev:prev + T].reshape(T * N, R),
                          out=lay.view(g_params, layer, d, "W_h"))
                xp.sum(b.dgx[:, cols], axis=0, out=lay.view(g_params, layer, d, "b_x"))
                xp.sum(dgh[:, cols], axis=0, out=lay.view(g_params, layer, d, "b_h"))
            dx = g_data if layer == 0 else b.dys
            xp.matmul(b.dgx, self._packed_wx(params, layer), out=dx.reshape(T * N, -1))
            dy = b.dys
        return g_data, g_params, g_h0, g_c0
