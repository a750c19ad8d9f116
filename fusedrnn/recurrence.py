"""The recurrence that drives a cell over layers, directions and time steps.

Written once against an array module `xp` (numpy or cupy) and a backend's per-step
cell kernels (fusedrnn/cpu/cells.py documents their contract), so CPU and GPU share it.

Per layer: all time steps' input projections in one GEMM (both directions at once),
then each direction's time loop, by one of two drivers: StepDriver, per step one
recurrent GEMM and one pointwise cell kernel (plus, for a projected LSTM, the W_r GEMM);
or FusedDriver, one call of the backend's whole-layer loop (a FusedLayer, below).
Backward mirrors it and computes the weight gradients as one GEMM over all steps per
direction, whichever driver ran the loop.

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

import contextlib
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol, runtime_checkable

import numpy as np

from .config import PRECISIONS, TORCH_CALLER
from .layout import ParamLayout

PREV = (0, 1)   # row offset of h_{t-1} (in processing order) for direction 0 / 1
NEXT = (1, 0)   # row offset of h_t
_NO_MASKS = (None, None)   # _length_masks without lengths
_NO_SCOPE = contextlib.nullcontext()   # (reusable: one, not one a call)
# `opts` below is a config.CallOptions (validate builds it; config: why it lives there).


_CARVE_ALIGN = 64   # bytes: each view starts on a cache line (and so 16-byte aligned, as
                    # the GPU's 16-byte staging loads need: persistent.cuh)


def _carve(xp, dtype, shapes):
    """One allocation split into named C-contiguous views, each starting _CARVE_ALIGN
    bytes into an aligned allocation; returns (namespace, nbytes)."""
    step = max(1, _CARVE_ALIGN // np.dtype(dtype).itemsize)
    starts, offset = {}, 0
    for name, shape in shapes.items():
        starts[name] = offset
        offset += -(-_prod(shape) // step) * step
    flat = xp.empty(offset + step, dtype=dtype)   # room to move the start to a line
    skip = (-(flat.data.ptr if hasattr(flat.data, "ptr") else flat.ctypes.data)
            // np.dtype(dtype).itemsize) % step
    views = {name: flat[skip + starts[name]:skip + starts[name] + _prod(shape)].reshape(shape)
             for name, shape in shapes.items()}
    return SimpleNamespace(**views), flat.nbytes


def _prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n


@runtime_checkable
class FusedLayer(Protocol):
    """A backend's whole-layer loop: one call runs every step of one layer and direction.

    cpu/fused.py's FusedLayer (one Numba parallel region) and gpu/persistent.py's
    PersistentLayer (one persistent kernel) implement it; backend.fused_layer returns one,
    or None where it does not apply (the StepDriver then runs the layer). Arrays follow
    the row convention above; cpu/fused.py documents each argument's shape and aliasing.
    """

    projects_input: bool      # True: it also implements InputProjection (its own W_x GEMM)
    fuses_single_step: bool   # True: it also implements SingleStep (used at T=1)
    reads_storage: bool       # True: project() also takes layer 0's input in the data's
                              # own dtype (half precision), read in place
    reads_weights: bool       # True: project(), forward() and forward_single() also take
                              # W_x and W_h in the data's own dtype (the parameters in
                              # place; biases float32)

    def forward_scratch(self, config, steps, batch) -> dict:
        """{name: shape} of scratch in the data's dtype, carved once per op; forward and
        forward_single receive it as a namespace of those names."""

    def backward_scratch(self, config, batch) -> dict:
        """{name: shape} backward needs beyond forward_scratch's; backward receives both."""

    def fuses_input(self, steps, batch) -> bool:
        """True: at this size forward() multiplies W_x x_t itself, from the layer's
        input_pairs(x2d, scratch) (a method such a layer has beside this protocol's) and
        W_x (keywords x_pairs and w_x), and takes no xproj (None); project() is not
        called."""

    def forward(self, xproj, d, w_h, bx, bh, hs, cs, y, saved, scratch, lengths, clip_lo,
                clip_hi, clip_flags, x_pairs=None, w_x=None) -> None:
        """Direction d of one layer: xproj (T, N, D*G*H) holds W_x x_t of both directions
        (no bias); hs/cs hold the initial state; writes hs, cs, y's columns of d, and
        saved (the training record) unless it is (0, 0, 0, 0). Where fuses_input: xproj
        None, x_pairs and w_x given instead."""

    def backward(self, dy, d, w_h, hs, cs, saved, dgx, dgh, dh_rec0, dh_carry, dc_carry,
                 scratch, lengths, clip_lo, clip_hi, clip_flags) -> None:
        """Direction d's backward loop; on exit dh_0 = dg_first @ W_h + dh_carry, the
        caller running that last GEMM (dg_first: dgh, or dgx, at d's first step)."""


@runtime_checkable
class InputProjection(Protocol):
    def project(self, x2d, w_xs, out, scratch) -> None:
        """out (T*N, D*G*H) = x2d @ [W_x of each direction]^T, replacing the BLAS GEMM."""


@runtime_checkable
class SingleStep(Protocol):
    def forward_single(self, x2d, d, w_x, w_h, bx, bh, hs, cs, y, saved, scratch, lengths,
                       clip_lo, clip_hi, clip_flags) -> None:
        """forward at T=1 from the layer input x2d (N, K) and the raw W_x."""

    def single_launcher(self, scratch, batch, input_size, state_size, x_dtype):
        """forward_single on this scratch for these sizes, as a function of its other
        arguments (x2d, d, w_x, w_h, bx, bh, hs, cs, y, saved, lengths, clip_lo, clip_hi,
        clip_flags); a driver keeps one per layer."""


@dataclass(frozen=True)
class PrecisionPlan:
    """How one op holds and multiplies its values, decided once per op (decide) from the
    data's dtype, the dtype it stands for, the backend's products and the fused layer's
    abilities; the op and its drivers read it and decide nothing of their own.

    io:                the data's dtype: arrays come in and leave in it.
    compute:           the dtype every value between the edges is held in
                       (config.PRECISIONS: float32 for the half dtypes).
    storage:           the half dtype the data is stored in: io's own, or the one float32
                       data stands for (op.RNN's _stored_as); None for float32/float64.
    half_gemms:        the backward's GEMMs run on the backend's products in `storage`
                       (CpuBackend: bfloat16 pairs; GpuBackend: cuBLAS in half) with
                       float32 sums, else in `compute`.
    projects_in_half:  the op's input projection too (backend.pair_projection at T*N).
    data_in_place:     an inference hands the fused layer the data as it came, unconverted
                       (FusedLayer.reads_storage, where the layer projects its own input).
    weights_in_place:  ... and the weights: the op converts the biases alone
                       (FusedLayer.reads_weights; the T=1 form too, its N rows converted).
    trains_in_place:   a training forward reads the data in place as well: the backward's
                       half GEMMs pack the data's bits as they are, so no float32 copy.
    fuses_input:       the fused layer multiplies W_x x_t in its loop: no projection.
    """

    io: str
    compute: str
    storage: str | None
    half_gemms: bool = False
    projects_in_half: bool = False
    data_in_place: bool = False
    weights_in_place: bool = False
    trains_in_place: bool = False
    fuses_input: bool = False

    @property
    def converts(self) -> bool:
        """Whether values are converted at the edges (io is a half dtype)."""
        return self.io != self.compute

    @staticmethod
    def storage_of(dtype, stored_as):
        """The half dtype data of `dtype` is stored in (stored_as: op.RNN's), or None."""
        return dtype.name if PRECISIONS[dtype.name].compute != dtype.name else stored_as

    @classmethod
    def decide(cls, backend, dtype, stored_as, layer, single, seq_len, batch):
        """The plan for data of `dtype` (`stored_as`: op.RNN's), the backend's fused layer
        (None: the per-step path), `single` where its T=1 form runs, at (seq_len, batch)."""
        compute, storage = PRECISIONS[dtype.name].compute, cls.storage_of(dtype, stored_as)
        half_gemms = storage is not None and backend.pair_products(storage)
        data_in_place = (layer is not None and layer.reads_storage and layer.projects_input
                         and not single)
        return cls(
            io=dtype.name, compute=compute, storage=storage, half_gemms=half_gemms,
            projects_in_half=half_gemms and backend.pair_projection(seq_len * batch),
            data_in_place=data_in_place,
            weights_in_place=(layer is not None and layer.reads_weights and
                              (data_in_place or single)),
            trains_in_place=data_in_place and half_gemms,
            fuses_input=(layer is not None and not single and
                         layer.fuses_input(seq_len, batch)))


class RecurrentOp:
    """One op instance for fixed (config, T, N, dtype) on one backend.

    Holds the driver (the backend's fused layer where it has one, else its per-step
    kernels), scratch buffers reused by every call (their contents never outlive a
    call), and a small pool of training reserves. A reserve belongs to exactly one
    training forward until its backward hands it back.
    """

    RESERVE_POOL = 1  # reserves kept for reuse; a training loop needs one

    def __init__(self, backend, config, seq_len, batch, dtype, stored_as=None):
        self.backend, self.config, self.xp = backend, config, backend.xp
        # column sums (the bias gradients): numpy's ufunc method skips np.sum's wrapper
        self._column_sums = np.add.reduce if self.xp is np else self.xp.sum
        self.io_dtype, self.dtype = dtype, np.dtype(PRECISIONS[dtype.name].compute)
        self.T, self.N = seq_len, batch
        self.layout = ParamLayout(config)
        layer = backend.fused_layer(config, self.dtype, batch,
                                    storage=PrecisionPlan.storage_of(dtype, stored_as))
        self.driver = FusedDriver(self, layer) if layer is not None else \
            StepDriver(self, *backend.cell_kernels(config.mode, self.dtype))
        self.plan = PrecisionPlan.decide(backend, dtype, stored_as, layer,
                                         layer is not None and self.driver.single, seq_len,
                                         batch)
        T, N, L, D = seq_len, batch, config.num_layers, config.directions
        GH, H, R = config.gate_rows, config.state_size, config.recurrent_size
        self._dims = (L, D, H, R, config.cell.has_cell_state)   # (read at every call)
        max_in = max(config.layer_input_size(layer) for layer in range(L))
        self.scratch, self.nbytes = _carve(self.xp, self.dtype, {
            "xproj": (0 if self.plan.fuses_input else T * N, D * GH),
            "wx_packed": (D * GH * max_in if D > 1 else 0,),
            "hs": (D, T + 1, N, R),        # inference only: training uses the reserve's
            "cs": (D, T + 1, N, H if config.cell.has_cell_state else 0),
            "ys": (min(L - 1, 2), T, N, D * R),
            **self._edge_buffers(scratch=True),
            "empty": (0, 0),
            # the input projection's half copies (project_input)
            "pairs": (max(backend.pair_scratch(T * N, config.layer_input_size(layer), D * GH)
                          for layer in range(L)) if self.plan.projects_in_half else 0,),
            **self.driver.forward_scratch(),
        })
        self.no_lengths = self.xp.empty(0, dtype="int64")
        # Where the op's GEMMs run (the CPU backend caps BLAS's threads for small ones). The
        # forward of a fused layer that projects its own input runs no BLAS at all.
        self.blas = backend.blas_scope(config, seq_len, batch,
                                       own_gemms=self.plan.half_gemms and layer is not None)
        self._forward_blas = self.blas if not (
            layer is not None and layer.projects_input) else None
        self._backward_scratch = None
        self._together_in = {}   # _together's answers
        self._reserve_pool = []
        # One call at a time: a training handle carries its op to whichever thread runs the
        # backward (torch's autograd runs a CUDA backward on its own device thread), while
        # the forward's thread may call the op again. Re-entrant: a handle released by the
        # garbage collector (the torch integration's finalizer) during this op's own call
        # gives its reserve back from inside it.
        self.lock = threading.RLock()
        # The stream of the op's last call (GpuBackend.follow: a call from another thread,
        # on another stream, waits for it); None on the CPU.
        self.last_stream = None

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
            **{k: v for k, v in self._edge_buffers().items() if k != "out32"},
        })
        reserve.nbytes, reserve.masks, reserve.inputs = nbytes, [], None
        return reserve

    def give_back_reserve(self, reserve):
        reserve.masks, reserve.inputs = [], None
        if len(self._reserve_pool) < self.RESERVE_POOL:
            self._reserve_pool.append(reserve)
            self.nbytes += reserve.nbytes

    # -- helpers the drivers share ----------------------------------------------------
    def packed_wx(self, params, layer):
        """(D*G*H, In) input weights of both directions, contiguous, for one GEMM."""
        D = self.config.directions
        if D == 1:
            return self.layout.view(params, layer, 0, "W_x")
        GH, n_in = self.config.gate_rows, self.config.layer_input_size(layer)
        packed = self.scratch.wx_packed[:D * GH * n_in].reshape(D * GH, n_in)
        for d in range(D):
            packed[d * GH:(d + 1) * GH] = self.layout.view(params, layer, d, "W_x")
        return packed

    def project_input(self, layer, x, params):
        """scratch.xproj = W_x x_t of every step and both directions, one GEMM (in half
        where the plan projects_in_half)."""
        x2d = x.reshape(self.T * self.N, -1)
        w_t = self.packed_wx(params, layer).T
        if self.plan.projects_in_half:
            self.backend.matmul(x2d, w_t, self.scratch.xproj,
                                pairs=self.scratch.pairs.view(np.uint32), half=self.plan.storage)
        else:
            self.backend.matmul(x2d, w_t, self.scratch.xproj)

    def steps(self, d):
        return range(self.T) if d == 0 else range(self.T - 1, -1, -1)

    def initial_state(self, layer, d, h0, c0, hs, cs):
        idx, first = layer * self._dims[1] + d, (0 if d == 0 else self.T)
        hs[d, first] = h0[idx] if h0 is not None else 0
        if self._dims[4]:
            cs[d, first] = c0[idx] if c0 is not None else 0

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

    # -- half precision at the edges ---------------------------------------------------
    # float16 and bfloat16 arrays (config.PRECISIONS) are converted to float32 as they
    # enter, and the results back (rounded to nearest even) as they leave; between the two
    # every value is float32, except where a backend's fused layer reads the data as it
    # came (FusedLayer.reads_storage). The float32 copies of data and parameters, and the
    # output before its rounding, live in the op's scratch (x32, p32, out32: reused, so no
    # call pays fresh pages for them); a training forward keeps its copies in the reserve
    # (x32, p32, and reserve.inputs) for its backward, beside the float32 record.
    # Outputs and gradients leave in the data's dtype. An inference that reads the data
    # in place needs no x32 in the scratch.
    def _edge_buffers(self, scratch=False):
        T, N, cfg = self.T, self.N, self.config
        on, plan = self.plan.converts, self.plan
        data = on and not (plan.trains_in_place or (scratch and plan.data_in_place))
        biases = scratch and plan.weights_in_place   # then no p32 either
        return {"b32": (cfg.num_layers * cfg.directions * 2 * cfg.gate_rows if biases else 0,),
                "x32": (T if data else 0, N, cfg.input_size),
                "p32": (self.layout.size if on and not biases else 0,),
                "out32": (T if on else 0, N, cfg.directions * cfg.recurrent_size)}

    def _backward_edges(self):
        T, N, cfg = self.T, self.N, self.config
        on = self.plan.converts
        return {"dout32": (T if on else 0, N, cfg.directions * cfg.recurrent_size),
                "g_data32": (T if on else 0, N, cfg.input_size),
                "g_params32": (self.layout.size if on else 0,)}

    def _inward(self, *arrays):
        return tuple(None if a is None else self.backend.astype(a, self.dtype) for a in arrays)

    def _outward(self, *arrays):
        return tuple(None if a is None else self.backend.astype(a, self.io_dtype)
                     for a in arrays)

    # -- forward ----------------------------------------------------------------------
    def forward(self, data, params, h0, c0, opts, reserve=None, states=True):
        """Returns (out, hy, cy); cy is None without a cell state, hy and cy None unless
        `states` (a call without state_outputs needs no copies). With a
        reserve, records what backward needs into it."""
        out = biases = None
        if self.plan.converts:
            keep, convert = (reserve or self.scratch), self.backend.astype
            if not (self.plan.data_in_place and (reserve is None or
                                                 self.plan.trains_in_place)):
                data = convert(data, self.dtype, keep.x32)
            if self.plan.weights_in_place and reserve is None:
                biases = self._biases(params)   # the weights are read as they came
            else:
                params = convert(params, self.dtype, keep.p32)
            h0, c0 = self._inward(h0, c0)
            if reserve is not None:
                reserve.inputs = (data, params, h0, c0)
            out = self.scratch.out32
        if self._forward_blas is None:
            outputs = self._forward(data, params, h0, c0, opts, reserve, out, biases, states)
        else:
            with self._forward_blas:
                outputs = self._forward(data, params, h0, c0, opts, reserve, out, biases,
                                        states)
        return self._outward(*outputs) if self.plan.converts else outputs

    def _biases(self, params):
        """{(layer, d, kind): float32 bias} for kind b_x and b_h, converted into scratch.b32
        from the half-precision parameters in one conversion: the layout keeps every bias
        after the weights, in b32's order."""
        blocks, GH = self.layout.blocks, self.config.gate_rows
        start = blocks[0, 0, "b_x"][0]
        b32 = self.backend.astype(params[start:], self.dtype, self.scratch.b32)
        return {key: b32[offset - start:offset - start + GH]
                for key, (offset, _) in blocks.items() if key[2] in ("b_x", "b_h")}

    def _forward(self, data, params, h0, c0, opts, reserve, out=None, biases=None,
                 states=True):
        xp, T, N = self.xp, self.T, self.N
        L, D, H, R, lstm = self._dims
        training = reserve is not None
        if out is None:
            out = xp.empty((T, N, D * R), dtype=self.dtype)
        hy = xp.empty((L * D, N, R), dtype=self.dtype) if states else None
        cy = xp.empty((L * D, N, H), dtype=self.dtype) if lstm and states else None
        masks = _NO_MASKS if opts.lengths is None else self._length_masks(opts)
        dropout = self._dropout_masks(opts) if training and opts.dropout > 0 else []
        x = data
        for layer in range(L):
            if layer == L - 1:
                y = out
            else:
                y = reserve.ys[layer] if training else self.scratch.ys[layer % 2]
            hs = reserve.hs[layer] if training else self.scratch.hs
            cs = reserve.cs[layer] if training else self.scratch.cs
            self.driver.layer_forward(layer, x, params, h0, c0, y, opts, masks, hs, cs,
                                      hraw=reserve.hraw[layer] if training else None,
                                      saved=reserve.saved[layer] if training else None,
                                      biases=biases)
            for d in range(D if states else 0):
                last = T if d == 0 else 0
                hy[layer * D + d] = hs[d, last]
                if lstm:
                    cy[layer * D + d] = cs[d, last]
            if dropout and layer < L - 1:
                y *= dropout[layer]
            x = y
        if training:
            reserve.masks = dropout
        return out, hy, cy

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
                "dh_rec": (N, R),
                "dh_carry": (N, R),
                # the first steps' dh_rec products, one per direction (_backward: together)
                "dh_first": (D if self.driver.takes_jobs else 0, N, R),
                "dc_carry": (N, H if cfg.cell.has_cell_state else 0),
                "pairs": (self._pair_scratch(),),   # 4-byte elements, viewed as uint32
                # half precision: the float32 head gradient and the float32 gradients of
                # data and parameters before their rounding, reused (fresh arrays paid
                # their page faults on every call: _backward_edges)
                **self._backward_edges(),
                **self.driver.backward_scratch(),
            })
            self.nbytes += nbytes
        return self._backward_scratch

    def _gemm_shapes(self):
        """(M, K, C) of each of the backward's GEMMs (_gemm)."""
        cfg, TN = self.config, self.T * self.N
        D, GH, H, R = cfg.directions, cfg.gate_rows, cfg.state_size, cfg.recurrent_size
        for layer in range(cfg.num_layers):
            n_in = cfg.layer_input_size(layer)
            yield from ((TN, D * GH, n_in), (GH, TN, n_in), (GH, TN, R))
            if cfg.projection_size:
                yield R, TN, H

    def _pair_scratch(self):
        if not self.plan.half_gemms:
            return 0
        return max(self.backend.pair_scratch(*shape) for shape in self._gemm_shapes())

    def _gemm(self, b, a, w, out, transpose_a=False, a_again=False):
        """out = a @ w (a^T @ w): the backward's GEMMs, on the backend's half-precision
        products where the plan has them (half_gemms), else in self.dtype. a_again: the
        same a as the call before (its pairs are reused)."""
        if self.plan.half_gemms:
            return self.backend.matmul(a, w, out, transpose_a, pairs=b.pairs.view(np.uint32),
                                       a_paired=a_again, half=self.plan.storage)
        return self.backend.matmul(a, w, out, transpose_a)

    def backward(self, reserve, data, params, h0, c0, opts, dout, dhy, dcy):
        """Gradients (data, parameters, state, state_cell) of sum(out*dout) + sum(hy*dhy)
        + sum(cy*dcy); any head gradient may be None (zero)."""
        if self.plan.converts:
            data, params, h0, c0 = reserve.inputs
            b = self._backward_buffers()
            if dout is not None:
                dout = self.backend.astype(dout, self.dtype, b.dout32)
            dhy, dcy = self._inward(dhy, dcy)
        together = self._together()
        # (every product together on the backend's own kernel: no BLAS call to scope)
        with self.blas if not all(together) else _NO_SCOPE:
            grads = self._backward(reserve, data, params, h0, c0, opts, dout, dhy, dcy,
                                   together)
        return self._outward(*grads) if self.plan.converts else grads

    def _together(self):
        """Per layer, whether the backward's products go to the backend together (its
        step_products at T=1, sequence_products past it), remembered for a numpy and for a
        torch program's calls (the one fact of a call it reads: config.TORCH_CALLER)."""
        program = TORCH_CALLER.get() is None
        together = self._together_in.get(program)
        if together is None:
            cfg, rows, backend = self.config, self.T * self.N, self.backend
            GH, D, R = cfg.gate_rows, cfg.directions, cfg.recurrent_size

            def goes(n_in):   # (a single step's four products in all; else the largest)
                if self.driver.single:
                    return backend.step_products(self.dtype, 2 * rows * D * GH * (n_in + R))
                return backend.sequence_products(self.dtype, rows, rows * GH * max(D * n_in, R))
            together = self._together_in[program] = tuple(
                self.driver.takes_jobs and not self.plan.half_gemms and
                goes(cfg.layer_input_size(layer)) for layer in range(cfg.num_layers))
        return together

    def _backward(self, reserve, data, params, h0, c0, opts, dout, dhy, dcy, together):
        """backward's body; together: _together()'s answer for this call."""
        xp, cfg, T, N = self.xp, self.config, self.T, self.N
        L, D, H, R = cfg.num_layers, cfg.directions, cfg.state_size, cfg.recurrent_size
        cell, lay = cfg.cell, self.layout
        b = self._backward_buffers()
        if self.plan.converts:   # rounded into fresh arrays as they leave
            g_params, g_data = b.g_params32, b.g_data32
        else:
            g_params = xp.empty(lay.size, dtype=self.dtype)
            g_data = xp.empty(data.shape, dtype=self.dtype)
        # No initial state: its gradient is not returned (op.rnn_backward), nor computed
        # Measured: bench/results/cpu-kernel-notes.md#op-no-products-for-an-absent-initial-state
        g_h0 = None if h0 is None else xp.empty((L * D, N, R), dtype=self.dtype)
        g_c0 = xp.empty((L * D, N, H), dtype=self.dtype) if cell.has_cell_state else None
        masks = self._length_masks(opts)
        if dout is None:
            b.zeros_out[...] = 0
            dout = b.zeros_out
        dy = dout
        # A layer's products (a single step's each too small for a launch of its own) go to
        # the backend together, once its directions are done, where it takes them.
        for layer in range(L - 1, -1, -1):
            x2d = (data if layer == 0 else reserve.ys[layer - 1]).reshape(T * N, -1)
            if cfg.projection_size and masks[0] is not None:
                xp.multiply(dy, masks[0], out=b.dy_masked)  # y is constant 0 past a length
                dy = b.dy_masked
            jobs = [] if together[layer] else None
            for d in range(D):
                self._direction_backward(layer, d, reserve, params, g_params, x2d, dy, dhy, dcy,
                                         opts, masks, b, g_h0, g_c0, jobs)
            dx = g_data if layer == 0 else b.dys
            if jobs is not None:
                jobs.append((b.dgx, self.packed_wx(params, layer), dx.reshape(T * N, -1), False))
                self.backend.products(jobs, self.dtype)
                if g_h0 is not None:
                    g_h0[layer * D:(layer + 1) * D] += b.dh_first
            else:
                self._gemm(b, b.dgx, self.packed_wx(params, layer), dx.reshape(T * N, -1))
            if layer > 0 and reserve.masks:
                b.dys *= reserve.masks[layer - 1]
            dy = b.dys
        return g_data, g_params, g_h0, g_c0

    def _direction_backward(self, layer, d, reserve, params, g_params, x2d, dy, dhy, dcy,
                            opts, masks, b, g_h0, g_c0, jobs=None):
        """One direction's loop, dh_0 (where g_h0 is not None: an initial state was
        given), dc_0 and parameter gradients; with `jobs` (a list) its GEMMs are appended
        there as (a, b, out, transpose_a), dh_rec's into dh_first."""
        cfg, T, N, lay = self.config, self.T, self.N, self.layout
        D, GH, R = cfg.directions, cfg.gate_rows, cfg.recurrent_size
        cell, proj = cfg.cell, bool(cfg.projection_size)
        hs = reserve.hs[layer]
        dgh = b.dgh if cell.split_gate_grads else b.dgx
        idx, prev, cols = layer * D + d, PREV[d], slice(d * GH, (d + 1) * GH)
        # dh_carry: gradient reaching h_{t-1} directly (GRU's z*dh; inactive steps pass
        # dh through). The projected path passes inactive steps' dr through instead.
        use_h_carry = not proj and (cell.carry == "h" or opts.lengths is not None)
        b.dh_rec[...] = dhy[idx] if dhy is not None else 0
        if use_h_carry:
            b.dh_carry[...] = 0
        if cell.has_cell_state:
            b.dc_carry[...] = dcy[idx] if dcy is not None else 0
        carried = self.driver.direction_backward(layer, d, reserve, params, dy, opts, masks,
                                                 b, use_h_carry, jobs, g_h0 is not None)
        if g_h0 is not None:
            if jobs is not None:   # (dh_rec's part comes with the products: _backward)
                g_h0[idx] = b.dh_carry if carried else 0
            else:
                g_h0[idx] = b.dh_rec
                if carried:
                    g_h0[idx] += b.dh_carry
        if cell.has_cell_state:
            g_c0[idx] = b.dc_carry
        # Weight gradients: one GEMM over all T*N rows per direction.
        w_grads = ((b.dgx[:, cols], x2d, lay.view(g_params, layer, d, "W_x")),
                   (dgh[:, cols], hs[d, prev:prev + T].reshape(T * N, R),
                    lay.view(g_params, layer, d, "W_h")))
        if g_h0 is None and T == 1:   # dG^T h_0 with h_0 = 0: a zero W_h gradient
            w_grads[1][2][...] = 0
            w_grads = w_grads[:1]
        gemm = self._gemm
        if jobs is not None:
            jobs += [(a, w, out, True) for a, w, out in w_grads]
        else:
            for k, (a, w, out) in enumerate(w_grads):
                gemm(b, a, w, out, transpose_a=True, a_again=k > 0 and not cell.split_gate_grads)
        if proj:
            gemm(b, b.dr.reshape(T * N, R), reserve.hraw[layer, d].reshape(T * N, -1),
                 lay.view(g_params, layer, d, "W_r"), transpose_a=True)
        sums = self._column_sums
        g_bx = sums(b.dgx[:, cols], axis=0, out=lay.view(g_params, layer, d, "b_x"))
        if cell.split_gate_grads:
            sums(dgh[:, cols], axis=0, out=lay.view(g_params, layer, d, "b_h"))
        else:   # the same sum (b_x and b_h enter the gates alike): taken once
            lay.view(g_params, layer, d, "b_h")[...] = g_bx


class StepDriver:
    """Per step: h_{t-1} @ W_h^T by the backend's GEMM, then its pointwise cell kernel
    (forward_step / backward_step: cpu/cells.py documents them). Serves every config,
    the projected LSTM included."""

    single = False   # (FusedDriver's T=1 form)
    takes_jobs = False   # (FusedDriver's backward defers its products)

    def __init__(self, op, forward_step, backward_step):
        self.op, self.forward_step, self.backward_step = op, forward_step, backward_step

    def forward_scratch(self):
        cfg, N = self.op.config, self.op.N
        return {"gh": (N, cfg.gate_rows),
                "hraw": (N, cfg.state_size if cfg.projection_size else 0)}  # one step's h

    def backward_scratch(self):
        cfg, N = self.op.config, self.op.N
        return {"dhraw": (N, cfg.state_size if cfg.projection_size else 0)}

    def _tail(self, opts, t):
        lengths = self.op.no_lengths if opts.lengths is None else opts.lengths
        return lengths, t, opts.clip_lo, opts.clip_hi, opts.clip_flags

    def layer_forward(self, layer, x, params, h0, c0, y, opts, masks, hs, cs, hraw, saved,
                      biases=None):
        if biases is not None:   # (only a FusedLayer that reads_weights gets them)
            raise ValueError("StepDriver.layer_forward: the parameters must be converted")
        op = self.op
        xp, cfg, T, N, s, lay = op.xp, op.config, op.T, op.N, op.scratch, op.layout
        D, GH, R = cfg.directions, cfg.gate_rows, cfg.recurrent_size
        lstm, proj, empty = cfg.cell.has_cell_state, bool(cfg.projection_size), s.empty
        xproj = s.xproj.reshape(T, N, D * GH)
        op.project_input(layer, x, params)
        active, inactive = masks
        for d in range(D):
            w_h, b_x, b_h = (lay.view(params, layer, d, k) for k in ("W_h", "b_x", "b_h"))
            w_r = lay.view(params, layer, d, "W_r") if proj else None
            prev, nxt = PREV[d], NEXT[d]
            op.initial_state(layer, d, h0, c0, hs, cs)
            for t in op.steps(d):
                xp.matmul(hs[d, t + prev], w_h.T, out=s.gh)
                c_prev = cs[d, t + prev] if lstm else empty
                c_next = cs[d, t + nxt] if lstm else empty
                record = saved[d, t] if saved is not None else empty
                if proj:
                    # The cell yields h (N, H); the state and output are r = W_r h (N, P).
                    h = hraw[d, t] if hraw is not None else s.hraw
                    self.forward_step(xproj[t, :, d * GH:(d + 1) * GH], s.gh, b_x, b_h, empty,
                                      c_prev, h, c_next, h, record, *self._tail(opts, t))
                    xp.matmul(h, w_r.T, out=hs[d, t + nxt])
                    if inactive is not None:
                        xp.copyto(hs[d, t + nxt], hs[d, t + prev], where=inactive[t])
                else:
                    self.forward_step(xproj[t, :, d * GH:(d + 1) * GH], s.gh, b_x, b_h,
                                      hs[d, t + prev], c_prev, hs[d, t + nxt], c_next,
                                      y[t, :, d * R:(d + 1) * R], record,
                                      *self._tail(opts, t))
            if proj:  # the layer output is the state sequence, zero past each length
                states = hs[d, nxt:nxt + T]
                if active is not None:
                    xp.multiply(states, active, out=y[:, :, d * R:(d + 1) * R])
                else:
                    y[:, :, d * R:(d + 1) * R] = states

    def direction_backward(self, layer, d, reserve, params, dy, opts, masks, b, use_h_carry,
                           jobs=None, state_grad=True):
        """Per step: the cell's backward kernel, then dh_rec = dg @ W_h (the backend's
        GEMM), at the direction's first step only where state_grad (it feeds dh_0 alone).
        Returns whether b.dh_carry holds a part of dh_0. (jobs: FusedDriver's.)"""
        if jobs is not None:
            raise ValueError("StepDriver.direction_backward: no products to defer, got jobs")
        op = self.op
        xp, cfg, T, N, lay = op.xp, op.config, op.T, op.N, op.layout
        D, GH, R = cfg.directions, cfg.gate_rows, cfg.recurrent_size
        cell, empty, proj = cfg.cell, op.scratch.empty, bool(cfg.projection_size)
        lstm, split = cell.has_cell_state, cell.split_gate_grads
        hs, cs, saved = reserve.hs[layer], reserve.cs[layer], reserve.saved[layer]
        dgx3 = b.dgx.reshape(T, N, D * GH)
        dgh3 = (b.dgh if split else b.dgx).reshape(T, N, D * GH)
        w_h = lay.view(params, layer, d, "W_h")
        w_r = lay.view(params, layer, d, "W_r") if proj else None
        h_carry = b.dh_carry if use_h_carry else empty
        c_carry = b.dc_carry if lstm else empty
        prev, nxt, cols, inactive = PREV[d], NEXT[d], slice(d * GH, (d + 1) * GH), masks[1]
        steps = op.steps(d)
        for t in reversed(steps):
            product = state_grad or t != steps[0]
            c_prev = cs[d, t + prev] if lstm else empty
            c_t = cs[d, t + nxt] if lstm else empty
            if proj:
                xp.add(dy[t, :, d * R:(d + 1) * R], b.dh_rec, out=b.dr[t])
                xp.matmul(b.dr[t], w_r, out=b.dhraw)
                self.backward_step(b.dhraw, empty, empty, c_carry, saved[d, t], empty, c_prev,
                                   c_t, dgx3[t, :, cols], empty, empty, c_carry,
                                   *self._tail(opts, t))
                if product:
                    xp.matmul(dgx3[t, :, cols], w_h, out=b.dh_rec)
                if product and inactive is not None:
                    xp.copyto(b.dh_rec, b.dr[t], where=inactive[t])
            else:
                self.backward_step(dy[t, :, d * R:(d + 1) * R], b.dh_rec, h_carry, c_carry,
                                   saved[d, t], hs[d, t + prev], c_prev, c_t, dgx3[t, :, cols],
                                   dgh3[t, :, cols] if split else empty,
                                   h_carry, c_carry, *self._tail(opts, t))
                if product:
                    xp.matmul(dgh3[t, :, cols], w_h, out=b.dh_rec)
        return use_h_carry


class FusedDriver:
    """Each layer direction in one call of the backend's FusedLayer; at T=1 its
    single-step form where it has one (cpu/fused.py: why)."""

    takes_jobs = True   # direction_backward appends its products to `jobs`

    def __init__(self, op, layer):
        self.op, self.layer = op, layer
        self.single = op.T == 1 and layer.fuses_single_step
        self._no_record = op.xp.empty((0, 0, 0, 0), dtype=op.dtype)   # inference: no record
        self._names = self._backward_names = ()
        self._scratch = self._all_scratch = None   # namespaces of the layer's own arrays
        self._launchers = {}   # (layer, input dtype) -> the layer's single_launcher

    def forward_scratch(self):
        shapes = self.layer.forward_scratch(self.op.config, self.op.T, self.op.N)
        self._names = tuple(shapes)
        return shapes

    def backward_scratch(self):
        shapes = self.layer.backward_scratch(self.op.config, self.op.N)
        self._backward_names = tuple(shapes)
        return shapes

    def _forward_views(self):
        if self._scratch is None:
            self._scratch = SimpleNamespace(
                **{name: getattr(self.op.scratch, name) for name in self._names})
        return self._scratch

    def _backward_views(self, b):
        if self._all_scratch is None:
            self._all_scratch = SimpleNamespace(
                **vars(self._forward_views()),
                **{name: getattr(b, name) for name in self._backward_names})
        return self._all_scratch

    def _tail(self, opts):
        lengths = self.op.no_lengths if opts.lengths is None else opts.lengths
        return lengths, opts.clip_lo, opts.clip_hi, opts.clip_flags

    def layer_forward(self, layer, x, params, h0, c0, y, opts, masks, hs, cs, hraw, saved,
                      biases=None):
        """biases: None, or {(layer, d, kind): float32 b_x / b_h} where params is the
        data's half-precision vector, its weights read in place (FusedLayer.reads_weights)."""
        op, fused = self.op, self.layer
        T, N, lay, D = op.T, op.N, op.layout, op._dims[1]
        record = saved if saved is not None else self._no_record
        scratch = self._forward_views()
        if self.single:   # (first: the smallest calls' path)
            x2d = x.reshape(N, -1)
            launch = self._launchers.get((layer, x2d.dtype))
            if launch is None:
                launch = self._launchers[layer, x2d.dtype] = fused.single_launcher(
                    scratch, N, x2d.shape[1], op._dims[2], x2d.dtype)
            for d in range(D):
                op.initial_state(layer, d, h0, c0, hs, cs)
                w_x, w_h, b_x, b_h = lay.cell_views(params, layer, d)
                if biases is not None:
                    b_x, b_h = biases[layer, d, "b_x"], biases[layer, d, "b_h"]
                launch(x2d, d, w_x, w_h, b_x, b_h, hs, cs, y, record, *self._tail(opts))
            return
        fuses = op.plan.fuses_input
        x_pairs, xproj = None, None
        if fuses:   # the loop multiplies W_x x_t itself
            x_pairs = fused.input_pairs(x.reshape(T * N, -1), scratch)
        elif fused.projects_input:   # its own GEMM (cpu/lowlevel: why)
            w_xs = [lay.view(params, layer, d, "W_x") for d in range(D)]
            fused.project(x.reshape(T * N, -1), w_xs, op.scratch.xproj, scratch)
        else:
            op.project_input(layer, x, params)
        if not fuses:
            xproj = op.scratch.xproj.reshape(T, N, D * op.config.gate_rows)
        for d in range(D):
            op.initial_state(layer, d, h0, c0, hs, cs)
            w_h = lay.view(params, layer, d, "W_h")
            b_x, b_h = ((lay.view(params, layer, d, k) if biases is None else biases[layer, d, k])
                        for k in ("b_x", "b_h"))
            if fuses:
                fused.forward(None, d, w_h, b_x, b_h, hs, cs, y, record, scratch,
                              *self._tail(opts), x_pairs=x_pairs,
                              w_x=lay.view(params, layer, d, "W_x"))
            else:
                fused.forward(xproj, d, w_h, b_x, b_h, hs, cs, y, record, scratch,
                              *self._tail(opts))

    def direction_backward(self, layer, d, reserve, params, dy, opts, masks, b, use_h_carry,
                           jobs=None, state_grad=True):
        """The layer's backward loop, then, where state_grad (dh_0 is wanted), the last
        dh_rec = dg @ W_h of the direction's first step (with `jobs`: appended there, into
        b.dh_first[d]). The loop always leaves a direct carry in b.dh_carry."""
        op = self.op
        xp, cfg, T, N = op.xp, op.config, op.T, op.N
        D, GH, split = cfg.directions, cfg.gate_rows, cfg.cell.split_gate_grads
        w_h = op.layout.view(params, layer, d, "W_h")
        dgx3 = b.dgx.reshape(T, N, D * GH)
        dgh3 = b.dgh.reshape(T, N, D * GH if split else 0)
        if not use_h_carry:
            b.dh_carry[...] = 0
        self.layer.backward(xp.ascontiguousarray(dy), d, w_h, reserve.hs[layer],
                            reserve.cs[layer], reserve.saved[layer], dgx3, dgh3, b.dh_rec,
                            b.dh_carry, b.dc_carry, self._backward_views(b),
                            *self._tail(opts))
        if not state_grad:
            return True
        first = 0 if d == 0 else T - 1
        # (the backend's GEMM, as the op's others: at T=1 a whole step's product; with
        # `jobs`, in one region with the layer's other products)
        dg_first = (dgh3 if split else dgx3)[first, :, d * GH:(d + 1) * GH]
        if jobs is not None:
            jobs.append((dg_first, w_h, b.dh_first[d], False))
        else:
            op.backend.matmul(dg_first, w_h, b.dh_rec)
        return True
