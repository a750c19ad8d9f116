"""A register-tiled GEMM micro-kernel against pre-packed weights, for the fused CPU steps.

Why not numpy's BLAS per step: the recurrent product is (N, K) @ (K, G*H) with N small,
and OpenBLAS re-packs the whole weight matrix on every call, running at a quarter of its
large-matrix rate. The weights do not change during a call, so we pack them once into
16-column panels (packing.py) and run this kernel over them. In float64 numpy's dgemm is
as fast or faster at these shapes; the fused loop still wins there by keeping W_h h in
a cache-resident tile and skipping a second parallel region.
Measured: bench/results/cpu-kernel-notes.md#microkernel-why-not-blas-per-step

Numba cannot keep a tile of accumulators in vector registers on its own (its loop
vectoriser vectorises the K reduction instead and spills), so the kernel is emitted
as LLVM IR through a Numba intrinsic: MR x (16 / lanes) vector accumulators, one
broadcast of A per row, `llvm.fmuladd` (an FMA where the CPU has one).

The vectors are 512 bits wide where the CPU has AVX-512F (VECTOR_BITS), else 256.
A tile covers several panels at once where the registers allow (panels_per_tile,
tile_height): at 512 bits float32 up to 4 panels (an LSTM block's gates) x 6 rows, or 3
x 8, 2 x 8; float64 up to 3 panels (2 zmm each) x 4 rows. One broadcast of A then feeds
several FMAs, and 12-24 independent sums cover the FMA's latency: a Zen 5 core issues
two 512-bit FMAs a cycle at a latency of 4, so the one-panel 6 x 1 zmm tile (6 sums)
could reach 3/4 of its peak at most, and measured 180-200 GFLOP/s a core against 250-280
for 6 x 2, 8 x 2 or 6 x 4. A single panel (the backward's dh, a GRU's third gate in
float64) keeps ROWS rows: float32 6 x 1 zmm (LLVM folds the broadcast into the FMA as an
embedded {1to16} operand), float64 6 x 2 zmm; at 256 bits (AVX2, 16 registers) tiles
stay one panel: float32 6 rows x 2 ymm, float64 3 rows x 4 ymm, which needs 17, so LLVM
keeps one accumulator on the stack: the spill-free float64 tiles tried did not make the
op faster. At 512 bits float64 also takes this kernel for its input projection
(FusedLayer.projects_input). A one-panel tile of few rows keeps 2-4 partial sums per
accumulator over alternate k (k_split: 1 row 40 -> 75-86 GFLOP/s a core, 6 rows 201 ->
220), so the order of its additions, and the last bits of a result, depend on the
tile's height and width, never on the thread count. The several-panel tiles were measured on a
Zen 5 only; on a Zen 4 (512-bit FMAs as two halves, one a cycle) they do no more FMAs
per load than the tile they replace, and are untested for speed; on Intel's AVX-512
parts the rule is untested.
Measured: bench/results/cpu-kernel-notes.md#microkernel-vector-width-and-tile-heights
and #microkernel-tiles-of-several-panels

Each tile is emitted once per LLVM module as its own `noinline` function, called from
the kernels that use it, so that its k-loop has the 16 general registers to itself:
inlined, it shared them with the enclosing kernel's live values and LLVM reloaded row
addresses from the stack inside it. As a function it needs 9 and reloads none
(tests/cpu/lowlevel/test_microkernel.py checks the asm). A call costs a few cycles
against a k-loop of K iterations.
Measured: bench/results/cpu-kernel-notes.md#microkernel-the-tile-as-a-noinline-function

panel_gemm(a, lda, rows, panel, pstride, npanels, c, ldc, k, like)  (Numba intrinsic)
    a        address of A[0, 0]; A is (rows, k), row stride lda elements, unit column stride
    panel    address of the first packed panel: (k, PANEL) contiguous, 16 columns of B
    pstride  elements from one panel to the next (panel j at panel + j * pstride);
             unread where npanels is 1
    npanels  panels to multiply, a compile-time constant (a literal, or a global or
             closure int): the tiles a kernel needs are emitted into its module
    c        address of C[0, 0]; C (rows, npanels * PANEL) with row stride ldc;
             overwritten with A @ [panel_0 .. panel_{npanels-1}]
    like     any scalar of the data's dtype (float32 or float64): picks the precision
    All three are of that dtype; C must not overlap A or the panels.

panel_gemm_t(a, lda, rows, panel, pstride, npanels, c, ldc, k, like)  (inline Numba function)
    The same product stored transposed, over any number of panels (npanels need not be
    a constant: it runs T_PANELS at a time, then one): C (npanels * PANEL, rows) with row
    stride ldc >= rows gets (A @ [panel_0 ..])^T, element (r, j) at c[j * ldc + r]. For
    a T=1 step (fused.py's forward_single): A is raw weight rows, read in place, and the
    panels 16 samples each of the input as columns. Same aliasing rule.

The kernels of ../fused.py and gemm.py inline this file's code; ../jitcache.py makes an
edit here retire their disk-cached machine code.
"""
from __future__ import annotations

import functools

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core import codegen as numba_codegen
from numba.extending import intrinsic

__all__ = ["MAX_ROWS", "PANEL", "ROWS", "VECTOR_BITS", "panel_gemm", "panel_gemm_for",
           "panel_gemm_t", "panels_per_tile", "rows_for", "tile_height", "tile_settings"]

PANEL = 16                                        # columns per packed panel


def _target_vector_bits():
    """512 where the CPU Numba compiles for has AVX-512F, else 256: the features Numba's
    JIT target uses (NUMBA_CPU_FEATURES if set, else the host's as Numba reports them,
    which NUMBA_ENABLE_AVX=0 strips of AVX)."""
    features = nb.config.CPU_FEATURES
    if features is None:
        features = numba_codegen.get_host_cpu_features()
    return 512 if "+avx512f" in features.split(",") else 256


def rows_for(vector_bits):
    """MR, rows per register tile, per dtype at a vector width. float64 at 512 bits: 6 x
    2 zmm, 12 accumulators of 32 registers; at 256 bits 6 rows would need 24 of 16.
    Measured: bench/results/cpu-kernel-notes.md#microkernel-vector-width-and-tile-heights"""
    return {np.dtype(np.float32): 6, np.dtype(np.float64): 6 if vector_bits == 512 else 3}


# Vector width of the tile's accumulators and panel loads, and the tile heights. Both are read when a tile is compiled,
# and jitcache.py puts both in the disk cache's stamp, so a process that overrides them
# neither loads nor leaves behind machine code compiled for other values.
VECTOR_BITS = _target_vector_bits()
ROWS = rows_for(VECTOR_BITS)


def tile_settings():
    """(VECTOR_BITS, ROWS as sorted (dtype name, rows) pairs), read now: the settings
    compiled tiles depend on, which a process may override (jitcache.py's stamp)."""
    return VECTOR_BITS, tuple(sorted((str(dtype), mr) for dtype, mr in ROWS.items()))


# Accumulator vectors a tile may hold: 24 of AVX-512's 32 registers (the panel vectors and
# a broadcast take the rest), 12 of AVX2's 16. And the tallest tile: each row keeps an
# address in a general register, and past 8 rows the k-loop ran out of them (a 12 x 2
# float32 tile spilled and ran at 100-115 GFLOP/s against 8 x 2's 270).
ACCUMULATORS = {512: 24, 256: 12}
MAX_ROWS = 8


def _vectors_per_panel(itemsize):
    return PANEL * itemsize * 8 // VECTOR_BITS


def panels_per_tile(dtype):
    """How many panels a tile covers at once: the most (up to 4, an LSTM block's gates)
    that still leave at least 4 rows of accumulators, so that each broadcast of A feeds
    several FMAs and enough independent sums are in flight to cover the FMA's latency."""
    vectors = _vectors_per_panel(np.dtype(dtype).itemsize)
    for group in (4, 3, 2):
        if ACCUMULATORS[VECTOR_BITS] // (group * vectors) >= 4:
            return group
    return 1


def tile_height(dtype, group):
    """Rows per tile when it covers `group` panels: ROWS for one panel, else as many as
    the accumulators allow, at most MAX_ROWS."""
    dtype = np.dtype(dtype)
    if group == 1:
        return ROWS[dtype]
    vectors = _vectors_per_panel(dtype.itemsize)
    return min(MAX_ROWS, ACCUMULATORS[VECTOR_BITS] // (group * vectors))


def k_split(rows, group, vectors):
    """Partial sums per accumulator: a tile of one panel and few rows has too few
    independent sums for the FMA's latency (1 row: 1 chain, 40 GFLOP/s a core), so it
    keeps `split` sums, over k = 0, 1, .. (mod split), added at the end: at least 8
    chains, at most 4 per accumulator. Several-panel tiles of few rows are bound by
    loading their panels instead, and do not split."""
    if group > 1:
        return 1
    return max(1, min(4, -(-8 // (rows * vectors))))


def _groups(npanels, most):
    """npanels split into balanced groups of at most `most` (4 by 3: 2 + 2, not 3 + 1)."""
    count = -(-npanels // most)
    return [npanels // count + (i < npanels % count) for i in range(count)]


def _emit_tile(builder, a, lda, panel, pstride, c, ldc, k, *, rows, group, transposed,
               single):
    """The tile's body: C[rows, group*16] = A[rows, k] @ [panel_0 .. panel_{group-1}]
    (panel j at panel + j*pstride elements), into `builder`'s function; all seven
    arguments are intp values: addresses and element counts."""
    intp = a.type
    lanes = VECTOR_BITS // (32 if single else 64)
    vectors = PANEL // lanes
    scalar = ir.FloatType() if single else ir.DoubleType()
    vec = ir.VectorType(scalar, lanes)
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vec, [vec, vec, vec]),
        f"llvm.fmuladd.v{lanes}{'f32' if single else 'f64'}")
    a_ptr = builder.inttoptr(a, scalar.as_pointer())
    b_ptr = builder.inttoptr(panel, scalar.as_pointer())
    c_ptr = builder.inttoptr(c, scalar.as_pointer())
    const = functools.partial(ir.Constant, intp)
    split = k_split(rows, group, vectors)
    # Allocas in the entry block: LLVM promotes them to registers (mem2reg). With a
    # k-split, acc[r][v][s] sums the k = s (mod split) terms.
    acc = [[[cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(split)]
            for _ in range(group * vectors)] for _ in range(rows)]
    splat = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    undef = ir.Constant(vec, ir.Undefined)

    def step(kk, s):
        """The FMAs of one k into the s-th partial sums."""
        b = []
        for j in range(group):
            row = builder.gep(b_ptr, [builder.add(builder.mul(kk, const(PANEL)),
                                                  builder.mul(const(j), pstride))])
            b += [builder.load(builder.bitcast(builder.gep(row, [const(v * lanes)]),
                                               vec.as_pointer()), align=1)
                  for v in range(vectors)]
        for r in range(rows):
            a_rk = builder.load(builder.gep(a_ptr, [builder.add(builder.mul(const(r), lda),
                                                                kk)]))
            a_vec = builder.shuffle_vector(
                builder.insert_element(undef, a_rk, ir.Constant(ir.IntType(32), 0)),
                undef, splat)
            for v in range(group * vectors):
                builder.store(builder.call(fma, [a_vec, b[v], builder.load(acc[r][v][s])]),
                              acc[r][v][s])

    rounds = builder.udiv(k, const(split))
    with cgutils.for_range(builder, rounds) as loop:
        for s in range(split):
            step(builder.add(builder.mul(loop.index, const(split)), const(s)), s)
    tail = builder.mul(rounds, const(split))       # the k % split left over
    with cgutils.for_range(builder, builder.sub(k, tail)) as loop:
        step(builder.add(tail, loop.index), 0)
    for r in range(rows):
        for v in range(group * vectors):
            total = builder.load(acc[r][v][0])
            for s in range(1, split):
                total = builder.fadd(total, builder.load(acc[r][v][s]))
            builder.store(total, acc[r][v][0])
    for r in range(rows):
        for v in range(group * vectors):
            value = builder.load(acc[r][v][0])
            if transposed:   # one scalar store per lane: 16*rows per tile, cheap
                for lane in range(lanes):
                    at = builder.add(builder.mul(const(v * lanes + lane), ldc), const(r))
                    builder.store(builder.extract_element(
                        value, ir.Constant(ir.IntType(32), lane)), builder.gep(c_ptr, [at]))
                continue
            at = builder.add(builder.mul(const(r), ldc), const(v * lanes))
            builder.store(value, builder.bitcast(builder.gep(c_ptr, [at]), vec.as_pointer()),
                          align=1)


def _function(module, name, intp, nargs, emit):
    """The module's internal, never-inlined function `name`, emitted by emit(builder,
    *args) the first time a kernel of this module asks for it."""
    fn = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), [intp] * nargs),
                                        name)
    if fn.is_declaration:
        fn.linkage = "internal"
        fn.attributes.add("noinline")
        fn.attributes.add("nounwind")
        body = ir.IRBuilder(fn.append_basic_block("entry"))
        emit(body, *fn.args)
        body.ret_void()
    return fn


def emit_tiled_product(builder, a, lda, rows, panel, pstride, c, ldc, k, *, npanels, dtype,
                       itemsize, transposed, tile, a_by_columns=False, bias=None):
    """The whole product over `rows` rows and `npanels` panels: the panels in balanced
    groups (panels_per_tile(dtype)), each group's rows in balanced tiles (20 rows: 4 x 5,
    not 6+6+6+2: a thin tail tile does a fraction of a full one's FMAs per panel load),
    each tile a call of its own function tile(height, group), picked by a switch on its
    height. `itemsize` is the byte size of A's, the panels' and C's elements (bf16.py's
    uint32 pairs too). With `a_by_columns` A is stored transposed (row r of A is column r
    of the array, lda apart per k): a tile's rows start r elements in, not r*lda.
    With `bias` (address, stride: intp values, the stride in elements between the panels'
    16-element bias rows) each tile is called with two more arguments, the bias row of its
    group's first panel and the stride. Shared by this file's kernels and bf16.py's."""
    intp = a.type
    const = functools.partial(ir.Constant, intp)
    fn = builder.function
    first = 0
    for group in _groups(npanels, panels_per_tile(dtype)):
        most = tile_height(dtype, group)
        tiles = builder.udiv(builder.add(rows, const(most - 1)), const(most))
        done = cgutils.alloca_once_value(builder, const(0))
        group_panel = builder.add(panel, builder.mul(builder.mul(const(first), pstride),
                                                     const(itemsize)))
        # The group's first column of C, or with `transposed` its first row of C^T.
        group_c = builder.add(c, builder.mul(const(first * PANEL * itemsize),
                                             ldc if transposed else const(1)))
        extra = []
        if bias is not None:   # the group's first bias row, and the stride
            extra = [builder.add(bias[0], builder.mul(builder.mul(const(first), bias[1]),
                                                      const(itemsize))), bias[1]]
        with cgutils.for_range(builder, tiles) as loop:
            r = builder.load(done)
            height = builder.udiv(builder.sub(rows, r), builder.sub(tiles, loop.index))
            a_r = builder.add(a, builder.mul(r if a_by_columns else builder.mul(r, lda),
                                             const(itemsize)))
            c_r = builder.add(group_c, builder.mul(r, const(itemsize)) if transposed else
                              builder.mul(builder.mul(r, ldc), const(itemsize)))
            after = fn.append_basic_block()
            switch = builder.switch(height, after)
            for h in range(1, most + 1):
                case = fn.append_basic_block()
                switch.add_case(const(h), case)
                with builder.goto_block(case):
                    builder.call(tile(h, group),
                                 [a_r, lda, group_panel, pstride, c_r, ldc, k] + extra)
                    builder.branch(after)
            builder.position_at_end(after)
            builder.store(builder.add(r, height), done)
        first += group


def _emit_gemm(builder, a, lda, rows, panel, pstride, c, ldc, k, *, npanels, transposed,
               single, itemsize):
    """emit_tiled_product over this file's float tiles (_emit_tile)."""
    def tile(h, group):
        return _function(builder.module,
                         f"fusedrnn_tile{h}x{group}{'t' if transposed else ''}_"
                         f"{'f32' if single else 'f64'}_{VECTOR_BITS}", a.type, 7,
                         functools.partial(_emit_tile, rows=h, group=group,
                                           transposed=transposed, single=single))
    emit_tiled_product(builder, a, lda, rows, panel, pstride, c, ldc, k, npanels=npanels,
                       dtype=np.float32 if single else np.float64, itemsize=itemsize,
                       transposed=transposed, tile=tile)


def panel_count(name, integers, npanels):
    """The typing checks the panel-GEMM intrinsics share: every address and size an
    integer, npanels a literal >= 1. Returns the count, or None where the types do not
    fit (for npanels, Numba retries with the literal where there is one)."""
    if not all(isinstance(arg, types.Integer) for arg in integers):
        return None
    if not isinstance(npanels, types.IntegerLiteral):
        return None
    count = npanels.literal_value
    if count < 1:
        raise ValueError(f"{name}: npanels must be >= 1, got {count}")
    return count


def _gemm_intrinsic(transposed):
    """The micro-kernel as a Numba intrinsic (panel_gemm, panel_gemm_t: module docstring).
    `npanels` must be a compile-time constant (a literal, a global or a closure's int):
    the tiles a kernel needs are emitted into its module, and only those."""

    @intrinsic
    def gemm(typingctx, a, lda, rows, panel, pstride, npanels, c, ldc, k, like):
        count = panel_count("panel_gemm", (a, lda, rows, panel, pstride, c, ldc, k), npanels)
        if count is None or like not in (types.float32, types.float64):
            return None
        single = like == types.float32
        dtype = np.dtype(np.float32 if single else np.float64)
        heights = [tile_height(dtype, g) for g in set(_groups(count, panels_per_tile(dtype)))]
        if not all(1 <= h <= MAX_ROWS for h in heights):
            raise ValueError(f"microkernel.ROWS: tile heights 1..{MAX_ROWS} exist, got "
                             f"{ROWS[dtype]}")
        itemsize = dtype.itemsize

        def codegen(context, builder, signature, args):
            ints = [context.cast(builder, args[i], signature.args[i], types.intp)
                    for i in (0, 1, 2, 3, 4, 6, 7, 8)]
            intp = ints[0].type
            # Its own function, never inlined (nor its tiles), so that each tile's k-loop
            # has the general registers to itself (module docstring).
            name = (f"fusedrnn_gemm{count}{'t' if transposed else ''}_"
                    f"{'f32' if single else 'f64'}_{VECTOR_BITS}_"
                    f"{'_'.join(map(str, heights))}")
            fn = _function(builder.module, name, intp, 8, functools.partial(
                _emit_gemm, npanels=count, transposed=transposed, single=single,
                itemsize=itemsize))
            builder.call(fn, ints)
            return context.get_dummy_value()

        return types.void(a, lda, rows, panel, pstride, npanels, c, ldc, k, like), codegen

    return gemm


# Module globals, not closure variables: Numba's disk cache keys on a closure's pickled
# cells, and a pickled intrinsic or dispatcher differs in every process (a cache miss
# and a new cache file per process).
panel_gemm = _gemm_intrinsic(False)
_panel_gemm_t = _gemm_intrinsic(True)


@intrinsic
def _itemsize(typingctx, like):
    """sizeof(like) as an intp constant (4 or 8)."""
    if like not in (types.float32, types.float64):
        return None
    size = 4 if like == types.float32 else 8
    return types.intp(like), lambda context, builder, sig, args: context.get_constant(
        types.intp, size)


# The transposed product takes its panels two at a time: with A = 16 raw weight rows and
# 4 panels of samples (K = 512, float32, one Zen 5 core), 8 x 2 zmm tiles ran at 257
# GFLOP/s against 181 for one panel at a time and 196 for 4 x 6 tiles over all four.
# Measured: bench/results/cpu-kernel-notes.md#microkernel-the-transposed-tile-in-pairs
T_PANELS = 2


@nb.njit(inline="always")
def panel_gemm_t(a, lda, rows, panel, pstride, npanels, c, ldc, k, like):
    """panel_gemm storing C^T over `npanels` panels (any count, at run time): C
    (npanels * PANEL, rows) with row stride ldc gets (A @ [panel_0 ..])^T."""
    size = _itemsize(like)
    done = 0
    while npanels - done >= T_PANELS:
        _panel_gemm_t(a, lda, rows, panel + np.uint64(done * pstride * size), pstride,
                      T_PANELS, c + np.uint64(done * PANEL * ldc * size), ldc, k, like)
        done += T_PANELS
    if done < npanels:
        _panel_gemm_t(a, lda, rows, panel + np.uint64(done * pstride * size), pstride, 1,
                      c + np.uint64(done * PANEL * ldc * size), ldc, k, like)


def panel_gemm_for(dtype):
    """panel_gemm over one panel bound to `dtype`, for callers that prefer the 7-argument
    form."""
    zero = np.dtype(dtype).type(0)

    @nb.njit(inline="always")
    def bound(a, lda, rows, panel, c, ldc, k):
        panel_gemm(a, lda, rows, panel, 0, 1, c, ldc, k, zero)
    return bound
