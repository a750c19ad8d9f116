"""The whole time loop of one layer and direction in one compiled function (CPU).

The generic driver (recurrence.py) runs two parallel regions per step: numpy's BLAS
for h_{t-1} @ W_h^T (which re-packs W_h on every call), then the cell kernel, handing
the cores back and forth between OpenBLAS's and Numba's threads. Here the whole loop is
one Numba parallel region whose workers walk the steps together, sharing each step's
blocks of 16 hidden units (lowlevel/workshare.py: claims, a spin barrier at each step's
end, and why not a region per step). A block multiplies h_{t-1} by its own pre-packed
panels of W_h (lowlevel/microkernel.py, lowlevel/packing.py), all G gates of its units,
into a small tile that stays in cache (the bfloat16 layer, from N=8, also W_x x_t by
W_x's panels: FusedLayer.fuses_input), and applies the cell's pointwise math (units.py)
to it at once. The step's other inputs (W_x x_t otherwise, biases, h_{t-1}, c_{t-1})
come into the tile, and the results go out, as 16-element vector rows (lowlevel/rows.py,
and why not element by element); the bfloat16 layer's products start from the biases
instead (b_x as a row still, where it reads xproj). No per-step Python, no allocation in
the loop.

Used for every cell without a projection (the projected LSTM keeps the generic path).
At T=1 (a decoder step) a second form of the same kernel, FusedLayer.forward_single,
does the whole layer-direction in one region with the weights read in place: there,
each weight is used once and packing it would cost more than the product.

layer_forward(xproj, d, wpack, bx, bh, hs, cs, y, saved, tiles, lengths,
              clip_lo, clip_hi, clip_flags, x, w_x, w_h, x_cols, h_cols, w_rows, h16, wpairs,
              x16, wxpairs, bias_rows, counters, workers)
    xproj   (T, N, D*G*H)   in   W_x x_t of both directions, no bias; this one at d*G*H
                                 (empty where x16 is given)
    d       int                  direction: 0 runs t = 0..T-1, 1 runs t = T-1..0
    wpack   (B, G, H, 16)   in   W_h of this layer and direction, pack_recurrent's layout
                                 (lowlevel/packing.py)
    bx, bh  (G*H,)          in   biases
    hs      (D, T+1, N, H)  in/out  state sequence (recurrence.py's row convention): the
                                 initial state row must be set; every other row of
                                 direction d is written
    cs      (D, T+1, N, H)  in/out  the same for the LSTM cell state; (D, T+1, N, 0) else
    y       (T, N, D*H)     out  layer output, this direction's columns d*H..(d+1)*H
    saved   (D, T, N, S*H)  out  training record (cells.py's layout); (0, 0, 0, 0) for none
    tiles   (B, N, 256)     scratch, one tile per block (layout: TILE_GROUPS below)
    lengths (N,) int64      in   per-sample lengths, (0,) for all T: inactive steps carry
                                 the state and write 0 to y
    clip_*                       LSTM cell-state clipping, in the data's dtype (cells.py)
    x, w_x, w_h, x_cols, h_cols, w_rows   empty here; the T=1 form's inputs there
                                 (FusedLayer.forward_single documents them)
    h16, wpairs                  the bf16 layer's h_t rounded and W_h's pairs (empty else)
    x16     (T*N, kx) uint32 in  the bf16 layer's input as bfloat16 pairs (kx = ceil(K/2)),
                                 where it multiplies W_x x_t itself (FusedLayer.fuses_input);
                                 (0, 0) else
    wxpairs (B, G, kx, 16) uint32  in  this direction's W_x, pack_recurrent_pairs's layout
                                 (as wpairs; empty where x16 is)
    bias_rows (2, B, G, 16)  in  the bf16 layer's bx (0) and bh (1) by block, zero past H
                                 (bias_rows_of): its products start from them (bias_rows[0]
                                 where x16 is given; with xproj the loop adds bx to it);
                                 (0, 0, 0, 0) else, where the loop adds bx and bh
    counters (T, stride) int64   zero on entry, workshare.new_counters's layout
    workers  int                 parallel workers, 1..B (FusedLayer: Numba's thread count)
    All arrays C-contiguous and of one dtype (lengths, counters, the bf16 layer's bits
    excepted); no two overlap.
"""
from __future__ import annotations

import copy
import threading

import numba as nb
import numpy as np
from numba import prange

from ..config import CELLS
from .lowlevel import (
    CHUNK,
    HAS_BF16,
    PANEL,
    VECTOR_BITS,
    claim,
    finish,
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
    row_round,
    row_zero,
    zero_like,
)
from .threads import KERNEL_OPTIONS, LAUNCH_LOCK, SLEEPING_WORKERS, pick, serial_only
from .units import MODE_INDEX, backward_unit, forward_unit

__all__ = ["FusedLayer", "fused_layer"]


# One tile row per sample, in 16-wide column groups (why: the cell math then reads and
# writes a single array at fixed offsets, so LLVM vectorises it without the run-time
# alias checks that many separate arrays would need, and gives up on):
_R, _X = 0, 4            # groups 0..3: W_h h_{t-1} + b_h per gate;  4..7: W_x x_t + b_x
_HP, _CP = 8, 9          # previous h, previous c
_H, _C, _S = 10, 11, 12  # new h, new c, training record s0..s3 (groups 12..15)
TILE_GROUPS = 16

# The cell loops over a block's 16 units must reach LLVM's loop vectoriser in a form it
# takes; three things stopped it, each seen in the asm (znver4, Numba 0.68 / LLVM 20):
# 1. The trip count. With the constant 16, LLVM unrolls the loop fully before the loop
#    vectoriser runs and leaves straight-line code (the ReLU cell: 16 scalar maxss). So
#    `lanes` (== PANEL) is read from the tile's shape at run time.
# 2. Signed indices. Numba wraps every signed index (i < 0: i + dim) with a select on
#    the address, which LLVM could not remove for all of the tile's columns, so the
#    loads looked like gathers and the cost model kept the loop scalar. The columns
#    (_columns) and `lanes` are unsigned, and unsigned indices have no wraparound.
# 3. Branches in the math (lowlevel/mathfn.py's select says why it emits selects).
# Each of the three made the cell loops faster; with all three the GRU forward runs
# level with the loop with no cell at all.
# Measured: bench/results/cpu-kernel-notes.md#fused-vectorising-the-cell-loops


@nb.njit(inline="always", cache=True)
def _weight_rows(w, first, count, wb):
    """The address of rows first..first+count-1 of a weight (C-contiguous) as the T=1
    form's product reads them: in place, or where w holds bfloat16 bits (uint16) widened
    into the worker's rows wb first, which stay in L1/L2 for the product (so the op
    widens no weights; Measured: FusedLayer's note on reads_weights). wb is overwritten:
    take the next weight's rows after this one's product."""
    K = w.shape[1]
    if w.itemsize == 2:
        for r in range(count):
            for k in range(K):
                wb[r * K + k] = np.uint32(w[first + r, k]) << np.uint32(16)
        return wb.ctypes.data
    return w.ctypes.data + np.uint64(first * K * w.itemsize)   # (uint64 either way)


@nb.njit(inline="always", cache=True)
def _hand_over(tiles, first, N, group, like):
    """After a pair's product (note above _make_layer_forward; the backward's, note above
    PAIR_ROWS): the second block's sums, left in group `group` + 1 of the first
    block's tile, moved to group `group` of its own."""
    row, itemsize = tiles.shape[2], tiles.itemsize
    for n in range(N):
        row_copy(tiles[first + 1].ctypes.data + (n * row + group * PANEL) * itemsize,
                 tiles[first].ctypes.data + (n * row + (group + 1) * PANEL) * itemsize, PANEL,
                 like)


def _spec(mode):
    """The CellSpec of a kernel's mode index (units.MODE_INDEX: the kernels hold the index,
    units.py says why)."""
    return CELLS[tuple(MODE_INDEX)[mode]]


def _columns(*groups):
    """The first tile column of each group, as unsigned constants (note above)."""
    return tuple(np.uint64(group * PANEL) for group in groups)


def _make_layer_forward(mode, gates, saved_width, dtype, single_step, parallel=True,
                        bf16=False):
    """layer_forward (module docstring), or with single_step its T=1 form, which takes
    the layer input and the raw weights (FusedLayer.forward_single says why). Without
    `parallel`, plain serial code (the note above SERIAL_WORK says when). With `bf16`
    (T > 1 only) the recurrent product is vdpbf16ps's: h_{t-1} from h16, W_h from wpairs;
    and where x16 is given, W_x x_t too, from x16 and wxpairs, instead of reading xproj."""
    itemsize = np.dtype(dtype).itemsize
    last = gates - 1
    row = TILE_GROUPS * PANEL
    # The cell's columns (gates past the cell's count repeat its last; the unit ignores
    # them), unsigned so the cell loop vectorises (note above _columns).
    x_cols_in = _columns(*(_X + min(g, last) for g in range(4)))
    r_cols_in = _columns(*(_R + min(g, last) for g in range(4)))
    h_prev_in, c_prev_in, h_out, c_out = _columns(_HP, _CP, _H, _C)
    s_out = _columns(*(_S + k for k in range(4)))
    reads_h = _spec(mode).reads_h_prev   # else h_{t-1} stays out of the tile
    # A one-gate cell (the RNNs) has one W_h panel per block, and a one-panel tile keeps
    # 6 sums (lowlevel/microkernel.py): so for T > 1 and N >= PAIR_ROWS a work item is two
    # blocks, their two panels in one product (8 x 2 tiles). Group _R + 1 of the first
    # block's tile, unused by a one-gate cell, takes the second block's product on its way
    # to that block's tile (and group _X + 1 its W_x x_t, where the bf16 layer fuses it).
    # Measured: bench/results/cpu-kernel-notes.md#fused-one-gate-blocks-in-pairs
    per = 2 if gates == 1 and not single_step else 1
    # The bf16 products start from the biases (bias_rows, by block as the panels are), so
    # the tile's rows need no pass adding b_x and b_h after them: the loop alone, T=100
    # N=128 I=H=256, the median of each round's time over the pass's: LSTM 0.972, GRU
    # 0.984, rnn_tanh 0.965; the design size's LSTM 0.990.
    # Measured: bench/results/cpu-kernel-notes.md#bf16-products-that-start-from-the-biases

    def layer_forward(xproj, d, wpack, bx, bh, hs, cs, y, saved, tiles, lengths,
                      clip_lo, clip_hi, clip_flags, x, w_x, w_h, x_cols, h_cols, w_rows, h16,
                      wpairs, x16, wxpairs, bias_rows, counters, workers):
        if not parallel:   # (also keeps the two builds apart in Numba's cache index)
            workers = 1
        T, N, H = hs.shape[1] - 1, hs.shape[2], hs.shape[3]
        K = x.shape[1]
        x_col, y_col = d * gates * H, d * H
        has_c, record = cs.shape[3] != 0, saved.shape[0] != 0
        all_active = lengths.shape[0] == 0
        h_rows = hs.ctypes.data + d * (T + 1) * N * H * itemsize   # hs[d, 0, 0, 0]
        c_rows = cs.ctypes.data + d * (T + 1) * N * cs.shape[3] * itemsize
        like, zero16 = zero_like(hs), np.uint16(0)
        lanes = np.uint64(tiles.shape[2] // TILE_GROUPS)   # == PANEL (note above _columns)
        kp = wpairs.shape[2]                                # bf16: pairs of h per row
        h16_rows = h16.ctypes.data + d * (T + 1) * N * kp * 4   # h16[d, 0, 0, 0] (bf16)
        # bf16 with x16: W_x x_t multiplied here too, from the input's pairs (no xproj)
        fuses_x, kpx = x16.shape[0] != 0, x16.shape[1]
        # A plain variable for prange: with this conditional inside prange(...) Numba ran
        # the loop serially (measured: every fused call 2.5x slower). Guarded by
        # tests/cpu/test_parallel_regions.py.
        blocks = tiles.shape[0] if single_step else (wpairs if bf16 else wpack).shape[0]
        pair = 2 if per == 2 and N >= PAIR_ROWS else 1
        claims = -(-blocks // pair)   # work items: blocks, or pairs of one-gate blocks
        if single_step:   # x and h_0 as columns, 16 samples per panel (serial: small)
            for p in range(x_cols.shape[0]):
                pack_panel(x, p * PANEL, min(PANEL, N - p * PANEL), x_cols[p])
                pack_panel(hs[d, 0 if d == 0 else 1], p * PANEL, min(PANEL, N - p * PANEL),
                            h_cols[p])
        for worker in prange(workers):   # each walks every step (workshare.py)
            # the worker's rows of widened bfloat16 weights (an argument: the caller's
            # array outlives every product that reads it)
            wb = w_rows[worker % w_rows.shape[0]]   # (one empty row where unused)
            for step in range(T):
                t = step if d == 0 else T - 1 - step
                prev = t if d == 0 else t + 1
                nxt = t + 1 if d == 0 else t
                h_prev_addr = h_rows + prev * N * H * itemsize
                done = 0
                while True:
                    q = claim(counters, step, worker, workers, claims)
                    if q < 0:
                        break
                    done += 1
                    first = q * pair
                    if bf16:   # vdpbf16ps's products (FusedLayer.bf16), each starting
                        # from its bias (note above _make_layer_forward): W_x x_t + b_x into
                        # the X groups where the loop takes it (fuses_x), then W_h h_{t-1}
                        # + b_h into R
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
                            # Two one-gate blocks in one product (note above
                            # _make_layer_forward), the second's panel into its own tile.
                            panel_gemm(h_prev_addr, H, N, wpack[first, 0].ctypes.data,
                                       H * PANEL, 2,
                                       tiles[first].ctypes.data + _R * PANEL * itemsize, row,
                                       H, like)
                            _hand_over(tiles, first, N, _R, like)
                        else:   # all G gate panels of the block in one product
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
                                # (W rows of this block's units) @ (all samples, 16 to a
                                # column panel), stored transposed into the tile: the
                                # weights are read once, in place.
                                c = tile.ctypes.data
                                unit = g * H + j0
                                panel_gemm_t(_weight_rows(w_x, unit, width, wb), K, width,
                                             x_cols.ctypes.data, K * PANEL, x_cols.shape[0],
                                             c + (_X + g) * PANEL * itemsize, row, K, like)
                                panel_gemm_t(_weight_rows(w_h, unit, width, wb), H, width,
                                             h_cols.ctypes.data, H * PANEL, h_cols.shape[0],
                                             c + (_R + g) * PANEL * itemsize, row, H, like)
                                for n in range(N):   # units past H (partial block): zeros
                                    for u in range(width, PANEL):
                                        tile[n, (_R + g) * PANEL + u] = 0
                                        tile[n, (_X + g) * PANEL + u] = 0
                        for n in range(N):
                            # Addresses of this sample's rows (all arrays C-contiguous).
                            trow = tile.ctypes.data + n * row * itemsize
                            h_prev = h_rows + ((prev * N + n) * H + j0) * itemsize
                            h_next = h_rows + ((nxt * N + n) * H + j0) * itemsize
                            h16_prev = h16_rows + ((prev * N + n) * kp * 2 + j0) * 2   # (bf16)
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
                            if has_c:   # (the other cells never read c_prev)
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
                finish(counters, step, done, claims)

    return nb.njit(parallel=parallel, **KERNEL_OPTIONS)(layer_forward)


# Numba compiles a prange body into a library of its own (optimised at O3), then links it
# into the kernel's library and optimises the whole again; the disk cache keeps that twice
# optimised copy, the freshly compiled process runs the first. Plain loops over u here
# (the backward's zeroing of a finished sample's gradients) came out of the second round
# as 4000 instructions that made the whole body spill: the bf16 LSTM backward loop ran in
# 50 ms compiled fresh and 70-78 ms from the cache, every later process. So rows move as
# rows (rows.py), also where a loop would be short.
# Measured: bench/results/cpu-kernel-notes.md#fused-code-optimised-twice
def _make_layer_backward(mode, gates, saved_width, dtype, parallel=True, bf16=False):
    """The backward twin of layer_forward (arguments: FusedLayer.backward). With `bf16`
    the recurrent product dh_rec = dg_later @ W_h is vdpbf16ps's: each step also writes
    its dg rounded to bfloat16 into dg16 (two rows, by step parity), and the next step
    multiplies those by W_h's pairs (wpairs_rows)."""
    itemsize = np.dtype(dtype).itemsize
    row = TILE_GROUPS * PANEL
    # Backward tile groups: 0 dh_rec; 1 dh; 2 dc in; 3..6 record; 7 h_prev; 8 c_prev; 9 c_t;
    # 10..13 dx per gate; 14 dh carry out; 15 dc carry out; dr per gate reuses 3..6. A pair's
    # product leaves the second block's dh_rec in group 1 until _hand_over moves it.
    _DHR, _DH, _DC, _SV, _HPB, _CPB, _CT, _DX, _DHC, _DCC = 0, 1, 2, 3, 7, 8, 9, 10, 14, 15
    # The cell's columns, unsigned so the cell loop vectorises (note above _columns).
    dh_in, dc_in, h_prev_in, c_prev_in, c_t_in, dh_out, dc_out = _columns(
        _DH, _DC, _HPB, _CPB, _CT, _DHC, _DCC)
    rec_in = _columns(*(_SV + k for k in range(4)))     # becomes dr per gate
    dx_out = _columns(*(_DX + g for g in range(4)))
    reads_h = _spec(mode).reads_h_prev   # else h_{t-1} stays out of the tile

    def layer_backward(dy, d, wpack_rows, hs, cs, saved, dgx, dgh, dh_rec0, dh_carry,
                       dc_carry, tiles, lengths, clip_lo, clip_hi, clip_flags, dg16,
                       wpairs_rows, counters, workers):
        if not parallel:
            workers = 1
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
        claims = -(-blocks // pair)   # work items: pairs of blocks, or blocks
        for worker in prange(workers):   # each walks every step (workshare.py)
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
                    # dh_rec = dg_later @ W_h for this claim's units: a pair of blocks in
                    # one product (note above PAIR_ROWS), the second's handed over
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
                                # (Row moves, not loops over u: LLVM vectorised those loops into
                                # code that, optimised again where Numba links the kernel, made
                                # the whole loop spill; note above _make_layer_backward.)
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
                            if has_c:   # (the other cells never read these)
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

    return nb.njit(parallel=parallel, **KERNEL_OPTIONS)(layer_backward)


def _workshare(steps, blocks, serial=False):
    """(counters, workers) for one launch (workshare.py): as many workers as the calling
    thread's Numba thread count, at most one per block; one for a serial build (`serial`,
    or every build threads.pick picks in a serial-only process)."""
    workers = 1 if serial or serial_only() else max(1, min(nb.get_num_threads(), blocks))
    return new_counters(steps, workers), workers


# Small calls run the serial builds (compiled on first use, no launch): the single-step
# forward up to SERIAL_WORK multiply-adds (N*G*H*(H+K)), the T > 1 forward loop up to
# SERIAL_LOOP_WORK (T*N*G*H*H, plus T*N*G*H*K where the loop multiplies the input too; a
# bfloat16 loop's products count half, vdpbf16ps doing two per lane), and the T=1
# backward, pointwise alone, up to SERIAL_POINTWISE gate values (N*G*H). The bounds
# depend on the layer: on workqueue (a numpy program) a launch wakes sleeping workers and
# the serial build won up to 2^25 multiply-adds at T=1 (LSTM H=256 N=32 212 against 336
# us) and 2^24 in the loops (LSTM T=20 N=8 H=128 285 against 515 us); on the OpenMP layer
# (a torch program) the parallel build wins from about 2^20. A loop whose weights pass
# one core's L2 (SERIAL_LOOP_BYTES, 1 MB on Zen 4 and 5) stays parallel at any size: each
# step streams them, and two cores hold and fetch twice as much (GRU T=20 N=1 H=384, 1.8
# MB: serial 918 against 708 us).
# Measured: bench/results/cpu-kernel-notes.md#fusedlayer-serial-bounds-for-each-layer
SERIAL_WORK = 1 << 25 if SLEEPING_WORKERS else 1 << 19
SERIAL_LOOP_WORK = 1 << 24 if SLEEPING_WORKERS else 1 << 20
SERIAL_LOOP_BYTES = 1 << 20
# One-gate blocks go in pairs from this many samples (the note above _make_layer_forward):
# at N=1 a 1 x 2 tile has two sums and no split, and rnn_tanh T=100 N=1 H=512 measured
# 0.91-0.94x; from N=4 the pairs measured 1.06-1.22x; N=2-3 was within noise.
# The backward's product dh_rec = dg_later @ W_h has one panel per block (16 units of
# dh) for every cell: from PAIR_ROWS samples, where there are at least two blocks per
# worker (so that pairing leaves no worker idle), its work items are pairs of blocks, their
# two panels in one product (8 x 2 tiles instead of 6 x 1), the second's sums handed over
# (_hand_over). Design-size backward loops, float32: LSTM 108 -> 79 ms, GRU 83 -> 62,
# rnn_tanh 33 -> 25; bfloat16 LSTM 76 -> 59; smaller shapes no slower.
# Measured: bench/results/cpu-kernel-notes.md#fused-the-backwards-product-in-pairs
PAIR_ROWS = 4
# The bf16 layer multiplies W_x x_t inside its loop (FusedLayer.fuses_input) from this many
# samples: each step's product reads all of W_x's panels for N rows, where the projection
# before the loop reads them once for T*N. bfloat16 inference, numpy arrays, T=100 I=H=512,
# ms, the projection / inside the loop: LSTM N=1 1.8-2.1 / 2.5-2.8, N=4 2.89-2.94 /
# 3.05-3.08, N=8 5.3-5.8 / 5.0-5.3, N=16 9.8-10.2 / 9.1-9.4; rnn_tanh N=4 1.14-1.17 /
# 1.18-1.22, N=8 1.7-1.95 / 1.56-1.66.
# Measured: bench/results/cpu-kernel-notes.md#bf16-the-input-product-inside-the-loop
FUSED_INPUT_ROWS = 8
# (the T=1 backward's bound, SERIAL_WORK's note: in a numpy program 2^18 gate values,
# old/new 1.062x over 27 float32 training steps, LSTM N=128 H=512 8.3 -> 6.6 ms)
SERIAL_POINTWISE = 1 << 18 if SLEEPING_WORKERS else 1 << 14


def bias_rows_of(bx, bh, out):
    """bx and bh (G*H,) by block, the bf16 loop's bias rows: out (2, B, G, 16), out[0, b, g]
    = bx[g*H + 16b : +16] (bh in out[1]), zero past H: each bias packed as W_h's one-column
    twin (pack_recurrent's layout with K = 1). Returns out."""
    B, G = out.shape[1], out.shape[2]
    for k, b in enumerate((bx, bh)):
        pack_recurrent(np.ascontiguousarray(b).reshape(-1, 1), G, out[k].reshape(B, G, 1, PANEL))
    return out


class FusedLayer:
    """The compiled fused loop of one (mode, dtype), launched under LAUNCH_LOCK: the
    recurrence's FusedLayer protocol, with its InputProjection and SingleStep forms.
    Each call packs W_h into the op's scratch (pack_recurrent's layout) itself."""

    fuses_single_step = True   # forward_single() serves T=1

    def __init__(self, mode, dtype, bf16=False):
        spec = CELLS[mode]
        self.gates, self.dtype = spec.gates, np.dtype(dtype)
        # bfloat16 data on a CPU with AVX512-BF16 (float32 inside, config.PRECISIONS):
        # for T > 1 the input projection and the recurrent product run on vdpbf16ps,
        # from bfloat16 values (the layer input, h_{t-1} rounded as it is written, the
        # weights, all exact bfloat16 or rounded to it) with float32 sums; the cell math,
        # states and record stay float32. Layer 0's bfloat16 data is read in place.
        # Design-size LSTM: projection 60-64 -> 32-34 ms, loop 72-77 -> 44-48 ms.
        # Measured: bench/results/cpu-kernel-notes.md#bf16-the-fused-forward-in-bfloat16-issue-25
        self.bf16 = self.reads_storage = bf16
        # ... and its W_x and W_h as bfloat16 bits, packed into pairs as they are (an
        # inference converts no weights: the design-size LSTM's packing 3.0 -> 0.8 ms, and
        # no 1 ms widening of 5.1M parameters first). At T=1 (forward_single) the float32
        # kernel reads them in place, each block widening its 16 rows into a buffer in
        # cache: a decoder step reads the weights' 2 bytes once, not 2 + 4 to widen the
        # vector and 4 again to multiply.
        # Measured: bench/results/cpu-kernel-notes.md#bf16-weights-read-in-place
        self.reads_weights = bf16
        # float16 data (and bfloat16 without AVX512-BF16) on the float32 layer: the widening
        # form (fused_layer(..., widens=True), a copy sharing the compiled code) reads
        # layer 0's data in place, project_widened converting 96 rows at a time, so the
        # op makes no float32 copy of it.
        self.widens = False
        # project() replaces the driver's BLAS input GEMM in float32 (lowlevel/gemm.py
        # says why), and in float64 where the tiles are 512 bits wide; with 256-bit tiles
        # numpy's dgemm was faster.
        # Measured: bench/results/cpu-kernel-notes.md#fusedlayer-whether-to-project-the-input
        self.projects_input = own_gemm(self.dtype)
        # bf16 at T > 1 and N >= FUSED_INPUT_ROWS (fuses_input): no projection before the
        # loop; each block multiplies W_x x_t too, from the input's bfloat16 pairs and this
        # direction's W_x packed by block as W_h is, into its tile's X groups. The products
        # are as fast at N rows as at T*N, and the loop no longer reads W_x x_t back from a
        # (T*N, D*G*H) float32 array written by a GEMM before it (77 MB at the design size,
        # past L3: the op carves none).
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
        self._no_weights = np.empty((0, 0), self.dtype)        # unused inputs of either form
        self._no_panels = np.empty((0, 0, 0), self.dtype)
        self._no_xproj = np.empty((0, 0, 0), self.dtype)
        self._no_wpack = np.empty((0, 0, 0, 0), self.dtype)
        self._no_h16 = np.empty((0, 0, 0, 0), np.uint16)
        self._no_pairs = np.empty((0, 0, 0, 0), np.uint32)
        self._no_x16 = np.empty((0, 0), np.uint32)
        self._no_bias_rows = np.empty((0, 0, 0, 0), self.dtype)
        self._no_rows = np.empty((1, 0), np.uint32)   # (w_rows: one row, as it is indexed)
        self._backward, self._backward_serial = (
            _make_layer_backward(MODE_INDEX[mode], spec.gates, spec.saved, self.dtype, parallel,
                                 bf16=bf16)
            for parallel in (True, False))
        self._no_dg16 = np.empty((0, 0, 0), np.uint16)
        self._no_pairs3 = np.empty((0, 0, 0), np.uint32)

    def forward_scratch(self, config, steps, batch):
        """Scratch shapes the op carves once. For T > 1: packed W_h, the per-block tiles,
        and where project() serves, the packed input weights of both directions (flat)
        and its spill tiles; the bf16 layer's wx_pairs also holds one direction's W_x
        packed by block where it fuses_input.
        For T = 1 (forward_single): the tiles padded to whole 16-sample panels and the
        layer input and h_0 as 16-sample columns (x_cols flat, for any layer's K); the
        others are empty."""
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
                # forward_single's bfloat16 weights widened, 16 rows per worker (float32-
                # sized, viewed as uint32)
                "w_rows": (nb.config.NUMBA_NUM_THREADS if single and self.reads_weights
                           else 0, PANEL * max(max_in, H))}

    def backward_scratch(self, config, batch):
        """W_h packed by rows (pack_recurrent_rows), or with bf16 as pairs (pack_k_pairs)
        beside two rows of bfloat16 dg (float32-sized, viewed as uint32 / uint16); backward
        also uses forward's tiles."""
        B, GH, kp = panels(config.recurrent_size), config.gate_rows, -(-config.gate_rows // 2)
        return {"wpack_rows": (0 if self.bf16 else B, GH, PANEL),
                "wpairs_rows": (B if self.bf16 else 0, kp, PANEL),
                "dg16": (2 if self.bf16 else 0, batch, kp)}

    def project(self, x2d, w_xs, out, scratch):
        """out (M, D*G*H) = x2d (M, K) @ [W_x of each direction]^T, on Numba's threads
        (lowlevel/gemm.py says why not numpy's); scratch.wx_panels and .spill as carved.
        With bf16, x2d may be the bfloat16 data itself (read in place where K is even)
        or float32 (rounded into scratch.x16 first). The widening form also takes layer 0's
        float16 or bfloat16 data, widened a chunk at a time into scratch.x_block."""
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
        half = x2d.dtype.name
        if half in ("float16", "bfloat16"):
            project_widened(np.ascontiguousarray(x2d).view(np.uint16), half == "bfloat16",
                            wpack, out, scratch.spill, scratch.x_block)
            return
        project(np.ascontiguousarray(x2d), wpack, out, scratch.spill)

    def _serial_loop(self, rows, weights):
        """Whether a T > 1 loop runs its serial build (the note above SERIAL_WORK): `rows`
        multiplied by `weights` elements of W (bfloat16 pairs where self.bf16, counted
        half; else self.dtype)."""
        work, size = rows * weights, 2 if self.bf16 else self.dtype.itemsize
        return ((work // 2 if self.bf16 else work) <= SERIAL_LOOP_WORK and
                weights * size <= SERIAL_LOOP_BYTES)

    def fuses_input(self, steps, batch):
        """Whether forward() multiplies W_x x_t itself (note in __init__) at this size."""
        return self._fuses and steps > 1 and batch >= FUSED_INPUT_ROWS

    def input_pairs(self, x2d, scratch):
        """(bf16) The layer input x2d (M, K) as rows of bfloat16 pairs (M, ceil(K/2))
        uint32: the bfloat16 data itself where K is even (read in place), else rounded
        into scratch.x16 (float32 values, or bfloat16 with an odd K padded)."""
        M, K = x2d.shape
        if x2d.dtype.name == "bfloat16" and K % 2 == 0:
            return np.ascontiguousarray(x2d).view(np.uint32)
        kp = -(-K // 2)
        a16 = scratch.x16.reshape(-1)[:M * kp].view(np.uint16).reshape(M, 2 * kp)
        round_rows(x2d.astype(np.float32, copy=False), a16)
        return a16.view(np.uint32)

    def forward(self, xproj, d, w_h, bx, bh, hs, cs, y, saved, scratch, lengths,
                clip_lo, clip_hi, clip_flags, x_pairs=None, w_x=None):
        """layer_forward (module docstring) for direction d, W_h (G*H, H) packed first
        into scratch.wpack; scratch.tiles as carved for T > 1. Where the layer
        fuses_input, xproj is None and the loop multiplies W_x x_t itself: x_pairs
        (T*N, ceil(K/2)) uint32, input_pairs's, shared by the directions; w_x (G*H, K)
        this direction's W_x (bfloat16 or float32 values), packed into scratch.wx_pairs."""
        wpack, tiles = (scratch.wpairs if self.bf16 else scratch.wpack), scratch.tiles
        if wpack.shape[0] != tiles.shape[0] or wpack.shape[0] != panels(hs.shape[3]):
            raise ValueError(f"FusedLayer.forward: wpack {wpack.shape} and tiles "
                             f"{tiles.shape} must both have {panels(hs.shape[3])} blocks "
                             f"(T=1 scratch is forward_single's)")
        h16, wpairs, x16, wxpairs = self._no_h16, self._no_pairs, self._no_x16, self._no_pairs
        fuses = x_pairs is not None   # (the op's decision: fuses_input at its size)
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
        width = H + (w_x.shape[1] if fuses else 0)   # (the weights each step multiplies)
        serial = self._serial_loop(T * N, self.gates * H * width)
        scalar = self.dtype.type
        share = _workshare(T, tiles.shape[0], serial)
        with LAUNCH_LOCK:
            pick(self._forward, self._forward_serial, serial)(
                xproj, d, wpack, bx, bh, hs, cs, y, saved, tiles, lengths, scalar(clip_lo),
                scalar(clip_hi), clip_flags, self._no_weights, self._no_weights,
                self._no_weights, self._no_panels, self._no_panels, self._no_rows, h16, wpairs,
                x16, wxpairs, bias_rows, *share)

    def _weight(self, w):
        """A weight for forward_single, contiguous: in the layer's dtype, or with
        reads_weights bfloat16 as its bits (uint16: the kernel widens a block's rows at a
        time)."""
        if w.dtype != self.dtype and not (self.reads_weights and w.dtype.name == "bfloat16"):
            raise TypeError(f"FusedLayer.forward_single: weights of {self.dtype} "
                            f"{'or bfloat16 ' if self.reads_weights else ''}expected, got "
                            f"{w.dtype}")
        return np.ascontiguousarray(_bits_or_values(w))

    def forward_single(self, x2d, d, w_x, w_h, bx, bh, hs, cs, y, saved, scratch, lengths,
                       clip_lo, clip_hi, clip_flags):
        """A whole T=1 layer-direction in one parallel region, with the weights used in
        place: each block of 16 units multiplies its rows of W_x and W_h by x and h_0
        (packed as 16-sample columns first) and runs the cell. Why: at T=1 each weight
        is used once, so forward()'s path (pack W_x, project, pack W_h, step: four
        region launches, the weights copied twice) costs more than the products
        (measured: bench/results/cpu-kernel-notes.md#fusedlayer-the-single-step-form).
            x2d     (N, K)            in   the layer input of the one step
            w_x     (G*H, K), w_h (G*H, H)   in   this direction's weights, C-contiguous;
                                              with reads_weights also bfloat16 (read in
                                              place, each block's rows widened as it
                                              takes them: the same sums)
            scratch.tiles   (B, ceil(N/16)*16, 256)   forward_scratch's, T=1
            scratch.x_cols  flat, >= ceil(N/16)*K*16;  scratch.h_cols (ceil(N/16), H, 16)
            scratch.w_rows  (threads, 16*max(K, H)), read where the weights are bfloat16:
                            each worker's 16 rows widened to float32
        Everything else as forward() with T=1 (hs, cs: (D, 2, N, H))."""
        scalar = self.dtype.type
        K, tiles, h_cols = x2d.shape[1], scratch.tiles, scratch.h_cols
        N, GH, H = x2d.shape[0], w_h.shape[0], w_h.shape[1]
        serial = N * GH * (H + K) <= SERIAL_WORK
        kernel = pick(self._forward_single, self._forward_single_serial, serial)
        share = _workshare(1, tiles.shape[0], serial)
        w_x, w_h = self._weight(w_x), self._weight(w_h)
        w_rows = self._no_rows
        if w_x.dtype == np.uint16:   # the worker's rows of widened weights
            w_rows = scratch.w_rows.view(np.uint32)
            if w_rows.shape[0] < share[1] or w_rows.shape[1] < PANEL * max(K, H):
                raise ValueError(f"FusedLayer.forward_single: w_rows {w_rows.shape} cannot "
                                 f"hold {PANEL} rows of {max(K, H)} for {share[1]} workers")
        with LAUNCH_LOCK:
            kernel(self._no_xproj, d, self._no_wpack, bx, bh, hs, cs, y, saved, tiles, lengths,
                   scalar(clip_lo), scalar(clip_hi), clip_flags, np.ascontiguousarray(x2d),
                   w_x, w_h, scratch.x_cols[:h_cols.shape[0] * K * PANEL].reshape(-1, K, PANEL),
                   h_cols, w_rows, self._no_h16, self._no_pairs, self._no_x16,
                   self._no_pairs, self._no_bias_rows, *share)

    def backward(self, dy, d, w_h, hs, cs, saved, dgx, dgh, dh_rec0, dh_carry, dc_carry,
                 scratch, lengths, clip_lo, clip_hi, clip_flags):
        """One direction's backward recurrence (the layer's weight gradients are GEMMs
        the caller runs over all steps afterwards).
            dy          (T, N, D*H)     in   gradient of the layer output
            w_h         (G*H, H)        in   packed first into scratch.wpack_rows
            hs, cs, saved                in   the training forward's record (layer_forward)
            dgx         (T, N, D*G*H)   out  d(pre-activation), this direction's columns
            dgh         (T, N, D*G*H)   out  the recurrent side where it differs (GRU);
                                             (T, N, 0) otherwise
            dh_rec0     (N, H)          in   gradient of the final state h (dhy)
            dh_carry    (N, H)          in/out  must be 0 on entry; on exit the part of
                                             dh_0 that bypasses W_h
            dc_carry    (N, H)          in/out  dcy on entry, dc_0 on exit; (N, 0) else
            scratch     .tiles (B, N, 256) and .wpack_rows, as carved; with bf16
                        .wpairs_rows (W_h as pack_k_pairs's panels) and .dg16 instead
                        of .wpack_rows: the recurrent product on vdpbf16ps (design-size
                        loop: LSTM 109 -> 101 ms, GRU 88 -> 73, rnn_tanh 37 -> 28;
                        bench/results/cpu-kernel-notes.md#bf16-the-training-gemms)
        On exit dh_0 = dg_first @ W_h + dh_carry, where dg_first is dgh (or dgx) at the
        direction's first step; the caller runs that last GEMM."""
        T, N, GH = dy.shape[0], dy.shape[1], w_h.shape[0]
        # At T=1 the loop never multiplies by W_h (its one step takes dh_rec0), so nothing
        # is packed, and the pointwise work alone decides the build; at T > 1 the product
        # dh_rec = dg @ W_h, as in the forward loop.
        if T == 1:
            serial = N * GH <= SERIAL_POINTWISE
        else:
            serial = self._serial_loop((T - 1) * N, GH * w_h.shape[1])
        kernel = pick(self._backward, self._backward_serial, serial)
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
        share = _workshare(T, blocks, serial)
        with LAUNCH_LOCK:
            kernel(dy, d, wpack_rows, hs, cs, saved, dgx, dgh, dh_rec0, dh_carry, dc_carry,
                   scratch.tiles, lengths, scalar(clip_lo), scalar(clip_hi), clip_flags, dg16,
                   wpairs_rows, *share)


_layers: dict = {}
_lock = threading.Lock()


def _bits_or_values(w):
    """A weight for the pair packers: bfloat16 as its bits (uint16), float32 as it is."""
    return w.view(np.uint16) if w.dtype.name == "bfloat16" else w


def own_gemm(dtype):
    """Whether the micro-kernel beats numpy's BLAS at a large product in `dtype`: float32,
    and float64 where the tiles are 512 bits wide (FusedLayer.projects_input says why)."""
    return np.dtype(dtype) == np.float32 or VECTOR_BITS == 512


def fused_layer(mode, dtype, bf16=False, widens=False):
    """The FusedLayer for (mode, dtype, bf16), built once per process (compiled code is
    cached on disk by Numba). bf16 needs AVX512-BF16 (lowlevel.HAS_BF16). widens (float32
    only): the form that reads layer 0's float16 / bfloat16 data in place."""
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
