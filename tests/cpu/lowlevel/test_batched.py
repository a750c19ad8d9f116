"""A single step's backward products in one region (fusedrnn/cpu/lowlevel/batched.py)
against float64 numpy: B read in place or packed by strips, A by rows or by columns,
partial panels, on a team, on Numba's layer and serial."""
import numpy as np
import pytest

from fusedrnn.cpu.lowlevel import batched as module
from fusedrnn.cpu.lowlevel import job_rows, products
from fusedrnn.cpu.team import Team

TOL = {np.float32: 1e-5, np.float64: 1e-12}   # of |A| @ |B|, elementwise (test_gemm's)


def _jobs(rng, dtype, shapes):
    """(jobs for job_rows, float64 (references, |A| @ |B|)) of (M, K, C, by_columns) shapes, each
    operand a strided view inside a larger poisoned array (outputs NaN before the call)."""
    jobs, want = [], []
    for M, K, C, by_columns in shapes:
        if by_columns:   # A^T's storage (K, M), as dG^T @ x reads dG
            a = rng.standard_normal((K, M + 3)).astype(dtype)[:, 1:M + 1]
            A = a.T
        else:
            a = rng.standard_normal((M, K + 5)).astype(dtype)[:, 2:K + 2]
            A = a
        b = rng.standard_normal((K, C + 7)).astype(dtype)[:, 3:C + 3]
        out = np.full((M, C + 2), np.nan, dtype)[:, 1:C + 1]
        jobs.append((a, b, out, by_columns))
        want.append((A.astype(np.float64) @ b.astype(np.float64),
                     np.abs(A).astype(np.float64) @ np.abs(b).astype(np.float64)))
    return jobs, want


SHAPES = [
    [(8, 1536, 512, False), (1536, 8, 512, True)],      # GRU T=1 N=8 H=512's two forms
    [(130, 77, 35, False), (97, 5, 19, True)],          # partial panels, two row chunks
    [(40, 600, 64, False), (70, 40, 100, False)],       # strips packed (K and rows past the bounds)
    [(229, 33, 100, True), (100, 17, 64, True)],        # A^T's blocks packed: row tails
    [(1, 3, 1, False), (3, 0, 17, True), (5, 1, 16, True)],   # one element, k = 0, k = 1
]


@pytest.fixture(scope="module")
def team():
    """One team for the module (its helpers live as long as the process)."""
    return Team()


@pytest.fixture(params=["team", "layer", "serial"])
def run(request, monkeypatch, team):
    """products(...) on a team of our own, on Numba's layer, or its serial build."""
    team = team if request.param == "team" else None
    if request.param == "serial":
        monkeypatch.setattr(module, "SERIAL_WORK", 1 << 62)
    else:
        monkeypatch.setattr(module, "SERIAL_WORK", -1)
    return lambda jobs, items, like, work: products(jobs, items, like, work, team)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shapes", SHAPES)
def test_products_match_float64_reference(run, dtype, shapes):
    rng = np.random.default_rng(len(shapes) * 100 + shapes[0][0])
    jobs, want = _jobs(rng, dtype, shapes)
    rows, items, work = job_rows(jobs, np.dtype(dtype))
    assert work == sum(M * K * C for M, K, C, _ in shapes)
    run(rows, items, np.dtype(dtype).type(0), work)
    for (_, _, out, _), (ref, scale) in zip(jobs, want, strict=True):
        assert np.isfinite(out).all()
        assert (np.abs(out - ref) <= TOL[dtype] * scale).all()


def test_nothing_past_each_output_is_written(monkeypatch, team):
    """The outputs' neighbours in their larger arrays stay NaN (the partial panels' columns
    go through a spill)."""
    monkeypatch.setattr(module, "SERIAL_WORK", -1)   # (on the team, whatever the size)
    rng = np.random.default_rng(7)
    jobs, _ = _jobs(rng, np.float32, SHAPES[1])
    bases = [out.base for _, _, out, _ in jobs]
    rows, items, work = job_rows(jobs, np.dtype(np.float32))
    products(rows, items, np.float32(0), work, team)
    for base, (_, _, out, _) in zip(bases, jobs, strict=True):
        assert np.isnan(base[:, 0]).all() and np.isnan(base[:, -1]).all()
        assert np.isfinite(out).all()


def test_the_scratch_holds_each_workers_strip_and_block(monkeypatch):
    """_strips_for: a row per Numba thread wide enough for QUAD packed panels of k rows and,
    by columns, an item's block of A (ITEM_ROWS x k) after them."""
    monkeypatch.setattr(module, "_strips", module.threading.local())   # (none kept yet)
    rng = np.random.default_rng(5)
    jobs, _ = _jobs(rng, np.float32, [(229, 33, 100, True)])
    rows = job_rows(jobs, np.dtype(np.float32))[0]
    held = module._strips_for(rows, np.dtype(np.float32))
    assert held.shape[0] >= module.nb.config.NUMBA_NUM_THREADS
    assert held.shape[1] >= 33 * (module.QUAD * module.PANEL + module.ITEM_ROWS)


@pytest.mark.parametrize("bad", ["dtype", "column stride", "reversed rows", "k", "columns",
                                 "rows of A^T"])
def test_job_rows_refuses_what_the_kernel_cannot_read(bad):
    a, b = np.ones((4, 8), np.float32), np.ones((8, 16), np.float32)
    out, by_columns = np.empty((4, 16), np.float32), False
    if bad == "dtype":
        b = b.astype(np.float64)
    elif bad == "column stride":
        a = np.ones((4, 16), np.float32)[:, ::2]
    elif bad == "reversed rows":
        a = a[::-1]
    elif bad == "k":
        b = np.ones((9, 16), np.float32)
    elif bad == "columns":
        out = np.empty((4, 17), np.float32)
    else:   # A^T's storage (K, M) read as (M, K)
        by_columns = True
    match = "unit column strides" if bad in ("dtype", "column stride", "reversed rows") \
        else r"\(M, K\) @ \(K, C\)"
    with pytest.raises(ValueError, match=match):
        job_rows([(a, b, out, by_columns)], np.dtype(np.float32))
