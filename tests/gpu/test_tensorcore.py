"""The persistent kernels' tensor-core products (fusedrnn/gpu/tensorcore.cuh) without a GPU:
float16 and bfloat16 data through the GPU backend's plan, argument packing and layer
object, on the host harness, where mma.sync is tensorcore.cuh's stand-in (it gathers
all 32 lanes' fragments through the kernel's own loads and places them by the PTX
layout). Every output and gradient is held to test_precision's bound against the float64
reference on the same rounded inputs. Shared memory starts as NaN bytes, so padding that
reached a result fails. What this cannot cover: the instruction itself, real concurrency
and speed (tests/gpu/test_parity.py on a GPU; bench/gpu_session.sh half)."""
import ctypes

import ml_dtypes
import numpy as np
import pytest
from test_precision import HALF, assert_within, clear_of_the_kink, longest_product, rounded

from fusedrnn.config import CELLS, CallOptions
from fusedrnn.gpu import persistent
from fusedrnn.gpu.persistent import DeviceLimits, persistent_plan

from conftest import MODES, make_case
from host_backend import HostCudaBackend, build_harness, reference, run_stored_as, run_training

# Small "devices" of compute capability 9.0: H=9 or 40 units split unevenly over blocks.
TWO_SMS, FOUR_SMS = DeviceLimits(2, 1 << 20, 90), DeviceLimits(4, 1 << 20, 90)
H100 = DeviceLimits(132, 227 * 1024, 90)
NAMES = ("out", "hy", "cy", "ddata", "dparameters", "dstate", "dstate_cell", "out (inference)",
         "hy (inference)", "cy (inference)")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build_harness(tmp_path_factory.mktemp("harness"))


@pytest.fixture(autouse=True)
def tensor_cores_asked_for(monkeypatch):
    """These tests ask for them (the default since they were measured, persistent.py),
    so that a test that turns them off says so."""
    monkeypatch.setenv(persistent.TENSOR_CORES_ENV, "1")


def _check(harness, mode, dtype, limits=TWO_SMS, opts=CallOptions(), chunk=None,
           mma_slices=None, threads=None, T=6, N=5, I=4, H=9, L=1, D=1, seed=0):
    """The half op on the host harness against the float64 op on the same rounded inputs;
    returns the plans its layers ran."""
    dtype = HALF[dtype]
    case, kw, heads = make_case(mode, T=T, N=N, I=I, H=H, L=L, D=D, seed=seed)
    case = clear_of_the_kink(case, kw, sequence_length=opts.lengths)
    half, exact = rounded(case, dtype)
    half_heads, exact_heads = rounded(heads, dtype)
    backend = HostCudaBackend(harness, persistent=limits, chunk=chunk, threads=threads,
                              mma_slices=mma_slices)
    got = run_training(backend, half, kw, half_heads, dtype, opts)
    want = run_training(reference(np.float64), exact, kw, exact_heads, np.float64, opts)
    assert len(backend.launches) == 3 * L * D   # every layer and direction ran persistent
    assert len(got) == len(want)
    cell_state = CELLS[mode].has_cell_state
    names = [n for n in NAMES if cell_state or not n.startswith(("cy", "dstate_cell"))]
    for name, a, b in zip(names, got, want):
        assert_within(a, b, dtype, longest_product(kw, I), name)
    return backend.plans


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("L,D", [(1, 1), (2, 2)])
@pytest.mark.parametrize("mode", MODES)
def test_tensor_core_products_within_the_half_bound(harness, mode, L, D, dtype):
    plans = _check(harness, mode, dtype, L=L, D=D, seed=L + D)
    assert {plan.precision for plan in plans} == {dtype}


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("mode", MODES)
def test_several_tiles_slices_and_chunks(harness, mode, dtype):
    """N=20: two tiles of samples; H=40 over 4 blocks: 10 units (up to 40 rows of W_h, five
    tiles), k of three steps split in 2 slices; the backward in chunks of 16 gate rows, the
    last partial."""
    plans = _check(harness, mode, dtype, limits=FOUR_SMS, chunk=16, mma_slices=2, T=5, N=20,
                   I=6, H=40, seed=5)
    assert {(plan.units, plan.slices, plan.backward_slices, plan.chunk)
            for plan in plans} == {(10, 2, 2, 16)}


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_more_slices_than_k_steps_and_few_threads(harness, mode):
    """Five slices of one k-step (four empty) on a block of 64 threads: two warps take the
    tiles in turn."""
    _check(harness, mode, "float16", mma_slices=5, threads=64, N=17, H=12, seed=2)


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("mode", MODES)
def test_lengths_and_clipping(harness, mode, dtype):
    opts = CallOptions(lengths=np.array([6, 1, 4, 6, 3], np.int64))
    if CELLS[mode].state_clip:
        opts = CallOptions(lengths=opts.lengths, clip_lo=-0.3, clip_hi=0.25, clip_flags=3)
    _check(harness, mode, dtype, opts=opts, D=2, seed=7)


@pytest.mark.parametrize("mode", ["lstm", "rnn_tanh"])
def test_float32_data_stored_as_bfloat16_takes_the_bfloat16_products(harness, mode):
    """op.RNN's _stored_as (torch's CUDA bfloat16 arrives as float32: CuPy has no
    bfloat16): the bfloat16 plan, within bfloat16's bound."""
    dtype = HALF["bfloat16"]
    case, kw, heads = make_case(mode, T=6, N=5, I=4, H=9, L=2, D=2, seed=4)
    backend = HostCudaBackend(harness, persistent=TWO_SMS)
    got, want = run_stored_as(backend, case, kw, heads)
    assert {plan.precision for plan in backend.plans} == {"bfloat16"}
    for a, b in zip(got, want):
        assert_within(a.astype(dtype), b, dtype, longest_product(kw, 4), "output or gradient")


@pytest.mark.parametrize("dtype", list(HALF))
def test_before_compute_capability_8_half_data_keeps_the_float32_products(harness, dtype):
    plans = _check(harness, "lstm", dtype, limits=DeviceLimits(2, 1 << 20, 75))
    assert {plan.precision for plan in plans} == {None}


def test_product_precision_rule(monkeypatch):
    monkeypatch.delenv(persistent.TENSOR_CORES_ENV, raising=False)
    assert persistent.product_precision("float16", H100) == "float16"   # the default
    monkeypatch.setenv(persistent.TENSOR_CORES_ENV, "1")
    assert persistent.product_precision("float16", H100) == "float16"
    assert persistent.product_precision("bfloat16", H100) == "bfloat16"
    assert persistent.product_precision(None, H100) is None               # float32 data
    assert persistent.product_precision("float16", DeviceLimits(132, 1 << 17, 75)) is None
    assert persistent.product_precision("float16", DeviceLimits(132, 1 << 17)) is None
    monkeypatch.setenv(persistent.TENSOR_CORES_ENV, "0")
    assert persistent.product_precision("float16", H100) is None


def test_plan_for_the_design_doc_lstm_in_half_on_an_h100():
    """T=300 N=20 I=H=800: 7 units a block, 28 rows of W_h (4 tiles of 8) by 2 tiles of 16
    samples, 50 k-steps in 2 slices: one tile per warp of 512 threads. The backward: 2
    tiles (7 units in one tile of 8) in 8 slices, the 3200 gate rows in 2 chunks."""
    plan = persistent_plan(4, 800, 20, 4, H100, 1, None, "float16")
    assert (plan.units, plan.blocks, plan.threads, plan.slices, plan.backward_slices,
            plan.chunk) == (7, 115, 512, 2, 8, 2672)
    forward = persistent.mma_forward_operands(4, 800, 20, 7)
    assert (forward.m_rows, forward.n_rows, forward.k, forward.lda, forward.ldc) == \
        (32, 32, 800, 808, 33)
    # about 0.7 of the float32 plan's 156800 bytes
    assert plan.forward_smem == 2 * (32 * 808 + 32 * 808) + 4 * 2 * 32 * 33 == 111872
    backward = persistent.mma_backward_operands(4, 800, 20, 7, 2672)
    assert plan.backward_smem == backward.smem_bytes(8) <= H100.smem_per_block


def test_plan_in_half_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="precision"):
        persistent_plan(4, 800, 20, 8, H100, 1, None, "float16")     # float64 arrays
    with pytest.raises(ValueError, match="tile 2"):
        persistent_plan(4, 800, 20, 4, H100, 2, None, "bfloat16")
    with pytest.raises(ValueError, match="float8"):
        persistent_plan(4, 800, 20, 4, H100, 1, None, "float8")
    assert persistent_plan(4, 2048, 64, 4, H100, 1, None, "float16") is None   # W_h too large
    for hidden in (1, 5, 133, 800, 1024):
        plan = persistent_plan(3, hidden, 7, 4, H100, 1, None, "bfloat16")
        assert plan.threads % 32 == 0 and plan.chunk % 16 == 0
        assert max(plan.forward_smem, plan.backward_smem) <= H100.smem_per_block


@pytest.mark.parametrize("G,H,N,U", [(1, 1, 1, 1), (4, 800, 20, 7), (3, 37, 17, 5),
                                     (4, 1024, 64, 8), (1, 9, 5, 5)])
@pytest.mark.parametrize("slices", [1, 3])
def test_layout_mirror_equals_the_kernels(harness, G, H, N, U, slices):
    lib = harness
    lib.mma_forward_smem.restype = lib.mma_backward_smem.restype = ctypes.c_longlong
    assert persistent.mma_forward_operands(G, H, N, U).smem_bytes(slices) == \
        lib.mma_forward_smem(G, H, N, U, slices)
    for chunk in (16, 512):
        assert persistent.mma_backward_operands(G, H, N, U, chunk).smem_bytes(slices) == \
            lib.mma_backward_smem(G, H, N, U, chunk, slices)


def _corpus():
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99,
                        65520.0, 1e6, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25,
                        2.0 ** -26, 3.0 * 2.0 ** -25, 1e-30, 3.4e38, 1.0 + 2.0 ** -11,
                        1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], np.float32)
    # float32 values around both formats' rounding points, and in every range
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2 ** 16, 5000, dtype=np.uint32) << 13) | 0x1000
    return np.concatenate([special, -special, bits.view(np.float32), ties.view(np.float32),
                           (rng.standard_normal(5000) * 1e-5).astype(np.float32)])


@pytest.mark.parametrize("dtype", list(HALF))
def test_conversions_round_to_nearest_even_as_numpy(harness, dtype):
    """The host stand-ins of cvt.rn.f16.f32 / cvt.rn.bf16.f32 (the device uses the
    instructions) against numpy's float16 and ml_dtypes' bfloat16; NaN stays NaN."""
    x = _corpus()
    out = np.empty(x.size, np.uint16)
    harness.round_to_half(ctypes.c_void_p(x.ctypes.data), ctypes.c_longlong(x.size),
                          ctypes.c_int(persistent.HALF_PRODUCTS[dtype]),
                          ctypes.c_void_p(out.ctypes.data))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16 if dtype == "float16" else ml_dtypes.bfloat16)
    got = out.view(want.dtype)
    nan = np.isnan(x)
    assert np.isnan(got.astype(np.float32)[nan]).all()
    assert (got.view(np.uint16)[~nan] == want.view(np.uint16)[~nan]).all()


def test_op_plan_applies_the_environment():
    """persistent.op_plan, the plan cupy_persistent_layer takes: tensor cores for half
    data unless turned off; FUSEDRNN_GPU_TILE's slices apply to them, its tile not."""
    env = {persistent.TENSOR_CORES_ENV: "1"}
    assert persistent.op_plan(4, 800, 20, 4, H100, "float16", env).precision == "float16"
    assert persistent.op_plan(4, 800, 20, 4, H100, "float16", {}).precision == "float16"
    assert persistent.op_plan(4, 800, 20, 4, H100, None, env).precision is None
    off = {persistent.TENSOR_CORES_ENV: "0"}
    assert persistent.op_plan(4, 800, 20, 4, H100, "bfloat16", off).precision is None
    plan = persistent.op_plan(4, 800, 20, 4, H100, "bfloat16",
                              dict(env, **{persistent.TILE_ENV: "4,3"}))
    assert (plan.precision, plan.tile, plan.slices) == ("bfloat16", 1, 3)
    plan = persistent.op_plan(4, 800, 20, 4, H100, None, {persistent.TILE_ENV: "4,3"})
    assert (plan.precision, plan.tile, plan.slices) == (None, 4, 3)


# ---- persistent.cuh's staging: the 16-byte form against the scalar one ----

def _stage(lib, src, rows, width, src_ld, width_pad, ld, precision, threads, wide, offset=0,
           dst_offset=0):
    """stage_half_rows' result (poisoned dst, rows x ld uint16, then 8 more) and whether the
    wide form ran; `offset` / `dst_offset` elements into src / dst (misalign them)."""
    dst = np.full(rows * ld + 16, 0xFFFF, np.uint16)
    ran = lib.stage_rows(ctypes.c_void_p(src.ctypes.data + offset * src.itemsize), src.itemsize,
                         rows, width, src_ld, width_pad,
                         ctypes.c_void_p(dst.ctypes.data + 2 * dst_offset), ld, precision,
                         threads, wide)
    return dst[dst_offset:dst_offset + rows * ld + 8], ran


@pytest.mark.parametrize("precision", [1, 2], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("source", ["float32", "half"])
@pytest.mark.parametrize("rows,width,src_ld,width_pad,ld,threads", [
    (20, 800, 800, 800, 808, 512),    # the design size's forward state (H=800)
    (20, 2672, 3200, 2672, 2680, 512),   # its backward's first chunk of the exchange
    (3, 40, 48, 48, 56, 96),          # padding columns; 96 threads: batches end mid-row
    (7, 8, 8, 16, 24, 32),
])
def test_wide_staging_equals_the_scalar_form(harness, precision, source, rows, width, src_ld,
                                             width_pad, ld, threads):
    rng = np.random.default_rng(rows * width)
    values = rng.standard_normal(rows * src_ld + 8) * 3
    values[::7] = np.array([0.0, -0.0, 1e-6, 7e4, -1e-9, 65504.0, 2.0 ** -24])[
        np.arange(len(values[::7])) % 7]   # (7e4: float16's inf)
    half = HALF["bfloat16" if precision == 2 else "float16"]
    with np.errstate(over="ignore"):
        rounded_bits = values.astype(np.float32).astype(half).view(np.uint16)
    src = values.astype(np.float32) if source == "float32" else rounded_bits
    wide, ran = _stage(harness, src, rows, width, src_ld, width_pad, ld, precision, threads, 1)
    scalar, _ = _stage(harness, src, rows, width, src_ld, width_pad, ld, precision, threads, 0)
    assert ran == 1
    assert np.array_equal(wide, scalar)
    staged = wide[:rows * ld].reshape(rows, ld)
    want = rounded_bits[:rows * src_ld].reshape(rows, src_ld)[:, :width]
    assert np.array_equal(staged[:, :width], want)
    assert not staged[:, width:width_pad].any()
    assert (staged[:, width_pad:] == 0xFFFF).all() and (wide[rows * ld:] == 0xFFFF).all()


@pytest.mark.parametrize("source", ["float32", "half"])
def test_wide_staging_leaves_what_it_cannot_load_whole_to_the_scalar_form(harness, source):
    src = np.arange(400, dtype=np.float32 if source == "float32" else np.uint16)
    V = 16 // src.itemsize
    good = dict(rows=4, width=2 * V, src_ld=4 * V, width_pad=2 * V, ld=2 * V)
    assert _stage(harness, src, **good, precision=1, threads=32, wide=1)[1] == 1
    for change in (dict(width=V + 1, width_pad=2 * V), dict(src_ld=4 * V + 1),
                   dict(width_pad=2 * V + 1, ld=3 * V), dict(ld=2 * V + 1)):
        args = dict(good, **change)
        assert _stage(harness, src, **args, precision=1, threads=32, wide=1)[1] == 0, change
    assert _stage(harness, src, **good, precision=1, threads=32, wide=1, offset=1)[1] == 0
    assert _stage(harness, src, **good, precision=1, threads=32, wide=1, dst_offset=1)[1] == 0
