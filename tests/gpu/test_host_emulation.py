"""The GPU backend's host side without a GPU.

cells.cuh is built as plain C++ (g++, host_harness.cpp) and driven through the GPU
backend's own argument packing and launch wrappers (fusedrnn.gpu.kernels.CellKernels),
inside the shared recurrence: every mode x layers x directions x dtype must equal the
CPU backend. What this cannot cover: the grid-stride loop of the __global__ kernels
and CuPy itself (tests/gpu/test_parity.py, on a GPU)."""
import numpy as np
import pytest

from fusedrnn.config import CallOptions, RNNConfig
from fusedrnn.cpu import BACKEND as CPU
from fusedrnn.gpu import kernels

from conftest import MODES, make_case, rel_err
from host_backend import HostCudaBackend, build_harness
from host_backend import run_training as _run


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build_harness(tmp_path_factory.mktemp("harness"))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_cells_on_host_equal_cpu_backend(harness, mode, L, D, dtype):
    case, kw, heads = make_case(mode, T=5, N=3, I=4, H=5, L=L, D=D, dtype=dtype, seed=L + D)
    got = _run(HostCudaBackend(harness), case, kw, heads, dtype)
    want = _run(CPU, case, kw, heads, dtype)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol


LENGTHS = CallOptions(lengths=np.array([5, 1, 3], np.int64))
CLIPPED = dict(clip_lo=-0.3, clip_hi=0.25, clip_flags=3)


def _projected_case(L, D, dtype, seed, P=2):
    """make_case's arrays resized for an LSTM with projection P < H."""
    case, kw, heads = make_case("lstm", T=5, N=3, I=4, H=5, L=L, D=D, dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed)
    size = RNNConfig("lstm", 4, 5, L, D == 2, P)
    from fusedrnn.layout import ParamLayout
    case["parameters"] = rng.uniform(-0.5, 0.5, ParamLayout(size).size).astype(dtype)
    case["state"] = case["state"][..., :P].copy()
    heads["dout"] = heads["dout"][..., :D * P].copy()
    heads["dhy"] = heads["dhy"][..., :P].copy()
    return case, kw, heads


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_cells_with_lengths_equal_cpu_backend(harness, mode, D, dtype):
    case, kw, heads = make_case(mode, T=5, N=3, I=4, H=5, L=2, D=D, dtype=dtype, seed=D)
    got = _run(HostCudaBackend(harness), case, kw, heads, dtype, LENGTHS)
    want = _run(CPU, case, kw, heads, dtype, LENGTHS)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol


@pytest.mark.parametrize("projection", [None, 2])
@pytest.mark.parametrize("options", [CallOptions(**CLIPPED),
                                     CallOptions(lengths=LENGTHS.lengths, **CLIPPED), LENGTHS],
                         ids=["clip", "clip+lengths", "lengths"])
@pytest.mark.parametrize("D", [1, 2])
def test_cuda_lstm_features_equal_cpu_backend(harness, D, options, projection):
    if projection:
        case, kw, heads = _projected_case(2, D, np.float64, seed=4)
    else:
        case, kw, heads = make_case("lstm", T=5, N=3, I=4, H=5, L=2, D=D, seed=4)
    got = _run(HostCudaBackend(harness), case, kw, heads, np.float64, options, projection)
    want = _run(CPU, case, kw, heads, np.float64, options, projection)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("persistent", [False, True], ids=["per-step", "persistent"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_half_precision_through_the_gpu_backend_equals_cpu_backend(harness, mode, dtype,
                                                                   persistent):
    """float16 (CuPy's) and bfloat16 (what the torch layer hands CuPy as float32, here as
    ml_dtypes arrays to reach the same recurrence) run the GPU backend's float32 kernels
    between the op's conversions. float16: the CPU backend's results to one unit in the
    last place (the float32 results differ by ~1e-7 and may round apart). bfloat16: the
    CPU's products hold h in bfloat16 where it has AVX512-BF16, so the two agree to
    test_precision's bound (each is within it of float64)."""
    import ml_dtypes

    from fusedrnn.gpu.persistent import DeviceLimits
    half = np.dtype(np.float16) if dtype == "float16" else np.dtype(ml_dtypes.bfloat16)
    case, kw, heads = make_case(mode, T=5, N=3, I=4, H=5, L=2, D=2, seed=6)
    case = {k: None if v is None else v.astype(half) for k, v in case.items()}
    heads = {k: None if v is None else v.astype(half) for k, v in heads.items()}
    backend = HostCudaBackend(harness, DeviceLimits(4, 1 << 20) if persistent else None)
    got = _run(backend, case, kw, heads, half)
    want = _run(CPU, case, kw, heads, half)
    for a, b in zip(got, want):
        assert a.dtype == half
        a, b = a.astype(np.float64), b.astype(np.float64)
        if dtype == "float16":
            assert np.all(np.abs(a - b) <= 2.0 ** -10 * np.maximum(np.abs(b), 2.0 ** -14))
        else:
            assert np.max(np.abs(a - b)) <= 2 * 2 * 2.0 ** -8 * np.max(np.abs(b))
    assert not persistent or backend.launches


def test_grid_size():
    assert kernels.grid_size(1) == 1
    assert kernels.grid_size(256) == 1
    assert kernels.grid_size(257) == 2
    assert kernels.grid_size(20 * 800) == 63
    assert kernels.grid_size(2 ** 50) == 2 ** 31 - 1  # capped: the kernels grid-stride


def test_packing_gives_row_strides_and_refuses_strided_columns():
    buf = np.zeros((4, 3, 10))
    step = (np.empty(0, np.int64), 0, 0.0, 0.0, 0)
    args, n = kernels.step_forward_args(*(buf[0, :, :8],) * 2, np.zeros(8), np.zeros(8),
                                        *(buf[1, :, 2:4],) * 5, np.empty((0, 0)), *step)
    assert n == 6 and args[1] == 10 and args[17] == 0      # ld of a view; placeholder ld 0
    assert [int(a) for a in args[-2:]] == [3, 2]           # N, H
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.step_forward_args(buf[0, :, ::2], *(buf[0],) * 9, *step)


def test_kernel_names_cover_every_mode_and_dtype():
    names = kernels.STEP_KERNELS.all_kernel_names()
    assert len(set(names)) == 16
    assert "fusedrnn::backward_step<fusedrnn::GruCell, double>" in names
