"""The cell loops of the fused kernels compile to SIMD code.

Results cannot show a scalar cell loop, only time can: for many sessions the GRU and
LSTM cells ran scalar (Numba's negative-index wraparound on the tile's columns, and
branches in the math; fused.py's note above _columns), costing 40% of a GRU loop, and
the ReLU cell too (a constant trip count). This reads the optimised LLVM IR of each
mode's fused forward and backward kernel, compiled afresh (the disk cache keeps no IR)
for the signature an op call gave it: it must hold vector floating-point compares,
multiplies, subtractions or divisions. Nothing else in those kernels makes them (the
row moves only add vectors; the micro-kernel uses llvm.fmuladd), so they come from the
vectorised cell.
"""
import re

import numba as nb
import numpy as np
import pytest

import fusedrnn
from fusedrnn.config import CELLS
from fusedrnn.cpu import fused
from fusedrnn.layout import param_size

CELL_VECTOR_OP = re.compile(r"= (fcmp \w+|fmul|fsub|fdiv)( \w+)* <\d+ x (float|double)>")


def _train_once(mode, dtype):
    """One fused training call (T > 1), which compiles the forward and backward kernels."""
    rng = np.random.default_rng(0)
    T, N, I, H = 3, 2, 4, 16
    params = rng.standard_normal(param_size(mode=mode, input_size=I, state_size=H))
    x = rng.standard_normal((T, N, I)).astype(dtype)
    out, handle = fusedrnn.RNN(x, (params * 0.1).astype(dtype), state_size=H, num_layers=1,
                               mode=mode, train=True)
    fusedrnn.rnn_backward(handle, np.ones_like(out))


# Each fresh compile takes ~15 s here: every mode both ways in float32, and float64 once
# (the same source in the other precision).
CASES = [(mode, np.float32, kernel) for mode in CELLS for kernel in ("_forward", "_backward")]
CASES.append(("lstm", np.float64, "_forward"))


@pytest.mark.parametrize("mode, dtype, kernel", CASES)
def test_cell_loop_is_vectorised(mode, dtype, kernel):
    dispatcher = getattr(fused.fused_layer(mode, dtype), kernel)
    if not dispatcher.signatures:
        _train_once(mode, dtype)
    assert dispatcher.signatures, f"{mode} {kernel}: the op call did not launch it"
    signature = dispatcher.signatures[0]
    fresh = nb.njit(parallel=True, nogil=True)(dispatcher.py_func)
    fresh.compile(signature)
    ir = fresh.inspect_llvm(signature)
    assert CELL_VECTOR_OP.search(ir), f"{mode} {np.dtype(dtype)} {kernel}: the cell loop is scalar"
