"""fusedrnn.cpu.lowlevel.rows: each row move for every width 0..16 and both dtypes, at unaligned
addresses, into a NaN-poisoned buffer whose elements past the width (and just before
the row) must stay as they were; in-place adds; the sums in the documented order."""
import numba as nb
import numpy as np
import pytest

from fusedrnn.cpu.lowlevel.rows import row_add, row_add3, row_copy

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
