"""The GPU's half-precision GEMMs (fusedrnn/gpu/halfgemm.py) without a GPU: HalfGemm's
row-major to column-major mapping against cuBLAS's own definition (host_gemm_ex), the
rule that turns them on, and the op on the host harness with them: the input projection
and every backward GEMM in half, within test_precision's bound against the float64
reference on the same rounded inputs. What this cannot cover: the rounding kernel and
cuBLAS themselves on a device (tests/gpu/test_compile.py builds the kernel;
bench/gpu_session.sh half runs and times it all on a GPU)."""
import ctypes
import types

import numpy as np
import pytest
from test_host_emulation import _projected_case
from test_precision import HALF, assert_within, longest_product, rounded

from fusedrnn.config import CELLS, CallOptions
from fusedrnn.gpu import GpuBackend, halfgemm
from fusedrnn.gpu.persistent import DeviceLimits

from conftest import MODES, make_case
from host_backend import (
    HALF_DTYPES,
    HostCudaBackend,
    build_harness,
    host_gemm_ex,
    host_narrow,
    reference,
    run_stored_as,
    run_training,
)

TWO_SMS = DeviceLimits(2, 1 << 20, 90)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build_harness(tmp_path_factory.mktemp("harness"))


@pytest.fixture
def every_projection_in_half(monkeypatch):
    """The small cases here have fewer rows than the projection's rule asks for."""
    monkeypatch.setattr(halfgemm, "MIN_PROJECTION_ROWS", 1)


def _exact(shape, rng, scale=1 / 16):
    """float32 values exact in both half types, whose products and sums are exact in
    float32 (small integers over 16): the mapping is checked bit for bit."""
    return (rng.integers(-8, 9, shape) * scale).astype(np.float32)


@pytest.mark.parametrize("storage", list(halfgemm.HALF_TYPES))
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("b_transposed", [False, True])
def test_half_gemm_is_the_row_major_product(storage, transpose_a, b_transposed):
    """a as a column slice of a wider array, b as given or as w.T (the projection's W_x^T),
    out a column slice of a wider array (ldc > C): out = op(a) @ b exactly, nothing
    around out written."""
    rng = np.random.default_rng(3)
    M, K, C = 13, 21, 10
    wide_a = _exact((K, M + 5) if transpose_a else (M, K + 5), rng)
    a = wide_a[:, 2:2 + M] if transpose_a else wide_a[:, 2:2 + K]
    b = _exact((C, K), rng).T if b_transposed else _exact((K, C), rng)
    wide_out = np.full((M, C + 3), 777.0, np.float32)
    out = wide_out[:, 1:1 + C]
    scratch = np.full(halfgemm.scratch_size(M, K, C), 0xDEADBEEF, np.uint32)
    gemm = halfgemm.HalfGemm(host_narrow, host_gemm_ex)
    gemm.matmul(a, b, out, transpose_a, scratch, storage)
    want = (a.T if transpose_a else a).astype(np.float64) @ b.astype(np.float64)
    assert np.array_equal(out, want)
    assert (wide_out[:, 0] == 777).all() and (wide_out[:, 1 + C:] == 777).all()


@pytest.mark.parametrize("M,K,C", [(1, 1, 1), (1, 3, 4), (5, 1, 4), (5, 3, 1), (2, 1, 1)])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("b_transposed", [False, True])
def test_half_gemm_edge_shapes(M, K, C, transpose_a, b_transposed):
    """One row, one column, one k (input_size 1: W_x.T has equal strides): still exact."""
    rng = np.random.default_rng(M * 100 + K * 10 + C)
    a = _exact((K, M) if transpose_a else (M, K), rng)
    b = _exact((C, K), rng).T if b_transposed else _exact((K, C), rng)
    out = np.full((M, C), np.nan, np.float32)
    halfgemm.HalfGemm(host_narrow, host_gemm_ex).matmul(
        a, b, out, transpose_a, np.zeros(halfgemm.scratch_size(M, K, C), np.uint32), "bfloat16")
    assert np.array_equal(out, (a.T if transpose_a else a).astype(np.float64) @ b)


@pytest.mark.parametrize("storage", list(halfgemm.HALF_TYPES))
def test_half_gemm_rounds_its_operands_to_the_half_type(storage):
    """Operands that are not half values are rounded (to nearest even) before the product:
    the result is the product of the rounded operands, not of the float32 ones."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((7, 9)).astype(np.float32)
    b = rng.standard_normal((9, 5)).astype(np.float32)
    out = np.empty((7, 5), np.float32)
    halfgemm.HalfGemm(host_narrow, host_gemm_ex).matmul(
        a, b, out, False, np.empty(halfgemm.scratch_size(7, 9, 5), np.uint32), storage)
    t = HALF_DTYPES[storage]
    want = a.astype(t).astype(np.float64) @ b.astype(t).astype(np.float64)
    assert np.allclose(out, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(out, a.astype(np.float64) @ b, rtol=1e-6, atol=1e-6)


def test_a_paired_reuses_a_only_where_the_last_call_took_the_same_a():
    rng = np.random.default_rng(5)
    a, a2 = _exact((12, 6), rng), _exact((12, 6), rng)
    b = _exact((12, 4), rng)
    out = np.empty((6, 4), np.float32)
    scratch = np.empty(halfgemm.scratch_size(6, 12, 4), np.uint32)
    narrowed = []

    def narrow(src, dst, storage):
        narrowed.append(src.shape)
        host_narrow(src, dst, storage)
    gemm = halfgemm.HalfGemm(narrow, host_gemm_ex)
    gemm.matmul(a, b, out, True, scratch, "bfloat16")
    gemm.matmul(a, b, out, True, scratch, "bfloat16", a_paired=True)
    assert narrowed == [(12, 6), (12, 4), (12, 4)]   # a's copy made once
    gemm.matmul(a2, b, out, True, scratch, "bfloat16", a_paired=True)   # another a
    assert np.array_equal(out, a2.T.astype(np.float64) @ b)
    gemm.matmul(a2, b, out, True, scratch, "float16", a_paired=True)   # another half type
    assert narrowed[-2:] == [(12, 6), (12, 4)]


def test_half_gemm_refuses_what_does_not_fit():
    gemm = halfgemm.HalfGemm(host_narrow, host_gemm_ex)
    a, b = np.zeros((4, 3), np.float32), np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match="scratch"):
        gemm.matmul(a, b, np.empty((4, 2), np.float32), False, np.empty(3, np.uint32), "float16")
    with pytest.raises(ValueError, match="storage"):
        gemm.matmul(a, b, np.empty((4, 2), np.float32), False, np.empty(99, np.uint32),
                    "float32")
    with pytest.raises(ValueError, match="does not fit"):
        gemm.matmul(a, b, np.empty((2, 4), np.float32), False, np.empty(99, np.uint32),
                    "float16")
    with pytest.raises(ValueError, match="float32 out"):
        gemm.matmul(a, b, np.empty((4, 2), np.float64), False, np.empty(99, np.uint32),
                    "float16")


@pytest.mark.parametrize("offset", range(8))
def test_the_copies_start_16_byte_aligned_wherever_the_scratch_starts(offset):
    """The op carves its scratch among other buffers (4-byte aligned): the copies still
    start on 16 bytes, within scratch_size, and the product is right."""
    rng = np.random.default_rng(offset)
    M, K, C = 5, 7, 3
    a, b = _exact((M, K), rng), _exact((K, C), rng)
    starts = []

    def narrow(src, dst, storage):
        starts.append(dst.__array_interface__["data"][0] % 16)
        host_narrow(src, dst, storage)
    size = halfgemm.scratch_size(M, K, C)
    scratch = np.zeros(size + 8, np.uint32)[offset:offset + size]
    out = np.empty((M, C), np.float32)
    halfgemm.HalfGemm(narrow, host_gemm_ex).matmul(a, b, out, False, scratch, "float16")
    assert starts == [0, 0]
    assert np.array_equal(out, a.astype(np.float64) @ b)


def test_pair_products_rule(monkeypatch):
    """On by default (FUSEDRNN_GPU_HALF_GEMMS=0 turns them off); from compute capability
    8.0 (the rounding kernel traps before it); never for float32 or float64 data."""
    def backend(capability):
        device = types.SimpleNamespace(compute_capability=capability)
        return GpuBackend(types.SimpleNamespace(cuda=types.SimpleNamespace(
            Device=lambda: device)))
    monkeypatch.setenv(halfgemm.HALF_GEMMS_ENV, "0")
    assert not backend("90").pair_products("bfloat16")
    monkeypatch.delenv(halfgemm.HALF_GEMMS_ENV, raising=False)
    assert backend("90").pair_products("bfloat16") and backend("90").pair_products("float16")
    assert not backend("75").pair_products("float16")
    assert not backend("75").pair_products("bfloat16")
    assert not backend("90").pair_products("float32") and not backend("90").pair_products(None)
    assert GpuBackend.pair_scratch(6, 5, 4) == halfgemm.scratch_size(6, 5, 4) == \
        (8 + 32 + 20) // 2
    assert not GpuBackend.pair_projection(halfgemm.MIN_PROJECTION_ROWS - 1)
    assert GpuBackend.pair_projection(halfgemm.MIN_PROJECTION_ROWS)


def test_cupy_half_gemm_launches_and_calls_cublas_as_documented(monkeypatch):
    """cupy_half_gemm's own calls, on stand-ins for CuPy and its cuBLAS binding that read
    the memory behind the pointers they are given: the rounding kernel gets int64 sizes
    and a's row stride (a column slice), gemmEx cuBLAS's argument order, enums, host
    alpha = 1 and beta = 0; the pointer mode is restored; the product is exact."""
    monkeypatch.setattr(halfgemm, "_modules", {})
    storage_of = {name: s for s, name in halfgemm.NARROW_KERNELS.items()}
    launches, modes = [], []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args):
            src, rows, cols, ld, dst = args
            assert all(type(v) is np.int64 for v in (rows, cols, ld))
            launches.append((int(rows), int(cols), int(ld)))
            rows_view = np.lib.stride_tricks.as_strided(src, (int(rows), int(cols)),
                                                        (4 * int(ld), 4))
            host_narrow(rows_view, dst, storage_of[self.name])

    class Module:
        def __init__(self, code, options, name_expressions):
            assert "narrow_rows" in code
            assert sorted(name_expressions) == sorted(halfgemm.NARROW_KERNELS.values())

        def get_function(self, name):
            return Kernel(name)

    def memory(ctype, address, count):
        return np.ctypeslib.as_array((ctype * count).from_address(address))

    class Cublas:
        CUBLAS_POINTER_MODE_HOST = 0
        mode = [1]

        @staticmethod
        def getPointerMode(handle):
            return Cublas.mode[0]

        @staticmethod
        def setPointerMode(handle, mode):
            modes.append(mode)
            Cublas.mode[0] = mode

        @staticmethod
        def gemmEx(handle, transa, transb, m, n, k, alpha, A, a_type, lda, B, b_type, ldb,
                   beta, C, c_type, ldc, compute, algo):
            assert handle == 42 and Cublas.mode[0] == 0
            assert memory(ctypes.c_float, alpha, 1)[0] == 1
            assert memory(ctypes.c_float, beta, 1)[0] == 0
            assert a_type == b_type == halfgemm.HALF_TYPES["bfloat16"] and c_type == 0
            assert (compute, algo) == (68, -1)
            a_cols = k if transa == halfgemm.OP_N else m
            b_cols = n if transb == halfgemm.OP_N else k
            a_rows = m if transa == halfgemm.OP_N else k
            b_rows = k if transb == halfgemm.OP_N else n
            host_gemm_ex(transa, transb, m, n, k,
                         memory(ctypes.c_uint16, A, lda * (a_cols - 1) + a_rows), lda,
                         memory(ctypes.c_uint16, B, ldb * (b_cols - 1) + b_rows), ldb,
                         np.lib.stride_tricks.as_strided(
                             memory(ctypes.c_float, C, ldc * (n - 1) + m), (n, m), (4 * ldc, 4)),
                         ldc, "bfloat16")

    cupy = types.SimpleNamespace(RawModule=Module, cuda=types.SimpleNamespace(
        device=types.SimpleNamespace(get_cublas_handle=lambda: 42)))
    gemm = halfgemm.cupy_half_gemm(cupy, Cublas)
    rng = np.random.default_rng(8)
    dgx = _exact((30, 24), rng)        # dG of two directions; this one's columns 12..23
    x = _exact((30, 7), rng)
    out = np.full((12, 7), np.nan, np.float32)
    scratch = np.empty(halfgemm.scratch_size(12, 30, 7), np.uint32)
    gemm.matmul(dgx[:, 12:], x, out, True, scratch, "bfloat16")
    assert np.array_equal(out, dgx[:, 12:].T.astype(np.float64) @ x)
    assert launches == [(30, 12, 24), (30, 7, 7)]
    assert modes == [0, 1]   # host mode for the call, the handle's own mode after


NAMES = ("out", "hy", "cy", "ddata", "dparameters", "dstate", "dstate_cell", "out (inference)",
         "hy (inference)", "cy (inference)")


def _check(harness, mode, dtype, persistent=None, opts=CallOptions(), L=1, D=1, seed=0,
           projection_size=None, T=6, N=5, I=4, H=9):
    dtype = HALF[dtype]
    if projection_size:
        case, kw, heads = _projected_case(L, D, np.float64, seed, projection_size)
        I = case["data"].shape[2]
    else:
        case, kw, heads = make_case(mode, T=T, N=N, I=I, H=H, L=L, D=D, seed=seed)
    half, exact = rounded(case, dtype)
    half_heads, exact_heads = rounded(heads, dtype)
    backend = HostCudaBackend(harness, persistent=persistent, half_gemms=True)
    got = run_training(backend, half, kw, half_heads, dtype, opts, projection_size)
    want = run_training(reference(np.float64), exact, kw, exact_heads, np.float64, opts,
                        projection_size)
    cell_state = CELLS[mode].has_cell_state
    names = [n for n in NAMES if cell_state or not n.startswith(("cy", "dstate_cell"))]
    if projection_size:
        kw = dict(kw, projection_size=projection_size)
    assert len(got) == len(want) == len(names)
    for name, a, b in zip(names, got, want):
        assert_within(a, b, dtype, longest_product(kw, I), name)
    return backend.half_products


def _expected_products(L, D, projection=False):
    """Per layer: two projections (training and inference forwards), one input gradient,
    and per direction the W_x and W_h gradients (and W_r's)."""
    return L * (2 + 1 + D * (3 if projection else 2))


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("L,D", [(1, 1), (2, 2)])
@pytest.mark.parametrize("mode", MODES)
def test_the_op_within_the_half_bound_with_half_gemms(harness, every_projection_in_half, mode,
                                                      L, D, dtype):
    """Per-step path: every large GEMM in half (counted), the results within the bound."""
    products = _check(harness, mode, dtype, L=L, D=D, seed=L + D)
    assert len(products) == _expected_products(L, D)
    assert {half for _, _, half in products} == {dtype}


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_persistent_layers_with_half_gemms(harness, every_projection_in_half, monkeypatch,
                                          mode, dtype):
    """With the persistent kernels and their tensor-core products: the whole half path."""
    from fusedrnn.gpu import persistent
    monkeypatch.setenv(persistent.TENSOR_CORES_ENV, "1")
    products = _check(harness, mode, dtype, persistent=TWO_SMS, L=2, D=2, seed=9)
    assert len(products) == _expected_products(2, 2)


def test_lengths_clipping_and_projection_with_half_gemms(harness, every_projection_in_half):
    opts = CallOptions(lengths=np.array([5, 1, 3], np.int64), clip_lo=-0.3,
                       clip_hi=0.25, clip_flags=3)
    products = _check(harness, "lstm", "bfloat16", opts=opts, L=2, D=2, seed=6,
                      projection_size=2)
    assert len(products) == _expected_products(2, 2, projection=True)


def test_float32_data_stored_as_bfloat16_takes_the_half_gemms(harness, every_projection_in_half):
    """op.RNN's _stored_as (torch's CUDA bfloat16 arrives as float32): bfloat16 GEMMs."""
    dtype = HALF["bfloat16"]
    case, kw, heads = make_case("gru", T=6, N=5, I=4, H=9, L=2, D=1, seed=2)
    backend = HostCudaBackend(harness, half_gemms=True)
    got, want = run_stored_as(backend, case, kw, heads)
    assert {half for _, _, half in backend.half_products} == {"bfloat16"}
    assert len(backend.half_products) == _expected_products(2, 1)
    for a, b in zip(got, want):
        assert_within(a.astype(dtype), b, dtype, longest_product(kw, 4), "output or gradient")


def test_few_rows_project_in_float32(harness):
    """Below MIN_PROJECTION_ROWS rows (T*N = 30 here) the projections stay float32; the
    backward's GEMMs still run in half."""
    products = _check(harness, "gru", "float16", L=2, D=1, seed=3)
    assert len(products) == _expected_products(2, 1) - 2 * 2


def test_the_bound_catches_a_gemm_that_drops_a_term(harness, every_projection_in_half,
                                                    monkeypatch):
    """A planted bug: the gemm that leaves out the last k (a missing accumulation) fails
    the bound, so the tests above can fail."""
    def short_gemm_ex(transa, transb, m, n, k, A, lda, B, ldb, C, ldc, storage):
        host_gemm_ex(transa, transb, m, n, k - 1, A, lda, B, ldb, C, ldc, storage)
    original = halfgemm.HalfGemm.__init__
    monkeypatch.setattr(halfgemm.HalfGemm, "__init__",
                        lambda self, narrow, gemm_ex: original(self, narrow, short_gemm_ex))
    with pytest.raises(AssertionError, match="bound"):
        _check(harness, "lstm", "bfloat16", seed=1)
