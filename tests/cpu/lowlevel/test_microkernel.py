"""fusedrnn.cpu.lowlevel.microkernel: the packed-panel GEMM kernel against float64 numpy for every
row count up to two register tiles (and 20, the balanced 4 x 5 split), with a row
stride of A wider than K and a C wider than the panels whose padding columns must stay
untouched, over panels from packing.py's pack_recurrent and pack_recurrent_rows; its
transposed-store form (panel_gemm_t) and its form by rows (row_dots) the same way. Then
what the module docstring claims of the compiled code: the tile heights and the vector
width (VECTOR_BITS, both widths on any CPU) are independent of the element size, and a
tile's k-loop reloads nothing from the stack."""
import functools
import platform
import re
import subprocess
import sys

import numba as nb
import numpy as np
import pytest

import fusedrnn
from fusedrnn.cpu.lowlevel import gemm, pack_input_weights, pack_recurrent, pack_recurrent_rows
from fusedrnn.cpu.lowlevel import microkernel as mk
from fusedrnn.cpu.lowlevel.microkernel import MAX_ROWS, PANEL, ROWS, panel_gemm_for, panel_gemm_t

from conftest import FRESH_COMPILE, fresh_compile, launch_fused

C_PAD = 5    # columns of C past the panels: the kernel must leave them as they are
A_PAD = 3    # A's row stride is K + A_PAD: lda is honoured, not assumed to be K
TOL = {np.float32: 1e-5, np.float64: 1e-12}   # relative to max |A @ W.T|


@functools.cache
def driver(dtype, together=0):
    """C[b, :, g*16:(g+1)*16] = A @ panels[b, g]: panel by panel, or with `together` all G
    (== together) panels of a block in one call, as the fused forward multiplies them."""
    panel_gemm, itemsize = panel_gemm_for(dtype), np.dtype(dtype).itemsize
    zero = np.dtype(dtype).type(0)

    @nb.njit
    def run(a, lda, rows, panels, c):
        K = panels.shape[2]
        for b in range(panels.shape[0]):
            if together:
                mk.panel_gemm(a.ctypes.data, lda, rows, panels[b, 0].ctypes.data, K * PANEL,
                              together, c[b].ctypes.data, c.shape[2], K, zero)
                continue
            for g in range(panels.shape[1]):
                panel_gemm(a.ctypes.data, lda, rows, panels[b, g].ctypes.data,
                           c[b].ctypes.data + g * PANEL * itemsize, c.shape[2], K)
    return run


def product(a, panels, together=False):
    """A @ panels through the kernel, into a NaN-poisoned C (B, rows, G*16 + C_PAD)."""
    rows, K = a.shape
    a_strided = np.full((rows, K + A_PAD), np.nan, a.dtype)
    a_strided[:, :K] = a
    B, G = panels.shape[:2]
    c = np.full((B, rows, G * PANEL + C_PAD), np.nan, a.dtype)
    driver(a.dtype.type, G if together else 0)(a_strided, K + A_PAD, rows, panels, c)
    return c


def panel_rel_err(c, want, G):
    """The computed columns of c against want (B, rows, G*16), relative to max |want|."""
    got = c[:, :, :G * PANEL].astype(np.float64)
    return np.max(np.abs(got - want)) / np.max(np.abs(want))


@pytest.mark.parametrize("H", [1, 15, 16, 17, 40])
@pytest.mark.parametrize("gates", [1, 3, 4])
@pytest.mark.parametrize("K", [1, 7, 64])
# Every height up to two of the tallest tiles + 1 (all tail splits), and 20.
@pytest.mark.parametrize("rows", [*range(1, 2 * MAX_ROWS + 2), 20])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_panel_gemm_with_packed_columns_matches_numpy(dtype, rows, K, gates, H):
    """Each gate's panel by itself."""
    check_packed_columns(dtype, rows, K, gates, H, together=False)


@pytest.mark.parametrize("gates", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("K", [7, 64])
@pytest.mark.parametrize("rows", [*range(1, 2 * MAX_ROWS + 2), 20])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_panel_gemm_over_a_blocks_panels_matches_numpy(dtype, rows, K, gates):
    """All of a block's panels in one call: tiles of several panels, in balanced groups
    where there are more than one tile covers (5 -> 3 + 2 in float32, 8 -> 4 + 4)."""
    check_packed_columns(dtype, rows, K, gates, 17, together=True)


def check_packed_columns(dtype, rows, K, gates, H, together):
    rng = np.random.default_rng([rows, K, gates, H])
    a = rng.standard_normal((rows, K)).astype(dtype)
    w = rng.standard_normal((gates * H, K)).astype(dtype)
    c = product(a, pack_recurrent(w, gates), together)
    B = -(-H // PANEL)
    # Expected, in C's layout: block b, gate g, unit u is column g*H + 16b + u of A @ W.T,
    # and exactly 0 for the padding units past H (their packed weights are 0).
    full = a.astype(np.float64) @ w.astype(np.float64).T
    padded = np.zeros((rows, gates, B * PANEL))
    padded[:, :, :H] = full.reshape(rows, gates, H)
    want = padded.reshape(rows, gates, B, PANEL).transpose(2, 0, 1, 3).reshape(B, rows, -1)
    assert panel_rel_err(c, want, gates) <= TOL[dtype]
    past_h = (np.arange(B * PANEL) >= H).reshape(B, 1, 1, PANEL)
    assert np.all(np.where(past_h, c[:, :, :gates * PANEL].reshape(B, rows, gates, PANEL), 0)
                  == 0), "units past H are not exactly 0"
    assert np.isnan(c[:, :, gates * PANEL:]).all(), "padding columns of C were written"


@pytest.mark.parametrize("R", [1, 16, 17, 40])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 20])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_panel_gemm_with_packed_rows_matches_numpy(dtype, rows, R):
    """The backward product dg @ W (W (GH, R)) through pack_recurrent_rows' panels."""
    GH = 3 * 7
    rng = np.random.default_rng([rows, R])
    dg = rng.standard_normal((rows, GH)).astype(dtype)
    w = rng.standard_normal((GH, R)).astype(dtype)
    packed = pack_recurrent_rows(w)
    c = product(dg, packed[:, None])              # one "gate" per panel
    B = packed.shape[0]
    want = np.zeros((rows, B * PANEL))
    want[:, :R] = dg.astype(np.float64) @ w.astype(np.float64)
    want = want.reshape(rows, B, PANEL).transpose(1, 0, 2)
    assert panel_rel_err(c, want, 1) <= TOL[dtype]
    assert np.isnan(c[:, :, PANEL:]).all(), "padding columns of C were written"


@functools.cache
def transposed_driver(dtype):
    @nb.njit
    def run(a, lda, rows, panels, c):
        panel_gemm_t(a.ctypes.data, lda, rows, panels.ctypes.data,
                     panels.shape[1] * panels.shape[2], panels.shape[0], c.ctypes.data,
                     c.shape[1], panels.shape[1], dtype(0))
    return run


@pytest.mark.parametrize("npanels", [1, 2, 3, 5])
@pytest.mark.parametrize("K", [1, 7, 64])
@pytest.mark.parametrize("rows", [*range(1, 2 * max(ROWS.values()) + 2), 16, 20])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_panel_gemm_t_stores_the_transposed_product(dtype, rows, K, npanels):
    """C (npanels*16, ldc) gets (A @ [panel_0 ..])^T in its first `rows` columns, panel p
    in rows 16p..16p+15 (pairs of panels per tile, then one: odd counts too); the rest
    of C stays NaN."""
    rng = np.random.default_rng([rows, K, npanels, 1])
    a = np.full((rows, K + A_PAD), np.nan, dtype)
    a[:, :K] = rng.standard_normal((rows, K))
    panels = rng.standard_normal((npanels, K, PANEL)).astype(dtype)
    c = np.full((npanels * PANEL, rows + C_PAD), np.nan, dtype)
    transposed_driver(dtype)(a, K + A_PAD, rows, panels, c)
    want = np.concatenate([(a[:, :K].astype(np.float64) @ panel.astype(np.float64)).T
                           for panel in panels])
    assert np.max(np.abs(c[:, :rows] - want)) / np.max(np.abs(want)) <= TOL[dtype]
    assert np.isnan(c[:, rows:]).all(), "columns of C past `rows` were written"


@functools.cache
def dots_driver(dtype):
    @nb.njit
    def run(a, lda, rows, x, ldx, n, c, ldc, k):
        mk.row_dots(a.ctypes.data, lda, rows, x.ctypes.data, ldx, n, c.ctypes.data, ldc, k,
                    dtype(0))
    return run


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9])
@pytest.mark.parametrize("K", [1, 7, 16, 17, 100])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 20])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_dots_stores_the_transposed_product_by_rows(dtype, rows, K, n):
    """row_dots: C (n, ldc) gets (A @ X^T)^T in its first `rows` columns from the samples'
    rows as they are (strides past K honoured: a whole vector of k, a tail, or only a
    tail; groups of samples with a smaller last one; balanced row tiles); the rest of C
    stays NaN."""
    rng = np.random.default_rng([rows, K, n])
    a = np.full((rows, K + A_PAD), np.nan, dtype)
    a[:, :K] = rng.standard_normal((rows, K))
    x = np.full((n, K + 2), np.nan, dtype)
    x[:, :K] = rng.standard_normal((n, K))
    c = np.full((n, rows + C_PAD), np.nan, dtype)
    dots_driver(dtype)(a, K + A_PAD, rows, x, K + 2, n, c, rows + C_PAD, K)
    want = x[:, :K].astype(np.float64) @ a[:, :K].astype(np.float64).T
    assert np.max(np.abs(c[:, :rows] - want)) / np.max(np.abs(want)) <= TOL[dtype]
    assert np.isnan(c[:, rows:]).all(), "columns of C past `rows` were written"


# Run in a fresh process: the tile height is read from ROWS when a kernel is first typed
# (in this process the kernels above have been typed already).
SWAPPED_HEIGHTS = """
import numpy as np, numba as nb
from fusedrnn.cpu.lowlevel import microkernel as mk
mk.ROWS[np.dtype(np.float32)], mk.ROWS[np.dtype(np.float64)] = 3, 6
for dtype in (np.float32, np.float64):
    gemm, size = mk.panel_gemm_for(dtype), np.dtype(dtype).itemsize
    gemm_t = mk.panel_gemm_t
    zero = np.dtype(dtype).type(0)

    @nb.njit
    def run(a, panel, c, ct):
        gemm(a.ctypes.data, a.shape[1], a.shape[0], panel.ctypes.data, c.ctypes.data,
             c.shape[1], a.shape[1])
        gemm_t(a.ctypes.data, a.shape[1], a.shape[0], panel.ctypes.data, 0, 1,
               ct.ctypes.data, ct.shape[1], a.shape[1], zero)
    rng = np.random.default_rng(7)
    a = rng.standard_normal((20, 33)).astype(dtype)
    panel = rng.standard_normal((33, mk.PANEL)).astype(dtype)
    c = np.full((20, mk.PANEL), np.nan, dtype)
    ct = np.full((mk.PANEL, 20), np.nan, dtype)
    run(a, panel, c, ct)
    want = a.astype(np.float64) @ panel.astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert np.max(np.abs(c - want)) <= tol * np.max(np.abs(want)), dtype
    assert np.max(np.abs(ct - want.T)) <= tol * np.max(np.abs(want)), dtype
print("ok")
"""


def test_tile_height_does_not_decide_the_element_size():
    """ROWS may be retuned per dtype (a CPU with more registers, say): the kernels take the
    element size from the dtype, never from the tile height (they once did: 6 rows meant
    float32, so a 6-row float64 tile read every other element)."""
    done = subprocess.run([sys.executable, "-c", SWAPPED_HEIGHTS], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


TALL_TILE = """
import numpy as np, numba as nb
from fusedrnn.cpu.lowlevel import microkernel as mk
mk.ROWS[np.dtype(np.float32)] = {rows}
gemm = mk.panel_gemm_for(np.float32)

@nb.njit
def run(a, panel, c):
    gemm(a.ctypes.data, a.shape[1], a.shape[0], panel.ctypes.data, c.ctypes.data,
         c.shape[1], a.shape[1])
rng = np.random.default_rng(5)
a = rng.standard_normal((19, 4)).astype(np.float32)
panel = rng.standard_normal((4, mk.PANEL)).astype(np.float32)
c = np.full((19, mk.PANEL), np.nan, np.float32)
run(a, panel, c)
assert np.allclose(c, a @ panel, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_any_tile_height_up_to_the_tallest_computes_and_taller_is_refused():
    """Tiles are emitted for the heights asked for (7 rows: 7 + 6 + 6 for 19); past
    MAX_ROWS (8) typing the kernel refuses, since the k-loop would run out of general
    registers for the rows' addresses."""
    done = subprocess.run([sys.executable, "-c", TALL_TILE.format(rows=7)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-c", TALL_TILE.format(rows=MAX_ROWS + 1)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert f"tile heights 1..{MAX_ROWS} exist, got {MAX_ROWS + 1}" in done.stderr, \
        done.stderr[-2000:]


# The tile's k-loop in the asm of a kernel that uses it: a block holding at least 8 FMAs.
# Any stack operand there (a reloaded address, a spilled accumulator) is memory traffic
# the loop did not need.
_FMA = re.compile(r"^\s*(vfmadd\w*|vdpbf16ps)\s", re.M)   # (the bfloat16 tiles': vdpbf16ps)
_STACK_RELOAD = re.compile(r"^\s*\w+\s.*\(%rsp\)", re.M)


def _tile_blocks(asm):
    """The text of each tile function (fusedrnn_tile*): its label to the next function's."""
    functions, current = [], None
    for line in asm.splitlines():
        label = re.match(r"^([.\w$]+):", line)
        if label and not label.group(1).startswith(".L"):   # a function's own label
            current = [] if label.group(1).startswith("fusedrnn_tile") else None
            if current is not None:
                functions.append(current)
        if current is not None:
            current.append(line)
    return ["\n".join(f) for f in functions]


_TILE_NAME = re.compile(r"fusedrnn_(tile|dot\d+x)")   # the panel tiles, row_dots' tiles


def _tile_loops(asm, fmas=8):
    """Each labelled block of a tile's function (fusedrnn_tile*, fusedrnn_dot<h>x*) that
    ends in a back edge (a jump to its own or an earlier label with no `ret` between, which
    an exit block placed early would have), kept where it holds at least `fmas` FMAs (or
    vdpbf16ps). A block that runs once (the k remainder after an unrolled loop, which falls
    through or jumps forward) is not a loop: an address it reloads costs once a tile, not
    once a k. (The kernel's own blocks are not tiles: its cell math has FMAs too.)"""
    blocks, current, in_tile, seen, rets = [], None, False, {}, 0
    for line in asm.splitlines():
        label = re.match(r"^([.\w$]+):", line)
        if label:
            if not label.group(1).startswith(".L"):   # a function's own label
                in_tile = bool(_TILE_NAME.match(label.group(1)))
                seen = {}
            seen[label.group(1)] = rets
            current = [] if in_tile else None
            continue
        rets += bool(re.match(r"^\s*ret", line))
        if current is not None:
            current.append(line)
            jump = re.match(r"^\s*j\w+\s+([.\w$]+)", line)
            if jump and jump.group(1) in seen and seen[jump.group(1)] == rets:
                blocks.append(current)   # a back edge: this block is a loop
                current = None
            elif re.match(r"^\s*jmp\s", line):   # an unconditional jump ends the block
                current = None
    return ["\n".join(b) for b in blocks if len(_FMA.findall("\n".join(b))) >= fmas]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="reads x86-64 asm; the property is about x86's 16 general registers")
@pytest.mark.parametrize("kernel", ["projection", "projection float64", "fused forward",
                                    "fused forward lstm", "fused forward gru float64",
                                    "fused single step lstm", "fused forward bf16 lstm",
                                    "batched", "batched float64"])
@FRESH_COMPILE
def test_tile_loop_reloads_nothing_from_the_stack(monkeypatch, kernel):
    """The tiles are their own noinline functions (module docstring of microkernel.py):
    inlined into the projection's kernel, the 6-row tile's k-loop reloaded 8 row addresses
    from the stack per unrolled pair of k, and 2-7 in the fused loop. Fails if the tile is
    inlined again. The bfloat16 loop's tiles (vdpbf16ps; their biased form has 9
    arguments, 3 on the stack) too, and none of its products outside a tile."""
    from fusedrnn.cpu import fused
    from fusedrnn.cpu.lowlevel import HAS_BF16
    monkeypatch.setattr(fused, "SERIAL_LOOP_WORK", -1)   # (the loops' parallel build)
    rng = np.random.default_rng(3)
    if "bf16" in kernel:
        if not HAS_BF16:
            pytest.skip("the CPU has no AVX512-BF16")
        import ml_dtypes
        T, N, H = 3, fused.FUSED_INPUT_ROWS, 16   # N: the loop multiplies W_x x_t too
        params = rng.standard_normal(fusedrnn.param_size(mode="lstm", input_size=H,
                                                         state_size=H)) * 0.1
        fusedrnn.RNN(rng.standard_normal((T, N, H)).astype(ml_dtypes.bfloat16),
                     params.astype(ml_dtypes.bfloat16), state_size=H, num_layers=1, mode="lstm")
        dispatcher = fused.fused_layer("lstm", np.float32, bf16=True)._forward
        assert dispatcher.signatures, f"{kernel}: the call did not launch it"
        signature = dispatcher.signatures[0]
    elif kernel.startswith("projection"):
        dtype = np.float64 if kernel.endswith("float64") else np.float32
        a = rng.standard_normal((40, 24)).astype(dtype)
        w = rng.standard_normal((48, 24)).astype(dtype)
        wpack = pack_input_weights([w], np.empty((3, 24, PANEL), dtype))
        c = np.full((40, 48), np.nan, dtype)
        gemm.project(a, wpack, c, np.empty((1, gemm.CHUNK, PANEL), dtype))
        np.testing.assert_allclose(c, a @ w.T, rtol=1e-5, atol=1e-5)
        # (A product this small runs the serial build: gemm.SERIAL_WORK.)
        dispatcher, signature = next(
            (d, s) for d in (gemm._project, gemm._project_serial) for s in d.signatures
            if s[0].dtype == nb.from_dtype(dtype))
    elif kernel.startswith("batched"):   # B in place, A by rows and by columns (T=1's backward)
        from fusedrnn.cpu.lowlevel import batched
        dtype = np.dtype(np.float64 if kernel.endswith("float64") else np.float32)
        a, b = rng.standard_normal((2, 8, 40)).astype(dtype), rng.standard_normal((40, 64))
        x = rng.standard_normal((8, 64)).astype(dtype)
        c1, c2 = np.full((8, 64), np.nan, dtype), np.full((40, 64), np.nan, dtype)
        jobs = [(a[0], b.astype(dtype), c1, False), (a[1], x, c2, True)]
        batched.products(*batched.job_rows(jobs, dtype)[:2], dtype.type(0), 0)   # (serial)
        np.testing.assert_allclose(c2, a[1].T @ x, rtol=1e-5, atol=1e-5)
        dispatcher, signature = next((batched._products_serial, s) for s in
                                     batched._products_serial.signatures
                                     if s[2] == nb.from_dtype(dtype))
    elif kernel.startswith("fused single step"):   # the transposed and dot tiles (T=1)
        launch_fused("lstm", np.float32, 1)
        dispatcher = fused.fused_layer("lstm", np.float32)._forward_single_serial
        assert dispatcher.signatures, f"{kernel}: the call did not launch it"
        signature = dispatcher.signatures[0]
    else:
        mode = kernel.split()[2] if len(kernel.split()) > 2 else "rnn_relu"
        dtype = np.float64 if kernel.endswith("float64") else np.float32
        launch_fused(mode, dtype, 3)
        dispatcher = fused.fused_layer(mode, dtype)._forward
        assert dispatcher.signatures, f"{kernel}: the call did not launch it"
        signature = dispatcher.signatures[0]
    asm = fresh_compile(dispatcher, signature).asm
    assert re.search(r"^fusedrnn_tile\w+:", asm, re.M), f"{kernel}: the tiles were inlined"
    if kernel.startswith("fused single step"):   # and row_dots' tiles, for few samples
        assert re.search(r"^fusedrnn_dot\d+x\d+_\w+:", asm, re.M), f"{kernel}: dot tiles inlined"
        dots = _tile_loops("\n".join(line for block in re.split(r"(?m)^(?=fusedrnn_)", asm)
                                      if block.startswith("fusedrnn_dot")
                                      for line in block.splitlines()))
        assert dots, f"{kernel}: no dot tile k-loop found in the asm"
    loops = _tile_loops(asm)
    assert loops, f"{kernel}: no tile k-loop found in the asm"
    tiles = [f for f in re.split(r"(?m)^(?=fusedrnn_)", asm) if _TILE_NAME.match(f)]
    # (a one-row tile has 1-4 FMAs a k: how many a loop holds is the unroll's choice)
    missed = [f.split(":")[0] for f in tiles if not _tile_loops(f, fmas=1)]
    assert not missed, f"{kernel}: no k-loop found in {missed}"
    if "bf16" in kernel:   # every vdpbf16ps in a tile's function (none inlined)
        in_tiles = sum(f.count("vdpbf16ps") for f in _tile_blocks(asm))
        assert in_tiles and asm.count("vdpbf16ps") == in_tiles, f"{kernel}: a product inlined"
    reloads = [len(_STACK_RELOAD.findall(loop)) for loop in loops]
    assert not any(reloads), f"{kernel}: stack reloads per tile k-loop {reloads}"


@pytest.mark.parametrize("features, bits", [
    ("+avx2,+fma,-avx512f", 256), ("+avx2,+fma,+avx512f,+avx512vl", 512),
    ("+sse4.2", 256), ("", 256), ("+avx512fp16,-avx512f", 256)])
def test_vector_width_follows_the_targets_avx512f(monkeypatch, features, bits):
    from fusedrnn.cpu.lowlevel import microkernel as mk
    monkeypatch.setattr(nb.config, "CPU_FEATURES", features)
    assert mk._target_vector_bits() == bits


# The width this CPU does not pick, in a fresh process (it is read when a tile compiles):
# 512-bit IR on an AVX2 CPU is split into 256-bit halves by LLVM; either way the
# products must be right, for every tile height and the transposed store.
OTHER_WIDTH = """
import numpy as np, numba as nb
from fusedrnn.cpu.lowlevel import microkernel as mk
mk.VECTOR_BITS = 768 - mk.VECTOR_BITS
mk.ROWS.update(mk.rows_for(mk.VECTOR_BITS))   # the heights that width runs with
for dtype in (np.float32, np.float64):
    gemm = mk.panel_gemm_for(dtype)
    zero = np.dtype(dtype).type(0)

    @nb.njit
    def run(a, panel, c, ct):
        gemm(a.ctypes.data, a.shape[1], a.shape[0], panel.ctypes.data, c.ctypes.data,
             c.shape[1], a.shape[1])
        mk.panel_gemm_t(a.ctypes.data, a.shape[1], a.shape[0], panel.ctypes.data, 0, 1,
                        ct.ctypes.data, ct.shape[1], a.shape[1], zero)
    rng = np.random.default_rng(11)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 20):
        a = rng.standard_normal((rows, 33)).astype(dtype)
        panel = rng.standard_normal((33, mk.PANEL)).astype(dtype)
        c = np.full((rows, mk.PANEL), np.nan, dtype)
        ct = np.full((mk.PANEL, rows), np.nan, dtype)
        run(a, panel, c, ct)
        want = a.astype(np.float64) @ panel.astype(np.float64)
        tol = (1e-5 if dtype == np.float32 else 1e-12) * np.max(np.abs(want))
        assert np.max(np.abs(c - want)) <= tol, (dtype, rows)
        assert np.max(np.abs(ct - want.T)) <= tol, (dtype, rows)

    @nb.njit
    def dots(a, x, c):
        mk.row_dots(a.ctypes.data, a.shape[1], a.shape[0], x.ctypes.data, x.shape[1],
                    x.shape[0], c.ctypes.data, c.shape[1], a.shape[1], zero)
    for rows, n in ((16, 1), (13, 2), (7, 3), (20, 6)):
        a = rng.standard_normal((rows, 37)).astype(dtype)
        x = rng.standard_normal((n, 37)).astype(dtype)
        c = np.full((n, rows), np.nan, dtype)
        dots(a, x, c)
        want = x.astype(np.float64) @ a.astype(np.float64).T
        assert np.max(np.abs(c - want)) <= 1e-5 * np.max(np.abs(want)), (dtype, rows, n)
print("ok", mk.VECTOR_BITS, mk.ROWS[np.dtype(np.float64)])
"""


def test_the_other_vector_width_computes_the_same():
    """Both widths, each with its own tile heights (and row_dots' tiles), run wherever CI
    runs, whichever its CPU picks."""
    from fusedrnn.cpu.lowlevel import microkernel as mk
    done = subprocess.run([sys.executable, "-c", OTHER_WIDTH], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    other = 768 - mk.VECTOR_BITS
    assert done.stdout.split() == ["ok", str(other), str(mk.rows_for(other)[np.dtype(np.float64)])]
