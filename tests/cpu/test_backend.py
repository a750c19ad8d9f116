"""fusedrnn.cpu.CpuBackend.matmul, the op's large GEMMs: a @ b on the micro-kernel
above OWN_GEMM_WORK and a^T @ b on numpy's BLAS (an outer product on the micro-kernel
from OUTER_OWN_ELEMENTS, numpy's multiply below),
each against float64 numpy into a NaN-poisoned output, at sizes on both sides of the
threshold; in a torch program (config.TORCH_CALLER) every product past HOST_GEMM_WORK but
the micro-kernel's on torch's GEMM (smaller ones as in a numpy program), and large float32
weight gradients as torch's transpose, then the micro-kernel."""
import numpy as np
import pytest

import fusedrnn.cpu as cpu
from fusedrnn.config import TORCH_CALLER
from fusedrnn.cpu import CpuBackend
from fusedrnn.cpu.lowlevel import VECTOR_BITS

TOL = {np.float32: 2e-6, np.float64: 1e-13}   # relative to max |a @ b|, K up to 3000


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("shape", [(21, 37, 17), (300, 3000, 301), (70, 1, 45),
                                   (128, 1, 64)])  # (M, K, C)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_matches_float64(monkeypatch, dtype, shape, transpose_a):
    """K = 1: a^T @ b an outer product (a T=1 N=1 weight gradient), on the micro-kernel
    where own_gemm from OUTER_OWN_ELEMENTS (numpy's matmul loops over it without BLAS),
    else numpy's multiply."""
    M, K, C = shape
    rng = np.random.default_rng([M, K, C])
    # a as the op passes it: for a^T @ b a column slice of a wider matrix (row stride >
    # its width), as dG's columns of one direction are.
    wide = rng.standard_normal((K, 2 * M) if transpose_a else (M, K)).astype(dtype)
    a = wide[:, M:] if transpose_a else wide
    b = rng.standard_normal((K, C)).astype(dtype)
    out = np.full((M, C), np.nan, dtype)
    calls = []
    monkeypatch.setattr(cpu, "project", lambda *args: calls.append(1) or
                        cpu.lowlevel.project(*args))
    CpuBackend.matmul(a, b, out, transpose_a=transpose_a)
    want = (a.T if transpose_a else a).astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(out - want)) <= TOL[dtype] * np.max(np.abs(want))
    own = (transpose_a and K == 1 and M * C >= cpu.OUTER_OWN_ELEMENTS
           or not transpose_a and M * K * C >= cpu.OWN_GEMM_WORK) and cpu.own_gemm(dtype)
    assert bool(calls) == own, "the micro-kernel ran where the rule says numpy (or back)"


class StandIn:
    """What config.TORCH_CALLER holds in a torch program (torch's operations), on numpy,
    recording each call in `calls`."""

    def __init__(self, calls):
        self.calls = calls

    def matmul(self, a, b, out, transpose_a=False):
        self.calls.append("torch")
        return np.matmul(a.T if transpose_a else a, b, out=out)

    def transpose(self, a, out):
        self.calls.append("transpose")
        np.copyto(out, a.T)
        return out

    @staticmethod
    def deterministic():
        return False


# case: (M, K, C, transpose_a, dtype, what runs); 65 * 64 * 64 is just past HOST_GEMM_WORK
TORCH_CASES = {
    "transposed": (65, 64, 64, True, np.float32, ["torch"]),
    "outer product": (1024, 1, 1024, True, np.float32, ["torch"]),   # (torch's mm is quick)
    "medium": (65, 64, 64, False, np.float32, ["torch"]),
    "at HOST_GEMM_WORK": (64, 64, 64, False, np.float32, []),   # numpy's
    "small, transposed": (21, 37, 17, True, np.float32, []),
    "small outer product": (21, 1, 17, True, np.float32, []),
    # a gemv (one row or column) from BLAS_SERIAL_WORK (OpenBLAS may thread gemvs from 9216)
    "gemv": (1, 128, 128, False, np.float32, ["torch"]),
    "gemv, transposed": (128, 128, 1, True, np.float32, ["torch"]),
    "gemv at BLAS_SERIAL_WORK": (1, 64, 128, False, np.float32, []),
    "large": (300, 3000, 301, False, np.float32, ["kernel"]),
    # a^T @ b at OWN_GRADIENT_* (512 * 2048 * 512 = 2^29): torch's transpose, our kernel
    "weight gradient": (512, 2048, 512, True, np.float32, ["transpose", "kernel"]),
    "weight gradient, narrow": (512, 4096, 256, True, np.float32, ["torch"]),
    "weight gradient, small": (512, 1024, 512, True, np.float32, ["torch"]),
    "weight gradient, float64": (512, 2048, 512, True, np.float64, ["torch"]),
    "negative strides": (65, 64, 64, False, np.float32, []),
    "read-only": (65, 64, 64, False, np.float32, []),
    "mixed dtypes": (65, 64, 64, False, np.float32, []),
}


@pytest.mark.parametrize("case", TORCH_CASES)
def test_a_torch_programs_gemms_go_to_torch(monkeypatch, case):
    """With config.TORCH_CALLER holding torch's operations (a recording stand-in here),
    every product past HOST_GEMM_WORK the micro-kernel does not take goes to torch's GEMM,
    and a large float32 weight gradient to torch's transpose and then the micro-kernel;
    numpy's BLAS at HOST_GEMM_WORK or below (a gemv: BLAS_SERIAL_WORK; an outer product on
    numpy's multiply), and
    where torch.from_numpy could not view the arrays (negative strides, read-only) or
    their dtypes differ."""
    assert 64 * 64 * 64 == cpu.HOST_GEMM_WORK and 64 * 128 == cpu.BLAS_SERIAL_WORK
    M, K, C, transpose_a, dtype, expected = TORCH_CASES[case]
    rng = np.random.default_rng(2)
    wide = rng.standard_normal((K, M + 3) if transpose_a else (M, K)).astype(dtype)
    a = wide[:, 3:] if transpose_a else wide   # dG's columns of one direction: strided rows
    b = rng.standard_normal((K, C)).astype(dtype)
    if case == "negative strides":
        b = b[::-1][::-1].copy()[::-1]
    if case == "read-only":
        a.flags.writeable = False
    if case == "mixed dtypes":
        b = b.astype(np.float64)
    out = np.full((M, C), np.nan, dtype)
    calls = []
    monkeypatch.setattr(cpu, "project", lambda *args: calls.append("kernel") or
                        cpu.lowlevel.project(*args))
    token = TORCH_CALLER.set(StandIn(calls))
    try:
        CpuBackend.matmul(a, b, out, transpose_a=transpose_a)
    finally:
        TORCH_CALLER.reset(token)
    want = (a.T if transpose_a else a).astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(out - want)) <= TOL[dtype] * np.max(np.abs(want))
    assert calls == expected, case


@pytest.mark.skipif(not cpu.HAS_BF16, reason="the CPU has no AVX512-BF16")
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("shape", [(21, 37, 17), (300, 3000, 301)])   # (M, K, C)
def test_matmul_on_bfloat16_pairs(shape, transpose_a):
    """With `pairs` (the op's bfloat16 data, CpuBackend.pair_products) a @ b and a^T @ b
    round a and b to bfloat16 and sum in float32: against float64 of the rounded values,
    within float32 summation's bound, and not the float32 product (the rounding is real)."""
    import ml_dtypes
    M, K, C = shape
    rng = np.random.default_rng([M, K, C, 2])
    wide = rng.standard_normal((K, 2 * M) if transpose_a else (M, K)).astype(np.float32)
    a = wide[:, M:] if transpose_a else wide
    b = rng.standard_normal((K, C)).astype(np.float32)
    assert CpuBackend.pair_products("bfloat16") and not CpuBackend.pair_products("float16")
    pairs = np.full(CpuBackend.pair_scratch(M, K, C), 0xDEADBEEF, np.uint32)
    out = np.full((M, C), np.nan, np.float32)
    CpuBackend.matmul(a, b, out, transpose_a=transpose_a, pairs=pairs)
    rounded = [x.astype(ml_dtypes.bfloat16).astype(np.float64) for x in (a, b)]
    a64, b64 = (rounded[0].T if transpose_a else rounded[0]), rounded[1]
    want = a64 @ b64
    assert np.max(np.abs(out - want)) <= 4 * K * 2.0 ** -24 * np.max(np.abs(a64) @ np.abs(b64))
    full = (a.T if transpose_a else a).astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(out - full)) > 1e-4 * np.max(np.abs(full))


@pytest.mark.skipif(not cpu.HAS_BF16, reason="the CPU has no AVX512-BF16")
@pytest.mark.parametrize("transpose_a", [False, True])
def test_a_paired_reuses_only_the_same_a(transpose_a):
    """matmul(..., a_paired=True) takes a's pairs from the scratch only where this
    thread's last pair product made them from this very a; after another a it makes them
    again. Either way the result is the product of a and b."""
    M, K, C = 40, 64, 24
    rng = np.random.default_rng(5)
    shape = (K, M) if transpose_a else (M, K)
    a1, a2 = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    b1, b2 = (rng.standard_normal((K, C)).astype(np.float32) for _ in range(2))
    pairs = np.zeros(CpuBackend.pair_scratch(M, K, C), np.uint32)

    def product(a, b, **kw):
        out = np.full((M, C), np.nan, np.float32)
        return CpuBackend.matmul(a, b, out, transpose_a=transpose_a, pairs=pairs, **kw)
    want = {(i, j): product(a, b) for i, a in enumerate((a1, a2))
            for j, b in enumerate((b1, b2))}
    product(a1, b1)
    assert np.array_equal(product(a1, b2, a_paired=True), want[0, 1])   # reused
    assert np.array_equal(product(a2, b2, a_paired=True), want[1, 1])   # another a: made
    assert np.array_equal(product(a2.copy(), b1, a_paired=True), want[1, 0])


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("K", [1, 5])
def test_the_first_tiers_matmul_matches_float64(K, transpose_a):
    """The first tier's products (numpy only, nothing compiled), the outer product too."""
    from fusedrnn.cpu.firsttier import FirstTierBackend
    rng = np.random.default_rng(K)
    M, C = 30, 20
    a = rng.standard_normal((K, M) if transpose_a else (M, K)).astype(np.float32)
    b = rng.standard_normal((K, C)).astype(np.float32)
    out = np.full((M, C), np.nan, np.float32)
    FirstTierBackend.matmul(a, b, out, transpose_a=transpose_a)
    want = (a.T if transpose_a else a).astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(out - want)) <= TOL[np.float32] * np.max(np.abs(want))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_single_steps_products_go_together_between_the_bounds(dtype):
    """step_products: float32 at either width and float64 on 512-bit tiles (where the
    micro-kernel runs its products), up to STEP_PRODUCTS_MOST; in a numpy program past
    STEP_PRODUCTS_WORK, in a torch program from the smallest."""
    dtype = np.dtype(dtype)
    own = dtype == np.float32 or VECTOR_BITS == 512
    low, most = cpu.STEP_PRODUCTS_WORK, cpu.STEP_PRODUCTS_MOST
    assert [CpuBackend.step_products(dtype, w) for w in (low, low + 1, most, most + 1)] == \
        [False, own, own, False]
    token = TORCH_CALLER.set(StandIn([]))
    try:
        assert [CpuBackend.step_products(dtype, w) for w in (1, low, most, most + 1)] == \
            [own, own, own, False]
    finally:
        TORCH_CALLER.reset(token)


@pytest.mark.parametrize("kind, want", [
    ("znver3", 1 << 62),       # measured: together at every size on Zen 3
    ("rocketlake", 1 << 28),   # measured there: BLAS in parts won past it
    ("znver5", 1 << 28)])      # unmeasured kinds keep the Intel machine's
def test_the_single_steps_upper_bound_by_cpu_kind(kind, want):
    assert cpu.step_products_most(kind) == want


def test_the_single_steps_upper_bound_is_this_machines():
    import llvmlite.binding as llvm
    assert cpu.STEP_PRODUCTS_MOST == cpu.step_products_most(llvm.get_host_cpu_name())


@pytest.mark.parametrize("l2", [1 << 19, 1 << 20])
@pytest.mark.parametrize("itemsize", [4, 8])
@pytest.mark.parametrize("program", ["numpy", "torch"])
def test_a_sequences_products_fit_their_bounds(monkeypatch, program, itemsize, l2):
    """sequence_products_fit (Zen 5's bounds, on any kind): T*N rows up to where an item's A
    and B strips (ITEM_ROWS + QUAD panels of elements per row) fill the bounds' number of
    L2 caches, and the largest GEMM up to its `most` multiply-adds, whichever binds first."""
    monkeypatch.setattr(cpu, "SEQUENCE_PRODUCTS", cpu.sequence_products_bounds("znver5"))
    caches, most = cpu.SEQUENCE_PRODUCTS[program]
    rows = caches * l2 // ((cpu.ITEM_ROWS + cpu.QUAD * cpu.PANEL) * itemsize)
    fit = [cpu.sequence_products_fit(program, r, itemsize, w, l2)
           for r, w in ((rows, most), (rows + 1, 1), (1, most + 1), (1, 1))]
    assert fit == [True, False, False, True]


@pytest.mark.parametrize("kind, on", [("znver5", True), ("znver3", False), ("rocketlake", False)])
def test_a_sequences_bounds_by_cpu_kind(monkeypatch, kind, on):
    """Measured kinds have their bounds, a torch program's (torch's GEMMs apart) the tighter;
    other kinds run even the smallest sequence's products apart. This machine's are its
    kind's."""
    import llvmlite.binding as llvm
    assert cpu.SEQUENCE_PRODUCTS == cpu.sequence_products_bounds(llvm.get_host_cpu_name())
    bounds = cpu.sequence_products_bounds(kind)
    if on:
        assert all(t < n for t, n in zip(bounds["torch"], bounds["numpy"], strict=True))
    monkeypatch.setattr(cpu, "SEQUENCE_PRODUCTS", bounds)
    assert [cpu.sequence_products_fit(p, 1, 4, 1) for p in ("numpy", "torch")] == [on, on]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_a_sequences_products_go_together_by_program(monkeypatch, dtype):
    """sequence_products with Zen 5's bounds: float32, and float64 on 512-bit tiles, where
    its program's bounds hold at this machine's L2; never another dtype."""
    bounds = cpu.sequence_products_bounds("znver5")
    monkeypatch.setattr(cpu, "SEQUENCE_PRODUCTS", bounds)
    dtype = np.dtype(dtype)
    own = dtype == np.float32 or (dtype == np.float64 and VECTOR_BITS == 512)
    per_row = (cpu.ITEM_ROWS + cpu.QUAD * cpu.PANEL) * dtype.itemsize
    rows = bounds["numpy"][0] * cpu.L2_BYTES // per_row
    assert 64 <= bounds["torch"][0] * cpu.L2_BYTES // per_row < rows   # (the cases below)
    # rows past a torch program's L2 caches and within a numpy program's, at either's `most`
    cases = [(64, 1 << 20), (rows, 1 << 20), (rows + 1, 1 << 20), (64, 1 << 30)]
    assert [CpuBackend.sequence_products(dtype, r, w) for r, w in cases] == \
        [own, own, False, own]
    token = TORCH_CALLER.set(StandIn([]))
    try:
        assert [CpuBackend.sequence_products(dtype, r, w) for r, w in cases] == \
            [own, False, False, False]
    finally:
        TORCH_CALLER.reset(token)
