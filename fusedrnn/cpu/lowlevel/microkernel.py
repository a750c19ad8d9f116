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
At 512 bits float32 runs 6 rows x 1 zmm (LLVM folds the broadcast into the FMA as an
embedded {1to16} operand) and float64 6 rows x 2 zmm; at 256 bits (AVX2, 16 registers)
float32 runs 6 rows x 2 ymm (12 accumulators, 2 panel vectors and a broadcast fit) and
float64 3 rows x 4 ymm, which needs 17, so LLVM keeps one accumulator on the stack: the
spill-free float64 tiles tried did not make the op faster. At 512 bits float64 also takes
this kernel for its input projection (FusedLayer.projects_input). Results are bitwise
equal at either width (the same FMAs in the same order per element). Only Zen 4 was
measured with AVX-512; on Intel's AVX-512 parts the rule is untested.
Measured: bench/results/cpu-kernel-notes.md#microkernel-vector-width-and-tile-heights

Each tile is emitted once per LLVM module as its own `noinline` function, called from
the kernels that use it, so that its k-loop has the 16 general registers to itself:
inlined, it shared them with the enclosing kernel's live values and LLVM reloaded row
addresses from the stack inside it. As a function it needs 9 and reloads none
(tests/cpu/lowlevel/test_microkernel.py checks the asm). A call costs a few cycles
against a k-loop of K iterations.
Measured: bench/results/cpu-kernel-notes.md#microkernel-the-tile-as-a-noinline-function

panel_gemm(a, lda, rows, panel, c, ldc, k, like)  (inline Numba function)
    a      address of A[0, 0]; A is (rows, k), row stride lda elements, unit column stride
    panel  address of one packed panel: (k, PANEL) contiguous, 16 columns of B
    c      address of C[0, 0]; C (rows, PANEL) with row stride ldc; overwritten with A @ B
    like   any scalar of the data's dtype (float32 or float64): picks the precision
    All three are of that dtype; C must not overlap A or the panel.

panel_gemm_t(a, lda, rows, panel, c, ldc, k, like)  (inline Numba function)
    The same product, stored transposed: C (PANEL, rows) with row stride ldc >= rows gets
    (A @ panel)^T, element (r, j) at c[j * ldc + r]. For a T=1 step (fused.py's
    forward_single): A is raw weight rows, read in place, and the panel 16 samples of
    the input as columns.

The kernels of ../fused.py and gemm.py inline this file's code; ../jitcache.py makes an
edit here retire their disk-cached machine code.
"""
from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core import codegen as numba_codegen
from numba.extending import intrinsic, overload

__all__ = ["PANEL", "ROWS", "VECTOR_BITS", "rows_for", "tile_settings", "panel_gemm",
           "panel_gemm_t", "panel_gemm_for"]

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


def _emit_tile(builder, a, lda, panel, c, ldc, k, *, rows, transposed, single):
    """The tile's body (see _tile_intrinsic), into `builder`'s function; all six
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

    def c_vector(r, v):
        at = builder.add(builder.mul(ir.Constant(intp, r), ldc), ir.Constant(intp, v * lanes))
        return builder.bitcast(builder.gep(c_ptr, [at]), vec.as_pointer())

    # Allocas in the entry block: LLVM promotes them to registers (mem2reg).
    acc = [[cgutils.alloca_once_value(builder, ir.Constant(vec, None))
            for _ in range(vectors)] for _ in range(rows)]
    splat = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    undef = ir.Constant(vec, ir.Undefined)
    with cgutils.for_range(builder, k) as loop:
        kk = loop.index
        row = builder.gep(b_ptr, [builder.mul(kk, ir.Constant(intp, PANEL))])
        b = [builder.load(builder.bitcast(
            builder.gep(row, [ir.Constant(intp, v * lanes)]), vec.as_pointer()), align=1)
            for v in range(vectors)]
        for r in range(rows):
            a_rk = builder.load(builder.gep(
                a_ptr, [builder.add(builder.mul(ir.Constant(intp, r), lda), kk)]))
            a_vec = builder.shuffle_vector(
                builder.insert_element(undef, a_rk, ir.Constant(ir.IntType(32), 0)),
                undef, splat)
            for v in range(vectors):
                builder.store(builder.call(fma, [a_vec, b[v], builder.load(acc[r][v])]),
                              acc[r][v])
    for r in range(rows):
        for v in range(vectors):
            if transposed:   # one scalar store per lane: 16*rows per tile, cheap
                value = builder.load(acc[r][v])
                for lane in range(lanes):
                    at = builder.add(builder.mul(ir.Constant(intp, v * lanes + lane), ldc),
                                     ir.Constant(intp, r))
                    builder.store(builder.extract_element(
                        value, ir.Constant(ir.IntType(32), lane)), builder.gep(c_ptr, [at]))
                continue
            builder.store(builder.load(acc[r][v]), c_vector(r, v), align=1)


def _tile_intrinsic(rows, transposed):
    """C[rows, PANEL] = A[rows, k] @ panel[k, PANEL], accumulators in registers; the
    precision is that of the last argument (any scalar of the data's dtype). With
    `transposed`, C^T is stored: element (r, j) goes to c[j * ldc + r]."""

    @intrinsic
    def tile(typingctx, a, lda, panel, c, ldc, k, like):
        for arg in (a, lda, panel, c, ldc, k):
            if not isinstance(arg, types.Integer):
                return None
        if like not in (types.float32, types.float64):
            return None
        single = like == types.float32

        def codegen(context, builder, signature, args):
            ints = [context.cast(builder, v, t, types.intp)
                    for v, t in zip(args[:6], signature.args[:6])]
            intp = ints[0].type
            # Its own function, never inlined, so that its k-loop has the general
            # registers to itself (module docstring: the stack reloads it had inlined).
            name = (f"fusedrnn_tile{rows}{'t' if transposed else ''}_"
                    f"{'f32' if single else 'f64'}_{VECTOR_BITS}")
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [intp] * 6), name)
            if fn.is_declaration:
                fn.linkage = "internal"
                fn.attributes.add("noinline")
                fn.attributes.add("nounwind")
                body = ir.IRBuilder(fn.append_basic_block("entry"))
                _emit_tile(body, *fn.args, rows=rows, transposed=transposed, single=single)
                body.ret_void()
            builder.call(fn, ints)
            return context.get_dummy_value()

        return types.void(a, lda, panel, c, ldc, k, like), codegen

    return tile


# Module globals, not closure variables: Numba's disk cache keys on a closure's pickled
# cells, and a pickled intrinsic or dispatcher differs in every process (a cache miss
# and a new cache file per process).
_tile1, _tile2, _tile3, _tile4, _tile5, _tile6 = (_tile_intrinsic(r, False) for r in range(1, 7))
_tileT1, _tileT2, _tileT3, _tileT4, _tileT5, _tileT6 = (_tile_intrinsic(r, True)
                                                        for r in range(1, 7))


def _tile_params(like):
    """(rows per register tile, element size in bytes) for like's dtype: each from the
    dtype itself, neither from the other."""
    dtype = np.dtype(type(like))
    return ROWS[dtype], dtype.itemsize


@overload(_tile_params)
def _tile_params_overload(like):
    dtype = np.dtype(np.float32 if like == types.float32 else np.float64)
    rows, size = ROWS[dtype], dtype.itemsize
    if not 1 <= rows <= 6:   # the tiles below exist for 1..6 rows; a taller one would be cut
        raise ValueError(f"microkernel.ROWS: tile heights 1..6 exist, got {rows}")
    return lambda like: (rows, size)


@nb.njit(inline="always")
def panel_gemm(a, lda, rows, panel, c, ldc, k, like):
    """The micro-kernel over `rows` rows (module docstring); `like`: a scalar of the data's
    dtype, which picks the precision."""
    mr, itemsize = _tile_params(like)
    # Balanced tiles (20 rows: 4 x 5, not 6+6+6+2): a thin tail tile does a third of the
    # FMAs per panel load of a full one.
    tiles = (rows + mr - 1) // mr
    r = 0
    for i in range(tiles):
        height = (rows - r) // (tiles - i)
        a_r, c_r = a + r * lda * itemsize, c + r * ldc * itemsize
        if height == 1:
            _tile1(a_r, lda, panel, c_r, ldc, k, like)
        elif height == 2:
            _tile2(a_r, lda, panel, c_r, ldc, k, like)
        elif height == 3:
            _tile3(a_r, lda, panel, c_r, ldc, k, like)
        elif height == 4:
            _tile4(a_r, lda, panel, c_r, ldc, k, like)
        elif height == 5:
            _tile5(a_r, lda, panel, c_r, ldc, k, like)
        else:
            _tile6(a_r, lda, panel, c_r, ldc, k, like)
        r += height


@nb.njit(inline="always")
def panel_gemm_t(a, lda, rows, panel, c, ldc, k, like):
    """panel_gemm storing C^T: C (PANEL, rows) with row stride ldc gets (A @ panel)^T.
    Used with A = raw weight rows and panel = 16 samples of the input packed as columns,
    so a weight matrix used once per call (a T=1 step) is read in place, never packed."""
    mr, itemsize = _tile_params(like)
    tiles = (rows + mr - 1) // mr
    r = 0
    for i in range(tiles):
        height = (rows - r) // (tiles - i)
        a_r, c_r = a + r * lda * itemsize, c + r * itemsize
        if height == 1:
            _tileT1(a_r, lda, panel, c_r, ldc, k, like)
        elif height == 2:
            _tileT2(a_r, lda, panel, c_r, ldc, k, like)
        elif height == 3:
            _tileT3(a_r, lda, panel, c_r, ldc, k, like)
        elif height == 4:
            _tileT4(a_r, lda, panel, c_r, ldc, k, like)
        elif height == 5:
            _tileT5(a_r, lda, panel, c_r, ldc, k, like)
        else:
            _tileT6(a_r, lda, panel, c_r, ldc, k, like)
        r += height


def panel_gemm_for(dtype):
    """panel_gemm bound to `dtype`, for callers that prefer the 7-argument form."""
    zero = np.dtype(dtype).type(0)

    @nb.njit(inline="always")
    def bound(a, lda, rows, panel, c, ldc, k):
        panel_gemm(a, lda, rows, panel, c, ldc, k, zero)
    return bound
