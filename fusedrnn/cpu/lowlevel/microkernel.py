"""A register-tiled GEMM micro-kernel against pre-packed weights, for the fused CPU steps.

Why not numpy's BLAS per step: for (N, K) @ (K, G*H) with N small OpenBLAS re-packs the
whole weight matrix every call; we pack it once into 16-column panels (packing.py).
Measured: bench/results/cpu-kernel-notes.md#microkernel-why-not-blas-per-step

Numba's own loops vectorise the K reduction and spill, so the kernel is LLVM IR (a Numba
intrinsic): a tile of vector accumulators, one broadcast of A per row, `llvm.fmuladd`.

Vectors are 512 bits wide where the CPU has AVX-512F (VECTOR_BITS), else 256. A tile
covers several panels where the registers allow (panels_per_tile), so that one broadcast
of A feeds several FMAs and enough sums cover the FMA's latency (measured on a Zen 5
only). At 256 bits float64's 3 x 4 ymm tile keeps one accumulator on the stack (spill-free
tiles did not make the op faster). A result's last bits depend on the tile's shape
(k_split), never on the thread count.
Measured: bench/results/cpu-kernel-notes.md#microkernel-vector-width-and-tile-heights,
bench/results/cpu-kernel-notes.md#microkernel-tiles-of-several-panels

Each tile is its own `noinline` function per LLVM module, so its k-loop has the general
registers to itself (inlined, it reloaded row addresses from the stack; test_microkernel).
Measured: bench/results/cpu-kernel-notes.md#microkernel-the-tile-as-a-noinline-function

panel_gemm(a, lda, rows, panel, pstride, npanels, c, ldc, k, like)  (Numba intrinsic)
    a        address of A[0, 0]; A is (rows, k), row stride lda elements, unit column stride
    panel    address of the first packed panel: (k, PANEL) contiguous, 16 columns of B
    pstride  elements from one panel to the next (unread where npanels is 1)
    npanels  a compile-time constant (literal, global or closure int): its tiles are emitted
    c        address of C[0, 0]; C (rows, npanels * PANEL), row stride ldc, overwritten
             with A @ [panel_0 .. panel_{npanels-1}]
    like     any scalar of the data's dtype (float32 or float64): picks the precision
    All three are of that dtype; C must not overlap A or the panels.

panel_gemm_cols(a, lda, rows, panel, pstride, npanels, c, ldc, k, like)
    panel_gemm reading A[r, kk] at a[kk * lda + r] (dG^T as dG is stored; batched.py).
panel_gemm_free(a, lda, rows, b, ldb, npanels, c, ldc, k, like), panel_gemm_free_cols(...)
    panel_gemm with B (k, npanels * 16) in place (row stride ldb); _cols reads A as above.

panel_gemm_t(a, lda, rows, panel, pstride, npanels, c, ldc, k, like)  (inline Numba function)
    The same product stored transposed, over any number of panels (T_PANELS at a time):
    C (npanels * PANEL, rows), row stride ldc >= rows, element (r, j) at c[j * ldc + r].
    For forward_single's T=1 step: A is raw weight rows, the panels the samples; no overlap.

row_dots(a, lda, rows, x, ldx, n, c, ldc, k, like)  (Numba intrinsic)
    The same C^T for few samples, from their rows as they are: C^T[j, r] = A[r, :k] . X[j, :k]
    at c[j * ldc + r], X (n, k) row stride ldx (run-time n). A panel's 16 columns cost the
    same for one sample as for 16; a dot costs per sample (fused.DOT_SAMPLES: which wins).
    Addresses and dtypes as panel_gemm_t's; C must not overlap A or X.
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

__all__ = ["DOT_GROUP", "MAX_ROWS", "PANEL", "ROWS", "VECTOR_BITS", "dot_rows", "panel_gemm",
           "panel_gemm_cols", "panel_gemm_for", "panel_gemm_free", "panel_gemm_free_cols",
           "panel_gemm_t", "panels_per_tile", "row_dots", "rows_for",
           "tile_height", "tile_settings"]

PANEL = 16                                        # columns per packed panel


def _target_vector_bits():
    """512 where Numba's JIT target has AVX-512F (NUMBA_CPU_FEATURES, else the host's as
    Numba reports them, which NUMBA_ENABLE_AVX=0 strips of AVX), else 256."""
    features = nb.config.CPU_FEATURES
    if features is None:
        features = numba_codegen.get_host_cpu_features()
    return 512 if "+avx512f" in features.split(",") else 256


def rows_for(vector_bits):
    """Rows per one-panel tile, per dtype at a vector width (float64 at 256 bits: a panel
    is four registers a row, and three rows spilled an accumulator of the sixteen).
    Measured: bench/results/cpu-kernel-notes.md#microkernel-float64-on-256-bit-tiles-zen-3"""
    return {np.dtype(np.float32): 6, np.dtype(np.float64): 6 if vector_bits == 512 else 2}


# Read when a tile is compiled, and in jitcache.py's stamp: an override shares no code.
VECTOR_BITS = _target_vector_bits()
ROWS = rows_for(VECTOR_BITS)


def tile_settings():
    """(VECTOR_BITS, ROWS as sorted pairs), read now: jitcache.py's stamp."""
    return VECTOR_BITS, tuple(sorted((str(dtype), mr) for dtype, mr in ROWS.items()))


# Accumulator vectors a tile may hold (the panel vectors and a broadcast take the rest of
# the registers), and the tallest tile: past 8 rows' addresses the k-loop spilled.
# Measured: bench/results/cpu-kernel-notes.md#microkernel-tiles-of-several-panels
ACCUMULATORS = {512: 24, 256: 12}
MAX_ROWS = 8


def _vectors_per_panel(itemsize):
    return PANEL * itemsize * 8 // VECTOR_BITS


def panels_per_tile(dtype):
    """How many panels a tile covers at once: the most (up to 4, an LSTM block's gates)
    that still leave at least 4 rows of accumulators."""
    vectors = _vectors_per_panel(np.dtype(dtype).itemsize)
    for group in (4, 3, 2):
        if ACCUMULATORS[VECTOR_BITS] // (group * vectors) >= 4:
            return group
    return 1


def tile_height(dtype, group):
    """Rows per tile of `group` panels: ROWS for one, else up to MAX_ROWS as ACCUMULATORS allow."""
    dtype = np.dtype(dtype)
    if group == 1:
        return ROWS[dtype]
    vectors = _vectors_per_panel(dtype.itemsize)
    return min(MAX_ROWS, ACCUMULATORS[VECTOR_BITS] // (group * vectors))


def k_split(rows, group, vectors):
    """Partial sums per accumulator (over k mod split, added at the end): a one-panel tile
    of few rows keeps at least 8 chains, at most 4 an accumulator, to cover the FMA's
    latency. Several-panel tiles are bound by their panel loads: no split."""
    if group > 1:
        return 1
    return max(1, min(4, -(-8 // (rows * vectors))))


def _groups(npanels, most):
    """npanels split into balanced groups of at most `most` (4 by 3: 2 + 2, not 3 + 1)."""
    count = -(-npanels // most)
    return [npanels // count + (i < npanels % count) for i in range(count)]


def _emit_tile(builder, a, lda, panel, pstride, c, ldc, k, *, rows, group, transposed,
               single, a_by_columns=False, b_in_place=False):
    """The tile's body: C[rows, group*16] = A[rows, k] @ [panel_0 .. panel_{group-1}], into
    `builder`'s function; the seven arguments are intp addresses and element counts.
    a_by_columns: A[r, k] at a[k * lda + r]; b_in_place: the panels are B's own columns,
    row k of panel j at panel[k * pstride + j * 16] (pstride: B's row stride)."""
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
            row = builder.gep(b_ptr, [
                builder.add(builder.mul(kk, pstride), const(j * PANEL)) if b_in_place else
                builder.add(builder.mul(kk, const(PANEL)), builder.mul(const(j), pstride))])
            b += [builder.load(builder.bitcast(builder.gep(row, [const(v * lanes)]),
                                               vec.as_pointer()), align=1)
                  for v in range(vectors)]
        for r in range(rows):
            a_rk = builder.load(builder.gep(a_ptr, [
                builder.add(builder.mul(kk, lda), const(r)) if a_by_columns else
                builder.add(builder.mul(const(r), lda), kk)]))
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
                       itemsize, transposed, tile, a_by_columns=False, bias=None,
                       b_in_place=False):
    """The whole product (this file's and bf16.py's): panels in balanced groups, rows in
    balanced tiles (20 rows: 4 x 5, not 6+6+6+2 with a thin tail), each a call of
    tile(height, group); `itemsize`: bytes of A's, the panels' and C's elements;
    `a_by_columns`: A stored transposed; `bias` (address, element stride between the
    panels' bias rows): each tile also gets its group's first bias row and the stride;
    `b_in_place`: the panels are B's columns (_emit_tile), pstride B's row stride."""
    intp = a.type
    const = functools.partial(ir.Constant, intp)
    fn = builder.function
    first = 0
    for group in _groups(npanels, panels_per_tile(dtype)):
        most = tile_height(dtype, group)
        tiles = builder.udiv(builder.add(rows, const(most - 1)), const(most))
        done = cgutils.alloca_once_value(builder, const(0))
        group_panel = builder.add(panel, builder.mul(
            const(first * PANEL) if b_in_place else builder.mul(const(first), pstride),
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
               single, itemsize, a_by_columns=False, b_in_place=False):
    """emit_tiled_product over this file's float tiles (_emit_tile)."""
    form = _form(transposed, a_by_columns, b_in_place)

    def tile(h, group):
        return _function(builder.module,
                         f"fusedrnn_tile{h}x{group}{form}_{'f32' if single else 'f64'}_"
                         f"{VECTOR_BITS}", a.type, 7,
                         functools.partial(_emit_tile, rows=h, group=group,
                                           transposed=transposed, single=single,
                                           a_by_columns=a_by_columns, b_in_place=b_in_place))
    emit_tiled_product(builder, a, lda, rows, panel, pstride, c, ldc, k, npanels=npanels,
                       dtype=np.float32 if single else np.float64, itemsize=itemsize,
                       transposed=transposed, tile=tile, a_by_columns=a_by_columns,
                       b_in_place=b_in_place)


def _form(transposed, a_by_columns, b_in_place):
    """A product form's letters in its functions' names (one module may hold several)."""
    return "t" * transposed + "c" * a_by_columns + "i" * b_in_place


def panel_count(name, integers, npanels):
    """The panel-GEMM intrinsics' typing: npanels (a literal >= 1) as an int, or None."""
    if not all(isinstance(arg, types.Integer) for arg in integers):
        return None
    if not isinstance(npanels, types.IntegerLiteral):
        return None
    count = npanels.literal_value
    if count < 1:
        raise ValueError(f"{name}: npanels must be >= 1, got {count}")
    return count


def _gemm_intrinsic(transposed, a_by_columns=False, b_in_place=False):
    """The micro-kernel as a Numba intrinsic (panel_gemm and its forms: module docstring)."""

    @intrinsic
    def gemm(typingctx, a, lda, rows, panel, pstride, npanels, c, ldc, k, like):
        count = panel_count(f"panel_gemm{_form(transposed, a_by_columns, b_in_place)}",
                            (a, lda, rows, panel, pstride, c, ldc, k), npanels)
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
            # its own function, never inlined (nor its tiles: module docstring)
            name = (f"fusedrnn_gemm{count}{_form(transposed, a_by_columns, b_in_place)}_"
                    f"{'f32' if single else 'f64'}_{VECTOR_BITS}_"
                    f"{'_'.join(map(str, heights))}")
            fn = _function(builder.module, name, intp, 8, functools.partial(
                _emit_gemm, npanels=count, transposed=transposed, single=single,
                itemsize=itemsize, a_by_columns=a_by_columns, b_in_place=b_in_place))
            builder.call(fn, ints)
            return context.get_dummy_value()

        return types.void(a, lda, rows, panel, pstride, npanels, c, ldc, k, like), codegen

    return gemm


# Module globals, not closure variables: Numba's disk cache keys on a closure's pickled
# cells, and a pickled intrinsic differs in every process (a new cache file each).
panel_gemm = _gemm_intrinsic(False)
_panel_gemm_t = _gemm_intrinsic(True)
# A by columns, and B read in place (no packing) with A by rows or by columns: batched.py
panel_gemm_cols = _gemm_intrinsic(False, a_by_columns=True)
panel_gemm_free = _gemm_intrinsic(False, b_in_place=True)
panel_gemm_free_cols = _gemm_intrinsic(False, a_by_columns=True, b_in_place=True)


@intrinsic
def _itemsize(typingctx, like):
    """sizeof(like) as an intp constant (4 or 8)."""
    if like not in (types.float32, types.float64):
        return None
    size = 4 if like == types.float32 else 8
    return types.intp(like), lambda context, builder, sig, args: context.get_constant(
        types.intp, size)


# The transposed product (A: 16 raw weight rows) takes its panels two at a time, faster
# than one at a time or all four at once.
# Measured: bench/results/cpu-kernel-notes.md#microkernel-the-transposed-tile-in-pairs
T_PANELS = 2


@nb.njit(inline="always")
def panel_gemm_t(a, lda, rows, panel, pstride, npanels, c, ldc, k, like):
    """panel_gemm storing C^T over `npanels` panels, any count (module docstring)."""
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
    """panel_gemm over one panel bound to `dtype`: a 7-argument form."""
    zero = np.dtype(dtype).type(0)

    @nb.njit(inline="always")
    def bound(a, lda, rows, panel, c, ldc, k):
        panel_gemm(a, lda, rows, panel, 0, 1, c, ldc, k, zero)
    return bound


# A dot tile: up to DOT_GROUP samples, and as many rows as leave their accumulators (one
# vector of partial sums each) two thirds of ACCUMULATORS (the group's x vectors and one
# weight vector take the rest); each load of a weight row's vector then feeds every
# sample of the group, each of x's every row. Its rows' and samples' addresses together
# stay within the tallest panel tile's and one more (a tile of eight rows and two samples
# reloaded an address from the stack in its k-loop; test_microkernel).
DOT_GROUP = 4


def dot_rows(samples):
    """Rows of a dot tile of `samples` samples."""
    return min(MAX_ROWS + 1 - samples, ACCUMULATORS[VECTOR_BITS] * 2 // 3 // samples)


def _emit_dot_tile(builder, a, lda, x, ldx, c, ldc, k, *, rows, samples, single):
    """c[j * ldc + r] = A[r, :k] . X[j, :k] for r < rows, j < samples: lanes of partial
    sums over whole vectors of k, halved across lanes, then the k % lanes left in scalar
    FMAs (few registers live there). The order of the sums is fixed by k and the width."""
    intp = a.type
    lanes = VECTOR_BITS // (32 if single else 64)
    scalar = ir.FloatType() if single else ir.DoubleType()
    vec = ir.VectorType(scalar, lanes)
    suffix = "f32" if single else "f64"
    vfma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3),
                                          f"llvm.fmuladd.v{lanes}{suffix}")
    sfma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(scalar, [scalar] * 3),
                                          f"llvm.fmuladd.{suffix}")
    const = functools.partial(ir.Constant, intp)
    a_ptr, x_ptr, c_ptr = (builder.inttoptr(p, scalar.as_pointer()) for p in (a, x, c))
    pairs = [(r, j) for r in range(rows) for j in range(samples)]
    acc = {rj: cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for rj in pairs}
    total = {rj: cgutils.alloca_once(builder, scalar) for rj in pairs}

    def at(ptr, stride, i, kk):
        return builder.gep(ptr, [builder.add(builder.mul(const(i), stride), kk)])

    def load_vec(ptr):
        return builder.load(builder.bitcast(ptr, vec.as_pointer()), align=1)

    whole = builder.udiv(k, const(lanes))
    with cgutils.for_range(builder, whole) as loop:
        kk = builder.mul(loop.index, const(lanes))
        xv = [load_vec(at(x_ptr, ldx, j, kk)) for j in range(samples)]
        for r in range(rows):
            w = load_vec(at(a_ptr, lda, r, kk))
            for j in range(samples):
                builder.store(builder.call(vfma, [w, xv[j], builder.load(acc[r, j])]),
                              acc[r, j])
    i32 = ir.IntType(32)
    for r, j in pairs:   # each vector's halves added, lanes -> 1, before the tail's FMAs
        value, width = builder.load(acc[r, j]), lanes
        while width > 1:
            width //= 2
            value = builder.fadd(
                builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(i32, width),
                                                                 list(range(width)))),
                builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(i32, width),
                                                                 list(range(width, 2 * width)))))
        builder.store(builder.extract_element(value, ir.Constant(i32, 0)), total[r, j])
    done = builder.mul(whole, const(lanes))
    with cgutils.for_range(builder, builder.sub(k, done)) as loop:
        kk = builder.add(done, loop.index)
        xs = [builder.load(at(x_ptr, ldx, j, kk)) for j in range(samples)]
        for r in range(rows):
            w = builder.load(at(a_ptr, lda, r, kk))
            for j in range(samples):
                builder.store(builder.call(sfma, [w, xs[j], builder.load(total[r, j])]),
                              total[r, j])
    for r, j in pairs:
        builder.store(builder.load(total[r, j]), at(c_ptr, ldc, j, const(r)))


def _emit_dots(builder, a, lda, rows, x, ldx, n, c, ldc, k, *, single, itemsize):
    """row_dots' body: the samples in groups of DOT_GROUP (the last one smaller), each
    group's rows in tiles of dot_rows(group), then one row at a time: two tiles a group,
    not one per height, keep the single-step kernels' compile short.
    Measured: bench/results/cpu-kernel-notes.md#fusedlayer-the-single-step-by-rows"""
    intp = a.type
    const = functools.partial(ir.Constant, intp)
    fn = builder.function
    name = f"{'f32' if single else 'f64'}_{VECTOR_BITS}"
    first = cgutils.alloca_once_value(builder, const(0))
    groups = builder.udiv(builder.add(n, const(DOT_GROUP - 1)), const(DOT_GROUP))
    with cgutils.for_range(builder, groups):
        j = builder.load(first)
        left = builder.sub(n, j)
        x_j = builder.add(x, builder.mul(builder.mul(j, ldx), const(itemsize)))
        c_j = builder.add(c, builder.mul(builder.mul(j, ldc), const(itemsize)))
        group_done = fn.append_basic_block()
        by_size = builder.switch(builder.select(builder.icmp_unsigned(">", left,
                                                                      const(DOT_GROUP)),
                                                const(DOT_GROUP), left), group_done)
        for samples in range(1, DOT_GROUP + 1):
            case = fn.append_basic_block()
            by_size.add_case(const(samples), case)
            builder.position_at_end(case)
            most = dot_rows(samples)
            done = cgutils.alloca_once_value(builder, const(0))
            for h, count in ((most, builder.udiv(rows, const(most))),
                             (1, builder.urem(rows, const(most)))):
                tile = _function(builder.module, f"fusedrnn_dot{h}x{samples}_{name}", intp, 7,
                                 functools.partial(_emit_dot_tile, rows=h, samples=samples,
                                                   single=single))
                with cgutils.for_range(builder, count):
                    r = builder.load(done)
                    builder.call(tile, [builder.add(a, builder.mul(builder.mul(r, lda),
                                                                   const(itemsize))),
                                        lda, x_j, ldx, builder.add(c_j, builder.mul(
                                            r, const(itemsize))), ldc, k])
                    builder.store(builder.add(r, const(h)), done)
            builder.store(builder.add(j, const(samples)), first)
            builder.branch(group_done)
        builder.position_at_end(group_done)


@intrinsic
def row_dots(typingctx, a, lda, rows, x, ldx, n, c, ldc, k, like):
    """C^T of few samples by dots along k (module docstring)."""
    if not all(isinstance(arg, types.Integer) for arg in (a, lda, rows, x, ldx, n, c, ldc, k)):
        return None
    if like not in (types.float32, types.float64):
        return None
    single = like == types.float32

    def codegen(context, builder, signature, args):
        ints = [context.cast(builder, args[i], signature.args[i], types.intp) for i in range(9)]
        name = f"fusedrnn_dots_{'f32' if single else 'f64'}_{VECTOR_BITS}"
        fn = _function(builder.module, name, ints[0].type, 9, functools.partial(
            _emit_dots, single=single, itemsize=4 if single else 8))
        builder.call(fn, ints)
        return context.get_dummy_value()

    return types.void(a, lda, rows, x, ldx, n, c, ldc, k, like), codegen
