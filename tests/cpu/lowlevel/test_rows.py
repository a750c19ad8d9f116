"""fusedrnn.cpu.lowlevel.rows: each row move for every width 0..16 and both dtypes, at unaligned
addresses, into a NaN-poisoned buffer whose elements past the width (and just before
the row) must stay as they were; in-place adds; the sums in the documented order."""
import numba as nb
import numpy as np
import pytest

from fusedrnn.cpu.lowlevel.rows import (
    BLOCK_COLUMNS,
    row_add,
    row_add3,
    row_copy,
    row_round,
    row_zero,
    rows_to_columns,
)

OFFSET = 3   # rows start 3 elements into their buffers: no alignment is assumed


@nb.njit
def _moves(dst, a, b, c, width, kind):
    """kind 0: dst = a; 1: dst = a + b; 2: dst = a + b + c; 3: a += b in place.
    Each row starts OFFSET elements into its buffer."""
    s = dst.itemsize * OFFSET
    like = dst[0]
    if kind == 0:
        row_copy(dst.ctypes.data + s, a.ctypes.data + s, width, like)
    elif kind == 1:
        row_add(dst.ctypes.data + s, a.ctypes.data + s, b.ctypes.data + s, width, like)
    elif kind == 2:
        row_add3(dst.ctypes.data + s, a.ctypes.data + s, b.ctypes.data + s,
                 c.ctypes.data + s, width, like)
    else:
        row_add(a.ctypes.data + s, a.ctypes.data + s, b.ctypes.data + s, width, like)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_row_moves_write_exactly_width_elements(dtype, kind):
    rng = np.random.default_rng(100 + kind)
    for width in range(17):
        a, b, c = (rng.standard_normal(16 + 2 * OFFSET).astype(dtype) for _ in range(3))
        dst = np.full(16 + 2 * OFFSET, np.nan, dtype)
        a_before = a.copy()
        _moves(dst, a, b, c, width, kind)
        row = slice(OFFSET, OFFSET + width)
        want = [a, a + b, (a + b) + c, a_before + b][kind][row]
        got = (a if kind == 3 else dst)[row]
        np.testing.assert_array_equal(got, want)   # exact: one rounding per add, in order
        if kind == 3:
            np.testing.assert_array_equal(a[OFFSET + width:], a_before[OFFSET + width:])
            np.testing.assert_array_equal(a[:OFFSET], a_before[:OFFSET])
            assert np.isnan(dst).all()
        else:
            assert np.isnan(dst[:OFFSET]).all() and np.isnan(dst[OFFSET + width:]).all()


def test_row_moves_reject_a_float_address():
    @nb.njit
    def bad(x):
        row_copy(1.5, x.ctypes.data, 4, x[0])

    with pytest.raises(nb.core.errors.TypingError):
        bad(np.zeros(16))


@nb.njit
def _round(dst, src, width):
    row_round(dst.ctypes.data + 2 * OFFSET, src.ctypes.data + 4 * OFFSET, width)


def test_row_round_rounds_exactly_width_elements_as_round_rows():
    """row_round against bf16gemm's round_rows (nearest even, NaN kept quiet), every
    width, unaligned, into a poisoned buffer; ties, NaN, infinities, subnormals and
    values that round up to infinity included."""
    from fusedrnn.cpu.lowlevel import round_rows
    rng = np.random.default_rng(116)
    special = np.array([np.nan, -np.inf, np.inf, -0.0, 1e-40, -3e-39, 3.4e38,
                        np.float32(1 + 2 ** -8), np.float32(1 + 3 * 2 ** -8)], np.float32)
    for width in range(17):
        src = (rng.standard_normal(16 + 2 * OFFSET) *
               10.0 ** rng.integers(-30, 30, 16 + 2 * OFFSET)).astype(np.float32)
        src[OFFSET:OFFSET + len(special)] = special
        bits = src[OFFSET + 9:OFFSET + 16].view(np.uint32)
        src[OFFSET + 9:OFFSET + 16] = ((bits & 0xFFFF0000) | 0x8000).view(np.float32)  # ties
        dst = np.full(16 + 2 * OFFSET, 0x7777, np.uint16)
        _round(dst, src, width)
        want = np.zeros((1, 16 + 2 * OFFSET), np.uint16)
        round_rows(src[None], want)
        np.testing.assert_array_equal(dst[OFFSET:OFFSET + width],
                                      want[0, OFFSET:OFFSET + width])
        assert (dst[:OFFSET] == 0x7777).all() and (dst[OFFSET + width:] == 0x7777).all()


@nb.njit
def _zero_and_copy16(dst, src16, dst16, width, like):
    row_zero(dst.ctypes.data + dst.itemsize * OFFSET, width, like)
    row_copy(dst16.ctypes.data + 2 * OFFSET, src16.ctypes.data + 2 * OFFSET, width, np.uint16(0))
    row_zero(src16.ctypes.data + 2 * OFFSET, width, np.uint16(0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_zero_and_uint16_rows_touch_exactly_width_elements(dtype):
    """row_zero in the data's dtype and on uint16 rows (bfloat16 bits), row_copy of
    uint16 rows: every width, unaligned, the neighbours untouched."""
    rng = np.random.default_rng(117)
    for width in range(17):
        dst = np.full(16 + 2 * OFFSET, np.nan, dtype)
        src16 = rng.integers(1, 1 << 16, 16 + 2 * OFFSET).astype(np.uint16)
        before = src16.copy()
        dst16 = np.full(16 + 2 * OFFSET, 0x7777, np.uint16)
        _zero_and_copy16(dst, src16, dst16, width, dtype(0))
        row = slice(OFFSET, OFFSET + width)
        assert (dst[row] == 0).all() and np.isnan(np.delete(dst, np.r_[row])).all()
        np.testing.assert_array_equal(dst16[row], before[row])
        assert (np.delete(dst16, np.r_[row]) == 0x7777).all()
        assert (src16[row] == 0).all()
        np.testing.assert_array_equal(np.delete(src16, np.r_[row]), np.delete(before, np.r_[row]))


def test_row_sums_reject_integer_rows():
    @nb.njit
    def bad(x):
        row_add(x.ctypes.data, x.ctypes.data, x.ctypes.data, 4, np.uint16(0))

    with pytest.raises(nb.core.errors.TypingError):
        bad(np.zeros(16, np.uint16))


@nb.njit
def _transpose(dst, ldd, src, lds):
    """rows_to_columns from OFFSET elements into each buffer."""
    s = dst.itemsize * OFFSET
    rows_to_columns(dst.ctypes.data + s, ldd, src.ctypes.data + s, lds, dst[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_to_columns_moves_exactly_a_block_transposed(dtype):
    """16 rows' next BLOCK_COLUMNS columns (row strides wider than the block, unaligned)
    land as 16-wide rows, exactly; nothing else in dst is written."""
    cols, lds, ldd = BLOCK_COLUMNS[np.dtype(dtype).itemsize], 21, 19
    assert cols * np.dtype(dtype).itemsize == 32
    src = np.random.default_rng(7).standard_normal(2 * OFFSET + 16 * lds).astype(dtype)
    dst = np.full(2 * OFFSET + cols * ldd, np.nan, dtype)
    _transpose(dst, ldd, src, lds)
    block = src[OFFSET:OFFSET + 16 * lds].reshape(16, lds)[:, :cols]
    written = dst[OFFSET:OFFSET + cols * ldd].reshape(cols, ldd)
    np.testing.assert_array_equal(written[:, :16], block.T)
    assert np.isnan(written[:, 16:]).all() and np.isnan(dst[:OFFSET]).all()
    assert np.isnan(dst[OFFSET + cols * ldd:]).all()
