"""fusedrnn.cpu.CpuBackend.matmul, the op's large GEMMs: a @ b on the micro-kernel
above OWN_GEMM_WORK and a^T @ b on numpy's BLAS, each against float64 numpy into a
NaN-poisoned output, at sizes on both sides of the threshold; in a torch program
(config.TORCH_CALLER) everything but the micro-kernel's products on torch's GEMM."""
import numpy as np
import pytest

import fusedrnn.cpu as cpu
from fusedrnn.config import TORCH_CALLER
from fusedrnn.cpu import CpuBackend

TOL = {np.float32: 2e-6, np.float64: 1e-13}   # relative to max |a @ b|, K up to 3000


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("shape", [(21, 37, 17), (300, 3000, 301)])   # (M, K, C)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_matches_float64(monkeypatch, dtype, shape, transpose_a):
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
    own = not transpose_a and M * K * C >= cpu.OWN_GEMM_WORK and cpu.own_gemm(dtype)
    assert bool(calls) == own, "the micro-kernel ran where the rule says numpy (or back)"


@pytest.mark.parametrize("case", ["transposed", "small", "large", "negative strides",
                                  "read-only", "mixed dtypes"])
def test_a_torch_programs_gemms_go_to_its_gemm(monkeypatch, case):
    """With config.TORCH_CALLER holding torch's GEMM (a recording stand-in here), every
    product the micro-kernel does not take goes there, unless torch.from_numpy could not
    view its arrays (negative strides, read-only) or their dtypes differ: numpy then."""
    rng = np.random.default_rng(2)
    M, K, C = (300, 3000, 301) if case == "large" else (21, 37, 17)
    a = rng.standard_normal((K, M) if case == "transposed" else (M, K)).astype(np.float32)
    b = rng.standard_normal((K, C)).astype(np.float32)
    if case == "negative strides":
        b = b[::-1][::-1].copy()[::-1]
    if case == "read-only":
        a.flags.writeable = False
    if case == "mixed dtypes":
        b = b.astype(np.float64)
    out = np.full((M, C), np.nan, np.float32)
    calls = []
    monkeypatch.setattr(cpu, "project", lambda *args: calls.append("kernel") or
                        cpu.lowlevel.project(*args))

    def stand_in(a, b, out, transpose_a=False):
        calls.append("torch")
        return np.matmul(a.T if transpose_a else a, b, out=out)
    token = TORCH_CALLER.set(stand_in)
    try:
        CpuBackend.matmul(a, b, out, transpose_a=case == "transposed")
    finally:
        TORCH_CALLER.reset(token)
    want = (a.T if case == "transposed" else a).astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(out - want)) <= 1e-5 * np.max(np.abs(want))
    expected = {"transposed": ["torch"], "small": ["torch"], "large": ["kernel"]}
    assert calls == expected.get(case, []), case
