"""The whole time loop of one layer and direction in one compiled function (CPU).

One parallel region per call, its workers sharing each step's blocks of 16 hidden units
(lowlevel/workshare.py). A block multiplies h_{t-1} by its packed W_h panels, all gates
(lowlevel/microkernel.py), into a tile that stays in cache, and runs the cell (units.py)
on it. For every cell without a projection; at T=1, FusedLayer.forward_single.

layer_forward(xproj, d, wpack, (bx, bh), (hs, cs), y, saved, tiles, lengths, clip,
              single, half, (counters, workers, me))
    xproj   (T, N, D*G*H)   in   W_x x_t of both directions, no bias (empty with x16)
    d       int                  direction: 0 runs t = 0..T-1, 1 runs t = T-1..0
    wpack   (B, G, H, 16)   in   W_h of this layer and direction, pack_recurrent's layout
    bx, bh  (G*H,)          in   biases
    hs      (D, T+1, N, H)  in/out  state sequence (recurrence.py's row convention): the
                                 initial row set; direction d's other rows written
    cs      (D, T+1, N, H)  in/out  the same for the LSTM cell state; (D, T+1, N, 0) else
    y       (T, N, D*H)     out  layer output, this direction's columns d*H..(d+1)*H
    saved   (D, T, N, S*H)  out  training record (cells.py's layout); (0, 0, 0, 0) for none
    tiles   (B, N, 256)     scratch, one tile per block (layout: TILE_GROUPS below)
    lengths (N,) int64      in   per-sample lengths, (0,) for all T; past it: carry, y = 0
    clip    (lo, hi, flags)      LSTM cell-state clipping, in the data's dtype (cells.py)
    single  (x, w_x, w_h, x_cols, h_cols, w_rows)   the T=1 form's (forward_single); each
                                 empty (FusedLayer._no_single) for T > 1; where x_cols
                                 and h_cols are empty at T=1, the products by rows
                                 (row_dots), x read as the layer's dtype
    half    (h16, wpairs, x16, wxpairs, bias_rows)   the bf16 layer's; each empty
                                 (FusedLayer._no_half) else:
      h16, wpairs                h_t rounded and W_h's pairs
      x16   (T*N, kx) uint32 in  the input as bfloat16 pairs (kx = ceil(K/2)) where the
                                 loop multiplies W_x x_t itself (fuses_input); (0, 0) else
      wxpairs (B, G, kx, 16) uint32  in  this direction's W_x, pack_recurrent_pairs's layout
      bias_rows (2, B, G, 16)  in  bx, bh by block (bias_rows_of): the products start
                                 from them (bx with x16 only, else added as a row)
    counters (T + 2 + sets, stride) int64  workshare.new_counters's (T=1: a row more, first,
                                 for the columns' packing)
    workers  int                 parallel workers, 1..B (FusedLayer: Numba's thread count)
    me       int                 the share a serial build runs (0 but on a team's helpers)
    All C-contiguous, of one dtype (but lengths, counters, bf16 bits); no two overlap.
"""
from __future__ import annotations

import copy
import os
import threading

import llvmlite.binding as llvm
import numba as nb
import numpy as np
from numba import prange

from ..config import CELLS, dtype_name
from .lowlevel import (
    CHUNK,
    HAS_BF16,
    PANEL,
    VECTOR_BITS,
    claim,
    finish,
    hold_launcher,
    new_counters,
    pack_input_pairs,
    pack_input_weights,
    pack_k_pairs,
    pack_panel,
    pack_recurrent,
    pack_recurrent_pairs,
    pack_recurrent_rows,
    panel_gemm,
    panel_gemm_bf16,
    panel_gemm_bf16_bias,
    panel_gemm_t,
    panels,
    project,
    project_bf16,
    project_widened,
    round_rows,
    row_add,
    row_add3,
    row_copy,
    row_dots,
    row_round,
    row_zero,
    settle,
    spread,
    team_arrive,
    team_leave,
    zero_like,
)
from .team import TEAM
from .threads import KERNEL_OPTIONS, LAUNCH_LOCK, SLEEPING_WORKERS, serial_only
from .units import MODE_INDEX, backward_unit, forward_unit

__all__ = ["FusedLayer", "fused_layer", "l2_bytes", "loop_bytes_bound", "loop_work_bound"]


# One tile row per sample, in 16-wide column groups: the cell math reads and writes one
# array at fixed offsets, which LLVM vectorises without run-time alias checks.
_R, _X = 0, 4            # groups 0..3: W_h h_{t-1} + b_h per gate;  4..7: W_x x_t + b_x
_HP, _CP = 8, 9          # previous h, previous c
_H, _C, _S = 10, 11, 12  # new h, new c, training record s0..s3 (groups 12..15)
TILE_GROUPS = 16

# The cell loops vectorise only with a run-time trip count (`lanes`: a constant 16 is
# unrolled first), unsigned columns (_columns: signed indices get wraparound selects) and
# no branches in the math (lowlevel/mathfn.py's select).
# Measured: bench/results/cpu-kernel-notes.md#fused-vectorising-the-cell-loops


@nb.njit(inline="always", cache=True)
def _weight_rows(w, first, count, wb):
    """Address of a weight's rows first..first+count-1 for the T=1 product: in place, or
    bfloat16 bits widened into the worker's rows wb (overwritten by the next weight's)."""
    K = w.shape[1]
    if w.itemsize == 2:
        for r in range(count):
            for k in range(K):
                wb[r * K + k] = np.uint32(w[first + r, k]) << np.uint32(16)
        return wb.ctypes.data
    return w.ctypes.data + np.uint64(first * K * w.itemsize)   # (uint64 either way)


@nb.njit(inline="always", cache=True)
def _single_product(by_rows, w_rows, rows, samples, n, cols, c, ldc, like):
    """The T=1 product of `rows` weight rows at w_rows (K = cols.shape[1] apart) with the n
    samples, stored transposed at c: by rows (row_dots; the samples' rows at `samples`, K
    apart) or against their 16-sample columns `cols`. Each weight's rows are widened once
    for either form, which keeps the kernel's compile short.
    Measured: bench/results/cpu-kernel-notes.md#fusedlayer-the-single-step-by-rows"""
    K = cols.shape[1]
    if by_rows:
        row_dots(w_rows, K, rows, samples, K, n, c, ldc, K, like)
    else:
        panel_gemm_t(w_rows, K, rows, cols.ctypes.data, K * PANEL, cols.shape[0], c, ldc, K,
                     like)


@nb.njit(inline="always", cache=True)
def _hand_over(tiles, first, N, group, like):
    """After a pair's product (note above PAIR_ROWS): the second block's sums, left in
    group `group` + 1 of the first's tile, moved to its own."""
    row, itemsize = tiles.shape[2], tiles.itemsize
    for n in range(N):
        row_copy(tiles[first + 1].ctypes.data + (n * row + group * PANEL) * itemsize,
                 tiles[first].ctypes.data + (n * row + (group + 1) * PANEL) * itemsize, PANEL,
                 like)


def _spec(mode):
    """The CellSpec of a kernel's mode index (units.MODE_INDEX)."""
    return CELLS[tuple(MODE_INDEX)[mode]]


def _columns(*groups):
    """The first tile column of each group, as unsigned constants (note above)."""
    return tuple(np.uint64(group * PANEL) for group in groups)


def _make_layer_forward(mode, gates, saved_width, dtype, single_step, parallel=True,
                        bf16=False):
    """layer_forward (module docstring), or with single_step its T=1 form; without
    `parallel` serial code; with `bf16` (T > 1) vdpbf16ps products (h16, and x16 if given)."""
    itemsize = np.dtype(dtype).itemsize
    last = gates - 1
    row = TILE_GROUPS * PANEL
    # The cell's columns, unsigned (note above _columns); gates past its count repeat its last
    x_cols_in = _columns(*(_X + min(g, last) for g in range(4)))
    r_cols_in = _columns(*(_R + min(g, last) for g in range(4)))
    h_prev_in, c_prev_in, h_out, c_out = _columns(_HP, _CP, _H, _C)
    s_out = _columns(*(_S + k for k in range(4)))
    reads_h = _spec(mode).reads_h_prev   # else h_{t-1} stays out of the tile
    # One-gate blocks in pairs (note above PAIR_ROWS), the second's sums passing through
    # the first's unused group _R + 1 (_X + 1: the bf16 layer's W_x x_t)
    per = 2 if gates == 1 and not single_step else 1
    # The bf16 products start from the biases (bias_rows): no pass adds them to the tile.
    # Measured: bench/results/cpu-kernel-notes.md#bf16-products-that-start-from-the-biases

    def layer_forward(xproj, d, wpack, biases, states, y, saved, tiles, lengths, clip,
                      single, half, share):
        bx, bh = biases
        hs, cs = states
        clip_lo, clip_hi, clip_flags = clip
        x, w_x, w_h, x_cols, h_cols, w_rows = single
        h16, wpairs, x16, wxpairs, bias_rows = half
        counters, workers, me = share
        T, N, H = hs.shape[1] - 1, hs.shape[2], hs.shape[3]
        x_col, y_col = d * gates * H, d * H
        has_c, record = cs.shape[3] != 0, saved.shape[0] != 0
        all_active = lengths.shape[0] == 0
        h_rows = hs.ctypes.data + d * (T + 1) * N * H * itemsize   # hs[d, 0, 0, 0]
        c_rows = cs.ctypes.data + d * (T + 1) * N * cs.shape[3] * itemsize
        like, zero16 = zero_like(hs), np.uint16(0)
        lanes = np.uint64(tiles.shape[2] // TILE_GROUPS)   # == PANEL (note above _columns)
        kp = wpairs.shape[2]                                # bf16: pairs of h a row
        h16_rows = h16.ctypes.data + d * (T + 1) * N * kp * 4   # h16[d, 0, 0, 0] (bf16)
        fuses_x, kpx = x16.shape[0] != 0, x16.shape[1]   # bf16: W_x x_t multiplied here
        # A plain variable for prange: a conditional inside prange(...) ran serially.
        # Measured: bench/results/cpu-kernel-notes.md#fused-prange-over-a-plain-variable
        blocks = tiles.shape[0] if single_step else (wpairs if bf16 else wpack).shape[0]
        pair = 2 if per == 2 and N >= PAIR_ROWS else 1
        claims = -(-blocks // pair)
        # T=1 without columns (forward_single's choice): dots of each weight row with the
        # samples' rows as they are; else x and h_0 as columns, 16 samples per panel
        by_rows = single_step and x_cols.shape[0] == 0
        # T=1: the columns packed by panel, claimed in counters row 0 (the step's is 1)
        rows0 = 1 if single_step else 0
        if me == 0:
            team_arrive(counters, workers)
        launcher = hold_launcher(counters, workers, me)   # (workshare.py: where it works too)
        # A serial build runs one share, `me` (a team's; workshare.py), of `workers`
        span = workers if parallel else 1
        for i in prange(span):   # each walks every step (workshare.py)
            worker = i if parallel else me
            held = spread(counters, worker, workers)   # off a CPU another worker holds
            wb = w_rows[worker % w_rows.shape[0]]   # its widened bf16 weight rows, or empty
            if single_step:
                done = 0
                while True:
                    p = claim(counters, 0, worker, workers, x_cols.shape[0])
                    if p < 0:
                        break
                    done += 1
                    pack_panel(x, p * PANEL, min(PANEL, N - p * PANEL), x_cols[p])
                    pack_panel(hs[d, 0 if d == 0 else 1], p * PANEL, min(PANEL, N - p * PANEL),
                               h_cols[p])
                finish(counters, 0, done, x_cols.shape[0])
            for step in range(T):
                t = step if d == 0 else T - 1 - step
                prev = t if d == 0 else t + 1
                nxt = t + 1 if d == 0 else t
                h_prev_addr = h_rows + prev * N * H * itemsize
                done = 0
                while True:
                    q = claim(counters, rows0 + step, worker, workers, claims)
                    if q < 0:
                        break
                    done += 1
                    first = q * pair
                    if bf16:   # vdpbf16ps's products (FusedLayer.bf16), each starting
                        # from its bias: W_x x_t + b_x into X where fuses_x, W_h h_{t-1} into R
                        for part in range(0 if fuses_x else 1, 2):
                            if part == 0:
                                a, lda, w = x16.ctypes.data + t * N * kpx * 4, kpx, wxpairs
                                group = _X
                            else:
                                a = h16_rows + prev * N * kp * 4
                                lda, w, group = kp, wpairs, _R
                            c = tiles[first].ctypes.data + group * PANEL * itemsize
                            bias = bias_rows[part, first].ctypes.data   # (PANEL apart)
                            if pair == 2 and first + 1 < blocks:
                                panel_gemm_bf16_bias(a, lda, N, w[first, 0].ctypes.data,
                                                     lda * PANEL, 2, c, row, lda, bias, PANEL)
                                _hand_over(tiles, first, N, group, like)
                            else:
                                panel_gemm_bf16_bias(a, lda, N, w[first, 0].ctypes.data,
                                                     lda * PANEL, gates, c, row, lda, bias,
                                                     PANEL)
                    elif not single_step:
                        if pair == 2 and first + 1 < blocks:
                            # a pair of one-gate blocks (note above PAIR_ROWS)
                            panel_gemm(h_prev_addr, H, N, wpack[first, 0].ctypes.data,
                                       H * PANEL, 2,
                                       tiles[first].ctypes.data + _R * PANEL * itemsize, row,
                                       H, like)
                            _hand_over(tiles, first, N, _R, like)
                        else:
                            panel_gemm(h_prev_addr, H, N, wpack[first, 0].ctypes.data,
                                       H * PANEL, gates,
                                       tiles[first].ctypes.data + _R * PANEL * itemsize, row,
                                       H, like)
                    for b in range(first, min(blocks, first + pair)):
                        tile = tiles[b]
                        j0 = b * PANEL
                        width = min(PANEL, H - j0)
                        if single_step:
                            for g in range(gates):
                                # this block's W rows in place @ the samples, transposed
                                c = tile.ctypes.data
                                unit = g * H + j0
                                _single_product(by_rows, _weight_rows(w_x, unit, width, wb),
                                                width, x.ctypes.data, N, x_cols,
                                                c + (_X + g) * PANEL * itemsize, row, like)
                                _single_product(by_rows, _weight_rows(w_h, unit, width, wb),
                                                width, h_prev_addr, N, h_cols,
                                                c + (_R + g) * PANEL * itemsize, row, like)
                                for n in range(N):   # units past H (partial block): zeros
                                    for u in range(width, PANEL):
                                        tile[n, (_R + g) * PANEL + u] = 0
                                        tile[n, (_X + g) * PANEL + u] = 0
                        for n in range(N):
                            # Addresses of this sample's rows (all arrays C-contiguous).
                            trow = tile.ctypes.data + n * row * itemsize
                            h_prev = h_rows + ((prev * N + n) * H + j0) * itemsize
                            h_next = h_rows + ((nxt * N + n) * H + j0) * itemsize
                            h16_prev = h16_rows + ((prev * N + n) * kp * 2 + j0) * 2
                            h16_next = h16_rows + ((nxt * N + n) * kp * 2 + j0) * 2
                            c_prev = c_rows + ((prev * N + n) * H + j0) * itemsize
                            c_next = c_rows + ((nxt * N + n) * H + j0) * itemsize
                            sample = t * N + n
                            y_row = y.ctypes.data + (sample * y.shape[2] + y_col + j0) * itemsize
                            if not (all_active or t < lengths[n]):   # past its end: carry, y=0
                                row_copy(h_next, h_prev, width, like)
                                if bf16:
                                    row_copy(h16_next, h16_prev, width, zero16)
                                if has_c:
                                    row_copy(c_next, c_prev, width, like)
                                row_zero(y_row, width, like)
                                continue
                            for g in range(gates):      # gather this block's inputs
                                r_g = trow + (_R + g) * PANEL * itemsize
                                x_g = trow + (_X + g) * PANEL * itemsize
                                unit = g * H + j0
                                if not bf16:   # (bf16: the products added the biases)
                                    row_add(r_g, r_g, bh.ctypes.data + unit * itemsize, width,
                                            like)
                                if not (bf16 and fuses_x):
                                    x_in = x_g if single_step else xproj.ctypes.data + (
                                        sample * xproj.shape[2] + x_col + unit) * itemsize
                                    row_add(x_g, x_in, bx.ctypes.data + unit * itemsize, width,
                                            like)
                            if reads_h:
                                row_copy(trow + _HP * PANEL * itemsize, h_prev, width, like)
                            if has_c:
                                row_copy(trow + _CP * PANEL * itemsize, c_prev, width, like)
                            for u in range(lanes):      # the cell, on the tile alone
                                h, c, s0, s1, s2, s3 = forward_unit(
                                    mode, tile[n, x_cols_in[0] + u], tile[n, x_cols_in[1] + u],
                                    tile[n, x_cols_in[2] + u], tile[n, x_cols_in[3] + u],
                                    tile[n, r_cols_in[0] + u], tile[n, r_cols_in[1] + u],
                                    tile[n, r_cols_in[2] + u], tile[n, r_cols_in[3] + u],
                                    tile[n, h_prev_in + u], tile[n, c_prev_in + u],
                                    clip_lo, clip_hi, clip_flags)
                                tile[n, h_out + u] = h
                                tile[n, c_out + u] = c
                                tile[n, s_out[0] + u] = s0
                                tile[n, s_out[1] + u] = s1
                                tile[n, s_out[2] + u] = s2
                                tile[n, s_out[3] + u] = s3
                            h_new = trow + _H * PANEL * itemsize      # scatter
                            row_copy(h_next, h_new, width, like)
                            if bf16:   # h_t rounded, for the next step's product
                                row_round(h16_next, h_new, width)
                            row_copy(y_row, h_new, width, like)
                            if has_c:
                                row_copy(c_next, trow + _C * PANEL * itemsize, width, like)
                            if record:
                                rec = saved.ctypes.data + (
                                    (d * T * N + sample) * saved.shape[3] + j0) * itemsize
                                for k in range(saved_width):
                                    row_copy(rec + k * H * itemsize,
                                             trow + (_S + k) * PANEL * itemsize, width, like)
                finish(counters, rows0 + step, done, claims)
            settle(counters, worker, workers, held)
        settle(counters, 0, workers, launcher)
        if me == 0:
            team_leave(counters, workers)

    return nb.njit(parallel=parallel, **KERNEL_OPTIONS)(layer_forward)


# Rows move as rows (rows.py), even where a loop would be short: plain loops over u, once
# re-optimised where Numba links the kernel (the cached copy), made the whole body spill.
# Measured: bench/results/cpu-kernel-notes.md#fused-code-optimised-twice
def _make_layer_backward(mode, gates, saved_width, dtype, parallel=True, bf16=False):
    """The backward twin of layer_forward (arguments: FusedLayer.backward's, grouped as
    (hs, cs), (dgx, dgh), (dh_rec0, dh_carry, dc_carry), clip, (dg16, wpairs_rows) and
    (counters, workers)). With `bf16`
    dh_rec = dg_later @ W_h is vdpbf16ps's: each step writes its dg rounded into dg16 (two
    rows, by step parity), the next multiplies them by wpairs_rows."""
    itemsize = np.dtype(dtype).itemsize
    row = TILE_GROUPS * PANEL
    # Backward tile groups: 0 dh_rec; 1 dh; 2 dc in; 3..6 record; 7 h_prev; 8 c_prev; 9 c_t;
    # 10..13 dx per gate; 14 dh carry out; 15 dc carry out; dr per gate reuses 3..6. A pair's
    # product leaves the second block's dh_rec in group 1 until _hand_over moves it.
    _DHR, _DH, _DC, _SV, _HPB, _CPB, _CT, _DX, _DHC, _DCC = 0, 1, 2, 3, 7, 8, 9, 10, 14, 15
    # the cell's columns, unsigned (note above _columns)
    dh_in, dc_in, h_prev_in, c_prev_in, c_t_in, dh_out, dc_out = _columns(
        _DH, _DC, _HPB, _CPB, _CT, _DHC, _DCC)
    rec_in = _columns(*(_SV + k for k in range(4)))     # becomes dr per gate
    dx_out = _columns(*(_DX + g for g in range(4)))
    reads_h = _spec(mode).reads_h_prev   # else h_{t-1} stays out of the tile

    def layer_backward(dy, d, wpack_rows, states, saved, grads, carries, tiles, lengths, clip,
                       half, share):
        hs, cs = states
        dgx, dgh = grads
        dh_rec0, dh_carry, dc_carry = carries
        clip_lo, clip_hi, clip_flags = clip
        dg16, wpairs_rows = half
        counters, workers, me = share
        T, N, H = dy.shape[0], dy.shape[1], hs.shape[3]
        GH = gates * H
        col, y_col = d * GH, d * H
        has_c, split = cs.shape[3] != 0, dgh.shape[2] != 0
        all_active = lengths.shape[0] == 0
        lda = dgh.shape[2] if split else dgx.shape[2]
        h_rows = hs.ctypes.data + d * (T + 1) * N * H * itemsize   # hs[d, 0, 0, 0]
        c_rows = cs.ctypes.data + d * (T + 1) * N * cs.shape[3] * itemsize
        like, zero16 = zero_like(dgx), np.uint16(0)
        lanes = np.uint64(tiles.shape[2] // TILE_GROUPS)   # == PANEL (note above _columns)
        dg_rows = (dgh.ctypes.data if split else dgx.ctypes.data) + col * itemsize
        blocks = (wpairs_rows if bf16 else wpack_rows).shape[0]
        kp = dg16.shape[2] // 2                             # bf16: pairs of dg per row
        # pairs where they leave every worker a claim (many cores, few blocks: singles)
        pair = 2 if N >= PAIR_ROWS and blocks >= 2 * workers else 1
        claims = -(-blocks // pair)
        if me == 0:
            team_arrive(counters, workers)
        launcher = hold_launcher(counters, workers, me)   # (workshare.py: where it works too)
        span = workers if parallel else 1   # (one share in a serial build: layer_forward)
        for i in prange(span):   # each walks every step (workshare.py)
            worker = i if parallel else me
            held = spread(counters, worker, workers)   # off a CPU another worker holds
            for step in range(T):
                t = T - 1 - step if d == 0 else step           # forward order reversed
                later = t + 1 if d == 0 else t - 1             # the step processed just before
                prev = t if d == 0 else t + 1
                nxt = t + 1 if d == 0 else t
                done = 0
                while True:
                    q = claim(counters, step, worker, workers, claims)
                    if q < 0:
                        break
                    done += 1
                    first = q * pair
                    two = first + 1 < min(blocks, first + pair)
                    dh_rec = tiles[first].ctypes.data + _DHR * PANEL * itemsize
                    # dh_rec = dg_later @ W_h for this claim's blocks (note above PAIR_ROWS)
                    if step > 0 and bf16:   # the same product from bfloat16 pairs
                        dg_pairs = dg16.ctypes.data + ((step - 1) % 2) * N * kp * 4
                        if two:
                            panel_gemm_bf16(dg_pairs, kp, N, wpairs_rows[first].ctypes.data,
                                            kp * PANEL, 2, dh_rec, row, kp)
                            _hand_over(tiles, first, N, _DHR, like)
                        else:
                            panel_gemm_bf16(dg_pairs, kp, N, wpairs_rows[first].ctypes.data,
                                            0, 1, dh_rec, row, kp)
                    elif step > 0:
                        dg_later = dg_rows + later * N * lda * itemsize
                        if two:
                            panel_gemm(dg_later, lda, N, wpack_rows[first].ctypes.data,
                                       GH * PANEL, 2, dh_rec, row, GH, like)
                            _hand_over(tiles, first, N, _DHR, like)
                        else:
                            panel_gemm(dg_later, lda, N, wpack_rows[first].ctypes.data, 0, 1,
                                       dh_rec, row, GH, like)
                    for b in range(first, min(blocks, first + pair)):
                        tile = tiles[b]
                        j0 = b * PANEL
                        width = min(PANEL, H - j0)
                        if step == 0:
                            for n in range(N):
                                row_copy(tile.ctypes.data + (n * row + _DHR * PANEL) * itemsize,
                                         dh_rec0.ctypes.data + (n * H + j0) * itemsize, width,
                                         like)
                        for n in range(N):
                            # Addresses of this sample's rows (all arrays C-contiguous).
                            trow = tile.ctypes.data + n * row * itemsize
                            dh_rec_n = trow + _DHR * PANEL * itemsize
                            sample = t * N + n
                            dh_carry_n = dh_carry.ctypes.data + (n * H + j0) * itemsize
                            dc_carry_n = dc_carry.ctypes.data + (
                                n * dc_carry.shape[1] + j0) * itemsize
                            dgx_n = dgx.ctypes.data + (sample * dgx.shape[2] + col + j0) * itemsize
                            dgh_n = dgh.ctypes.data + (sample * dgh.shape[2] + col + j0) * itemsize
                            dg16_n = dg16.ctypes.data + ((step % 2) * N + n) * dg16.shape[2] * 2
                            if not (all_active or t < lengths[n]):
                                # Past this sample's length: no gate gradient, dh and dc pass on.
                                # (Row moves, not loops: note above _make_layer_backward.)
                                for g in range(gates):
                                    row_zero(dgx_n + g * H * itemsize, width, like)
                                    if split:
                                        row_zero(dgh_n + g * H * itemsize, width, like)
                                    if bf16:
                                        row_zero(dg16_n + (g * H + j0) * 2, width, zero16)
                                row_add(dh_carry_n, dh_carry_n, dh_rec_n, width, like)
                                continue
                            dy_n = dy.ctypes.data + (sample * dy.shape[2] + y_col + j0) * itemsize
                            row_add3(trow + _DH * PANEL * itemsize, dh_rec_n, dy_n, dh_carry_n,
                                     width, like)
                            rec = saved.ctypes.data + (
                                (d * T * N + sample) * saved.shape[3] + j0) * itemsize
                            for k in range(saved_width):
                                row_copy(trow + (_SV + k) * PANEL * itemsize,
                                         rec + k * H * itemsize, width, like)
                            if reads_h:
                                row_copy(trow + _HPB * PANEL * itemsize,
                                         h_rows + ((prev * N + n) * H + j0) * itemsize, width,
                                         like)
                            if has_c:
                                row_copy(trow + _DC * PANEL * itemsize, dc_carry_n, width, like)
                                row_copy(trow + _CPB * PANEL * itemsize,
                                         c_rows + ((prev * N + n) * H + j0) * itemsize, width, like)
                                row_copy(trow + _CT * PANEL * itemsize,
                                         c_rows + ((nxt * N + n) * H + j0) * itemsize, width, like)
                            for u in range(lanes):      # the cell, on the tile alone
                                dx0, dx1, dx2, dx3, dr0, dr1, dr2, dr3, dhc, dcc = backward_unit(
                                    mode, tile[n, dh_in + u], tile[n, dc_in + u],
                                    tile[n, rec_in[0] + u], tile[n, rec_in[1] + u],
                                    tile[n, rec_in[2] + u], tile[n, rec_in[3] + u],
                                    tile[n, h_prev_in + u], tile[n, c_prev_in + u],
                                    tile[n, c_t_in + u], clip_lo, clip_hi, clip_flags)
                                tile[n, dx_out[0] + u] = dx0
                                tile[n, dx_out[1] + u] = dx1
                                tile[n, dx_out[2] + u] = dx2
                                tile[n, dx_out[3] + u] = dx3
                                tile[n, rec_in[0] + u] = dr0
                                tile[n, rec_in[1] + u] = dr1
                                tile[n, rec_in[2] + u] = dr2
                                tile[n, rec_in[3] + u] = dr3
                                tile[n, dh_out + u] = dhc
                                tile[n, dc_out + u] = dcc
                            for g in range(gates):          # scatter
                                row_copy(dgx_n + g * H * itemsize,
                                         trow + (_DX + g) * PANEL * itemsize, width, like)
                                if split:
                                    row_copy(dgh_n + g * H * itemsize,
                                             trow + (_SV + g) * PANEL * itemsize, width, like)
                            if bf16:   # the next step's product reads these, rounded
                                for g in range(gates):
                                    src = (_SV if split else _DX) + g
                                    row_round(dg16_n + (g * H + j0) * 2,
                                              trow + src * PANEL * itemsize, width)
                            row_copy(dh_carry_n, trow + _DHC * PANEL * itemsize, width, like)
                            if has_c:
                                row_copy(dc_carry_n, trow + _DCC * PANEL * itemsize, width, like)
                finish(counters, step, done, claims)
            settle(counters, worker, workers, held)
        settle(counters, 0, workers, launcher)
        if me == 0:
            team_leave(counters, workers)

    return nb.njit(parallel=parallel, **KERNEL_OPTIONS)(layer_backward)


def _workers(blocks, serial=False):
    """Workers for one launch (workshare.py): the calling thread's Numba thread count, at
    most one per block; one for a serial build or process."""
    return 1 if serial or serial_only() else max(1, min(nb.get_num_threads(), blocks))


def _launch(builds, serial, steps, blocks, args):
    """builds (parallel, serial) of a kernel, launched on `args` + (counters, workers, me):
    several workers on a team where there is one (team.py), else on Numba's layer."""
    if serial or serial_only():   # (a serial build opens no region: no lock)
        builds[1](*args, (new_counters(steps, 1), 1, 0))
        return
    workers = _workers(blocks)
    if workers > 1 and TEAM is not None:
        TEAM.launch(builds[1], args, steps, workers)
    else:   # (one worker too: the replay compiles every parallel build this way)
        with LAUNCH_LOCK:
            builds[0](*args, (new_counters(steps, workers), workers, 0))


# Small calls run serial builds (no launch): up to SERIAL_WORK multiply-adds at T=1
# (N*G*H*(H+K)), SERIAL_LOOP_WORK in a loop (T*N*G*H*H, + T*N*G*H*K fused; bf16 counts
# half), SERIAL_POINTWISE gate values (N*G*H) in the T=1 backward; higher where a launch
# wakes workqueue's workers (a team's T=1 launch does not; its loops: TEAM_LOOP_WORK).
# No loop whose weights pass this machine's L2 of a core (SERIAL_LOOP_BYTES).
# Measured: bench/results/cpu-kernel-notes.md#fusedlayer-serial-bounds-for-each-layer
# Measured: bench/results/cpu-kernel-notes.md#threads-a-team-of-our-own
# Measured: bench/results/cpu-kernel-notes.md#fused-the-loops-weight-bound-read-from-sysfs
_WAKES = SLEEPING_WORKERS and TEAM is None
SERIAL_WORK = 1 << 25 if _WAKES else 1 << 20 if TEAM is not None else 1 << 19
# A team's loop pays no wake, only each step's synchronisation: its bound by CPU kind
# (LLVM's host name) where measured; other kinds keep workqueue's.
# Measured: bench/results/cpu-kernel-notes.md#fused-the-loop-bound-with-a-team-by-cpu-kind
TEAM_LOOP_WORK = {"znver3": 1 << 22}


def loop_work_bound(kind, team, sleeping):
    """SERIAL_LOOP_WORK on a CPU of LLVM name `kind`, with or without a team, where the
    threading layer's workers sleep or not."""
    if not sleeping:
        return 1 << 20
    return TEAM_LOOP_WORK.get(kind, 1 << 24) if team else 1 << 24


SERIAL_LOOP_WORK = loop_work_bound(llvm.get_host_cpu_name(), TEAM is not None, SLEEPING_WORKERS)


def l2_bytes(base="/sys/devices/system/cpu/cpu0/cache"):
    """One core's L2 in bytes, from Linux's sysfs under `base`; None where it is not there."""
    try:
        indexes = sorted(os.listdir(base))
    except OSError:
        return None
    for index in indexes:
        try:
            with open(f"{base}/{index}/level") as level, open(f"{base}/{index}/size") as size:
                text = size.read().strip()
                if level.read().strip() == "2" and text:
                    bytes_ = int(text.rstrip("KM")) * {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
                    return bytes_ or None
        except (OSError, ValueError):
            continue
    return None


def loop_bytes_bound(l2):
    """SERIAL_LOOP_BYTES for a core's L2 of `l2` bytes (None: unknown, taken as Zen 4's and
    Zen 5's), held within the smallest and largest L2 it was measured at."""
    return min(max(l2 or 1 << 20, 1 << 19), 1 << 20)


SERIAL_LOOP_BYTES = loop_bytes_bound(l2_bytes())
# One-panel blocks go in pairs (one product over two panels) from this many samples (a
# tile of one row has too few sums): the forward's one-gate blocks, and the backward's
# dh_rec products.
# Measured: bench/results/cpu-kernel-notes.md#fused-one-gate-blocks-in-pairs
# Measured: bench/results/cpu-kernel-notes.md#fused-the-backwards-product-in-pairs
PAIR_ROWS = 4
# The bf16 layer multiplies W_x x_t inside its loop (fuses_input) from this many samples:
# each step reads all of W_x's panels for N rows, so few samples lose.
# Measured: bench/results/cpu-kernel-notes.md#bf16-the-input-product-inside-the-loop
FUSED_INPUT_ROWS = 8
# At T=1 up to this many samples take row_dots (a dot per weight row and sample) rather
# than 16-sample panels, whose cost is a whole panel's however few samples fill it.
# Measured: bench/results/cpu-kernel-notes.md#fusedlayer-the-single-step-by-rows
DOT_SAMPLES = 8
# (the T=1 backward's bound: SERIAL_WORK's note)
SERIAL_POINTWISE = 1 << 18 if _WAKES else 1 << 16 if TEAM is not None else 1 << 14


def bias_rows_of(bx, bh, out):
    """bx and bh (G*H,) by block into out (2, B, G, 16), the bf16 loop's bias rows: each
    packed as W_h's one-column twin (pack_recurrent, K = 1), zero past H. Returns out."""
    B, G = out.shape[1], out.shape[2]
    for k, b in enumerate((bx, bh)):
        pack_recurrent(np.ascontiguousarray(b).reshape(-1, 1), G, out[k].reshape(B, G, 1, PANEL))
    return out


class FusedLayer:
    """The compiled fused loop of one (mode, dtype), its parallel builds launched under
    LAUNCH_LOCK (_launch): the recurrence's FusedLayer protocol, with its InputProjection
    and SingleStep forms."""

    fuses_single_step = True

    def __init__(self, mode, dtype, bf16=False):
        spec = CELLS[mode]
        self.gates, self.dtype = spec.gates, np.dtype(dtype)
        # bfloat16 data with AVX512-BF16: for T > 1 products on vdpbf16ps, all else float32
        # Measured: bench/results/cpu-kernel-notes.md#bf16-the-fused-forward-in-bfloat16-issue-25
        self.bf16 = self.reads_storage = bf16
        # ... and its bfloat16 weights as bits, packed as they are, at T=1 widened by block
        # Measured: bench/results/cpu-kernel-notes.md#bf16-weights-read-in-place
        self.reads_weights = bf16
        # float16 (and bfloat16 without AVX512-BF16): fused_layer(..., widens=True) reads
        # layer 0's data in place, widening a chunk of rows at a time
        self.widens = False
        # project() replaces the driver's BLAS input GEMM (lowlevel/gemm.py) where own_gemm
        # Measured: bench/results/cpu-kernel-notes.md#fusedlayer-whether-to-project-the-input
        self.projects_input = own_gemm(self.dtype)
        # fuses_input: each block multiplies W_x x_t too, so no xproj round trip past L3
        # Measured: bench/results/cpu-kernel-notes.md#bf16-the-input-product-inside-the-loop
        self._fuses = bf16
        self._forward, self._forward_serial = (
            _make_layer_forward(MODE_INDEX[mode], spec.gates, spec.saved, self.dtype, False,
                                parallel=parallel, bf16=bf16)
            for parallel in (True, False))   # (serial: small calls, forked processes)
        self._forward_single = _make_layer_forward(MODE_INDEX[mode], spec.gates, spec.saved,
                                                   self.dtype, True)
        self._forward_single_serial = _make_layer_forward(
            MODE_INDEX[mode], spec.gates, spec.saved, self.dtype, True, parallel=False)
        self._no_weights = np.empty((0, 0), self.dtype)
        self._no_panels = np.empty((0, 0, 0), self.dtype)
        self._no_xproj = np.empty((0, 0, 0), self.dtype)
        self._no_wpack = np.empty((0, 0, 0, 0), self.dtype)
        self._no_h16 = np.empty((0, 0, 0, 0), np.uint16)
        self._no_pairs = np.empty((0, 0, 0, 0), np.uint32)
        self._no_x16 = np.empty((0, 0), np.uint32)
        self._no_bias_rows = np.empty((0, 0, 0, 0), self.dtype)
        self._no_rows = np.empty((1, 0), np.uint32)   # (w_rows: one row, as it is indexed)
        # the T=1 form's and the bf16 layer's groups where a launch has none
        self._no_single = (self._no_weights, self._no_weights, self._no_weights,
                           self._no_panels, self._no_panels, self._no_rows)
        self._no_half = (self._no_h16, self._no_pairs, self._no_x16, self._no_pairs,
                         self._no_bias_rows)
        self._backward, self._backward_serial = (
            _make_layer_backward(MODE_INDEX[mode], spec.gates, spec.saved, self.dtype, parallel,
                                 bf16=bf16)
            for parallel in (True, False))
        self._no_dg16 = np.empty((0, 0, 0), np.uint16)
        self._no_pairs3 = np.empty((0, 0, 0), np.uint32)

    def forward_scratch(self, config, steps, batch):
        """Scratch shapes the op carves once: for T > 1 packed W_h, the tiles, and where
        project() serves the packed input weights (flat) and spill tiles; for T = 1
        (forward_single) padded tiles and the input and h_0 as 16-sample columns."""
        H, GH, D = config.state_size, config.gate_rows, config.directions
        max_in = max(config.layer_input_size(layer) for layer in range(config.num_layers))
        single = steps == 1 and self.fuses_single_step   # the driver's rule
        projects = self.projects_input and not single
        columns = -(-batch // PANEL)
        pairs = self.bf16 and not single   # float32-sized, viewed as uint16/uint32 pairs
        kp_h, kp_x = -(-H // 2), -(-max_in // 2)
        return {"wpack": (0 if single or pairs else panels(H), config.cell.gates, H, PANEL),
                "wpairs": (panels(H) if pairs else 0, config.cell.gates, kp_h, PANEL),
                "h16": (D if pairs else 0, steps + 1, batch, kp_h),
                "x16": (steps * batch if pairs else 0, kp_x),
                "bias_rows": (2 if pairs else 0, panels(H), config.cell.gates, PANEL),
                # the projection's W_x of both directions; fusing, one direction's by block
                "wx_pairs": (max(panels(D * GH), panels(H) * config.cell.gates) * kp_x * PANEL
                             if pairs else 0,),
                # padded to whole 16-sample panels: forward_single stores 16 rows at once
                "tiles": (panels(H), columns * PANEL if single else batch,
                          TILE_GROUPS * PANEL),
                # float32 panels of W_x; the bf16 layer projects from wx_pairs alone
                "wx_panels": (panels(D * GH) * max_in * PANEL if projects and not pairs
                              else 0,),
                # project_widened's rows, a block per worker (it takes chunks in turn)
                "x_block": (min(nb.config.NUMBA_NUM_THREADS, -(-steps * batch // CHUNK))
                            if projects and self.widens else 0, CHUNK,
                            config.input_size if projects and self.widens else 0),
                "spill": (-(-steps * batch // CHUNK) if projects else 0, CHUNK, PANEL),
                "x_cols": ((columns * max_in * PANEL) if single else 0,),   # flat: any K
                "h_cols": (columns if single else 0, H, PANEL),
                # forward_single's bfloat16 weights widened, 16 rows per worker (as uint32)
                "w_rows": (nb.config.NUMBA_NUM_THREADS if single and self.reads_weights
                           else 0, PANEL * max(max_in, H))}

    def backward_scratch(self, config, batch):
        """W_h packed by rows (pack_recurrent_rows), or with bf16 as pairs (pack_k_pairs)
        beside two rows of bfloat16 dg; backward also uses forward's tiles."""
        B, GH, kp = panels(config.recurrent_size), config.gate_rows, -(-config.gate_rows // 2)
        return {"wpack_rows": (0 if self.bf16 else B, GH, PANEL),
                "wpairs_rows": (B if self.bf16 else 0, kp, PANEL),
                "dg16": (2 if self.bf16 else 0, batch, kp)}

    def project(self, x2d, w_xs, out, scratch):
        """out (M, D*G*H) = x2d (M, K) @ [W_x of each direction]^T on Numba's threads. With
        bf16, x2d may be bfloat16 (read in place where K is even) or float32 (rounded into
        scratch.x16); the widening form takes float16 or bfloat16 (via scratch.x_block)."""
        K = x2d.shape[1]
        if self.bf16:
            kp = -(-K // 2)
            a = self.input_pairs(x2d, scratch)
            wpairs = scratch.wx_pairs[:panels(out.shape[1]) * kp * PANEL].view(
                np.uint32).reshape(-1, kp, PANEL)
            pack_input_pairs([_bits_or_values(w) for w in w_xs], wpairs)
            project_bf16(a, wpairs, out, scratch.spill)
            return
        wpack = scratch.wx_panels[:panels(out.shape[1]) * K * PANEL].reshape(-1, K, PANEL)
        pack_input_weights(w_xs, wpack)
        half = dtype_name(x2d.dtype)
        if half in ("float16", "bfloat16"):
            project_widened(np.ascontiguousarray(x2d).view(np.uint16), half == "bfloat16",
                            wpack, out, scratch.spill, scratch.x_block)
            return
        project(np.ascontiguousarray(x2d), wpack, out, scratch.spill, TEAM)

    def _serial_loop(self, rows, weights):
        """Whether a T > 1 loop of `rows` by `weights` elements of W runs its serial build
        (note above SERIAL_WORK)."""
        work, size = rows * weights, 2 if self.bf16 else self.dtype.itemsize
        return ((work // 2 if self.bf16 else work) <= SERIAL_LOOP_WORK and
                weights * size <= SERIAL_LOOP_BYTES)

    def fuses_input(self, steps, batch):
        """Whether forward() multiplies W_x x_t itself (note in __init__) at this size."""
        return self._fuses and steps > 1 and batch >= FUSED_INPUT_ROWS

    def input_pairs(self, x2d, scratch):
        """(bf16) x2d (M, K) as bfloat16 pairs (M, ceil(K/2)) uint32: bfloat16 data in place
        where K is even, else rounded into scratch.x16."""
        M, K = x2d.shape
        if dtype_name(x2d.dtype) == "bfloat16" and K % 2 == 0:
            return np.ascontiguousarray(x2d).view(np.uint32)
        kp = -(-K // 2)
        a16 = scratch.x16.reshape(-1)[:M * kp].view(np.uint16).reshape(M, 2 * kp)
        round_rows(x2d.astype(np.float32, copy=False), a16)
        return a16.view(np.uint32)

    def forward(self, xproj, d, w_h, bx, bh, hs, cs, y, saved, scratch, lengths,
                clip_lo, clip_hi, clip_flags, x_pairs=None, w_x=None):
        """layer_forward (module docstring) for direction d, W_h (G*H, H) packed into
        scratch.wpack first. Where the layer fuses_input, xproj is None; x_pairs (T*N,
        ceil(K/2)) uint32 (input_pairs's) and w_x (G*H, K), this direction's, are given."""
        wpack, tiles = (scratch.wpairs if self.bf16 else scratch.wpack), scratch.tiles
        if wpack.shape[0] != tiles.shape[0] or wpack.shape[0] != panels(hs.shape[3]):
            raise ValueError(f"FusedLayer.forward: wpack {wpack.shape} and tiles "
                             f"{tiles.shape} must both have {panels(hs.shape[3])} blocks "
                             f"(T=1 scratch is forward_single's)")
        h16, wpairs, x16, wxpairs = self._no_h16, self._no_pairs, self._no_x16, self._no_pairs
        fuses = x_pairs is not None
        if (fuses and not self._fuses) or (w_x is not None) != fuses or (xproj is None) != fuses:
            raise ValueError("FusedLayer.forward: xproj, or x_pairs and w_x where the layer "
                             "fuses_input, expected")
        if fuses:
            x16, kpx = x_pairs, x_pairs.shape[1]
            if x16.shape[0] != (hs.shape[1] - 1) * hs.shape[2] or kpx != -(-w_x.shape[1] // 2):
                raise ValueError(f"FusedLayer.forward: x_pairs {x16.shape} do not fit "
                                 f"T*N={(hs.shape[1] - 1) * hs.shape[2]} and W_x {w_x.shape}")
            size = wpack.shape[0] * self.gates * kpx * PANEL
            wxpairs = pack_recurrent_pairs(_bits_or_values(w_x), self.gates, scratch.wx_pairs[
                :size].view(np.uint32).reshape(wpack.shape[0], self.gates, kpx, PANEL))
            xproj = self._no_xproj
        if self.bf16:
            wpairs = pack_recurrent_pairs(_bits_or_values(w_h), self.gates,
                                          wpack.view(np.uint32))
            h16 = scratch.h16.view(np.uint16)   # (D, T+1, N, 2*kp)
            first = 0 if d == 0 else hs.shape[1] - 1
            round_rows(hs[d, first], h16[d, first])
            if h16.shape[3] != hs.shape[3]:   # odd H: the pad of every row multiplies 0
                h16[d, :, :, hs.shape[3]:] = 0
            wpack = self._no_wpack
            bias_rows = bias_rows_of(bx, bh, scratch.bias_rows)
        else:
            pack_recurrent(w_h, self.gates, wpack)
            bias_rows = self._no_bias_rows
        T, N, H = hs.shape[1] - 1, hs.shape[2], hs.shape[3]
        width = H + (w_x.shape[1] if fuses else 0)
        serial = self._serial_loop(T * N, self.gates * H * width)
        scalar = self.dtype.type
        _launch((self._forward, self._forward_serial), serial, T, tiles.shape[0], (
            xproj, d, wpack, (bx, bh), (hs, cs), y, saved, tiles, lengths,
            (scalar(clip_lo), scalar(clip_hi), clip_flags), self._no_single,
            (h16, wpairs, x16, wxpairs, bias_rows)))

    def _weight(self, w):
        """A weight for forward_single, contiguous: the layer's dtype, or with reads_weights
        bfloat16 bits."""
        if w.dtype == self.dtype:
            return np.ascontiguousarray(w)
        if not (self.reads_weights and dtype_name(w.dtype) == "bfloat16"):
            raise TypeError(f"FusedLayer.forward_single: weights of {self.dtype} "
                            f"{'or bfloat16 ' if self.reads_weights else ''}expected, got "
                            f"{w.dtype}")
        return np.ascontiguousarray(w.view(np.uint16))

    def forward_single(self, x2d, d, w_x, w_h, bx, bh, hs, cs, y, saved, scratch, lengths,
                       clip_lo, clip_hi, clip_flags):
        """A whole T=1 layer-direction in one region, weights read in place: each block
        multiplies its rows of W_x and W_h by x and h_0 (as 16-sample columns, or up to
        DOT_SAMPLES samples by rows) and runs the cell; forward()'s four launches and two
        weight copies cost more at T=1.
        Measured: bench/results/cpu-kernel-notes.md#fusedlayer-the-single-step-form
            x2d     (N, K)            in   the layer input of the one step
            w_x     (G*H, K), w_h (G*H, H)   in   this direction's weights; with
                                              reads_weights also bfloat16 (the same sums)
            scratch.tiles   (B, ceil(N/16)*16, 256)   forward_scratch's, T=1
            scratch.x_cols  flat, >= ceil(N/16)*K*16;  scratch.h_cols (ceil(N/16), H, 16)
            scratch.w_rows  (threads, 16*max(K, H)): bfloat16 weights' rows, widened
        Everything else as forward() with T=1 (hs, cs: (D, 2, N, H))."""
        self.single_launcher(scratch, x2d.shape[0], x2d.shape[1], w_h.shape[1], x2d.dtype)(
            x2d, d, w_x, w_h, bx, bh, hs, cs, y, saved, lengths, clip_lo, clip_hi, clip_flags)

    def single_launcher(self, scratch, batch, input_size, state_size, x_dtype):
        """forward_single for these sizes, its fixed arguments worked out once (a driver keeps it).
        Measured: bench/results/cpu-kernel-notes.md#a-call-like-the-last-one"""
        N, K, H, tiles, scalar = batch, input_size, state_size, scratch.tiles, self.dtype.type
        # no columns: the kernel takes row_dots (note above DOT_SAMPLES), which reads x as
        # the layer's dtype (the columns' packing converts any other)
        by_rows_if = x_dtype == self.dtype
        cols = {rows: (scratch.x_cols[:len(h_cols) * K * PANEL].reshape(-1, K, PANEL), h_cols)
                for rows, h_cols in ((True, scratch.h_cols[:0]), (False, scratch.h_cols))}
        work, blocks = N * self.gates * H * (H + K), tiles.shape[0]

        def launch(x2d, d, w_x, w_h, bx, bh, hs, cs, y, saved, lengths, clip_lo, clip_hi,
                   clip_flags):
            x_cols, h_cols = cols[by_rows_if and N <= DOT_SAMPLES]   # (bounds: read now)
            serial = work <= SERIAL_WORK
            w_x, w_h = self._weight(w_x), self._weight(w_h)
            w_rows = self._no_rows
            if w_x.dtype == np.uint16:
                w_rows, workers = scratch.w_rows.view(np.uint32), _workers(blocks, serial)
                if w_rows.shape[0] < workers or w_rows.shape[1] < PANEL * max(K, H):
                    raise ValueError(f"FusedLayer.forward_single: w_rows {w_rows.shape} "
                                     f"cannot hold {PANEL} rows of {max(K, H)} for {workers} "
                                     f"workers")
            # (two rows of counters: the packing's and the step's)
            _launch((self._forward_single, self._forward_single_serial), serial, 2, blocks,
                    (self._no_xproj, d, self._no_wpack, (bx, bh), (hs, cs), y, saved, tiles,
                     lengths, (scalar(clip_lo), scalar(clip_hi), clip_flags),
                     (np.ascontiguousarray(x2d), w_x, w_h, x_cols, h_cols, w_rows),
                     self._no_half))
        return launch

    def backward(self, dy, d, w_h, hs, cs, saved, dgx, dgh, dh_rec0, dh_carry, dc_carry,
                 scratch, lengths, clip_lo, clip_hi, clip_flags):
        """One direction's backward recurrence (the layer's weight gradients are GEMMs
        the caller runs over all steps afterwards).
            dy          (T, N, D*H)     in   gradient of the layer output
            w_h         (G*H, H)        in   packed first into scratch.wpack_rows
            hs, cs, saved                in   the training forward's record (layer_forward)
            dgx         (T, N, D*G*H)   out  d(pre-activation), this direction's columns
            dgh         (T, N, D*G*H)   out  the recurrent side where it differs; else (T, N, 0)
            dh_rec0     (N, H)          in   gradient of the final state h (dhy)
            dh_carry    (N, H)          in/out  0 on entry; on exit dh_0's part past W_h
            dc_carry    (N, H)          in/out  dcy on entry, dc_0 on exit; (N, 0) else
            scratch     .tiles (B, N, 256) and .wpack_rows, as carved; with bf16
                        .wpairs_rows (pack_k_pairs's) and .dg16 instead: vdpbf16ps
                        (bench/results/cpu-kernel-notes.md#bf16-the-training-gemms)
        On exit dh_0 = dg_first @ W_h + dh_carry, where dg_first is dgh (or dgx) at the
        direction's first step; the caller runs that last GEMM."""
        T, N, GH = dy.shape[0], dy.shape[1], w_h.shape[0]
        # At T=1 nothing multiplies W_h (the step takes dh_rec0): the pointwise work decides
        if T == 1:
            serial = N * GH <= SERIAL_POINTWISE
        else:
            serial = self._serial_loop((T - 1) * N, GH * w_h.shape[1])
        wpack_rows, dg16, wpairs_rows = scratch.wpack_rows, self._no_dg16, self._no_pairs3
        if self.bf16:
            wpairs_rows = scratch.wpairs_rows.view(np.uint32)
            dg16 = scratch.dg16.view(np.uint16)    # (2, N, 2*kp)
            if T > 1:
                pack_k_pairs(w_h, wpairs_rows)
                dg16[:, :, GH:] = 0                # odd G*H: the pad multiplies 0
            blocks = wpairs_rows.shape[0]
        else:
            if T > 1:
                wpack_rows = pack_recurrent_rows(w_h, wpack_rows)
            blocks = wpack_rows.shape[0]
        scalar = self.dtype.type
        _launch((self._backward, self._backward_serial), serial, T, blocks, (
            dy, d, wpack_rows, (hs, cs), saved, (dgx, dgh), (dh_rec0, dh_carry, dc_carry),
            scratch.tiles, lengths, (scalar(clip_lo), scalar(clip_hi), clip_flags),
            (dg16, wpairs_rows)))


_layers: dict = {}
_lock = threading.Lock()


def _bits_or_values(w):
    """A weight for the pair packers: bfloat16 as its bits (uint16), float32 as it is."""
    return w.view(np.uint16) if dtype_name(w.dtype) == "bfloat16" else w


def own_gemm(dtype):
    """Whether the micro-kernel beats numpy's BLAS at a large product in `dtype`."""
    return np.dtype(dtype) == np.float32 or VECTOR_BITS == 512


def fused_layer(mode, dtype, bf16=False, widens=False):
    """The FusedLayer for (mode, dtype, bf16), built once per process. bf16 needs
    AVX512-BF16; widens (float32): reads layer 0's float16 / bfloat16 data in place."""
    if widens:
        if bf16 or np.dtype(dtype) != np.float32:
            raise ValueError(f"fused_layer: widens is float32's without bf16, got "
                             f"{np.dtype(dtype)} bf16={bf16}")
        base = fused_layer(mode, dtype)
    key = (mode, np.dtype(dtype).str, bool(bf16), bool(widens))
    with _lock:
        layer = _layers.get(key)
        if layer is None:
            if bf16 and not HAS_BF16:
                raise NotImplementedError("fused_layer: bf16 needs AVX512-BF16, which this "
                                          "CPU lacks")
            if widens:   # the same compiled kernels; its own scratch and reads_storage
                layer = copy.copy(base)
                layer.widens = layer.reads_storage = True
            else:
                layer = FusedLayer(mode, dtype, bf16)
            _layers[key] = layer
    return layer
