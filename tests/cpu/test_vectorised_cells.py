"""The cell loops of the fused kernels compile to SIMD code.

Results cannot show a scalar cell loop, only time can: for many sessions the GRU and
LSTM forward cells ran scalar (Numba's negative-index wraparound on the tile's columns,
and branches in the math; fused.py's note above _columns), costing 40% of a GRU loop,
and the ReLU cell too (a constant trip count). This reads the optimised LLVM IR of each
mode's fused kernels, compiled afresh (the disk cache keeps no IR) for the signature an
op call gave them: it must hold vector floating-point compares, multiplies, subtractions
or divisions at least a 256-bit register wide (8 float32 or 4 float64 lanes). Nothing
else in those kernels makes them (the row moves only add vectors; the micro-kernel uses
llvm.fmuladd; workshare.py is integer code), so they come from the vectorised cell.
On the commit before the fix, the GRU and LSTM forward cases fail (their backward
cells and the rest already vectorised). The serial builds too, which small calls run:
under Python's error model (before threads.KERNEL_OPTIONS) their cell loops were scalar.
"""
import re

import numpy as np
import pytest

from fusedrnn.config import CELLS
from fusedrnn.cpu import fused

from conftest import FRESH_COMPILE, fresh_compile, launch_fused

pytestmark = FRESH_COMPILE

CELL_VECTOR_OP = re.compile(r"= (?:fcmp \w+|fmul|fsub|fdiv)(?: \w+)* <(\d+) x (float|double)>")
MIN_LANES = {"float": 8, "double": 4}


# A fresh compile per case, so not the whole product: every mode both ways in float32,
# float64 once (the same source in the other precision), the T=1 form once (its own
# compilation, and the same cell code as the loop's; LSTM's, whose compile
# test_parallel_regions.py reads too), and the serial builds of one cell each way.
CASES = [(mode, np.float32, kernel) for mode in CELLS for kernel in ("_forward", "_backward")]
CASES += [("lstm", np.float64, "_forward"), ("lstm", np.float32, "_forward_single"),
          ("lstm", np.float32, "_forward_serial"), ("gru", np.float32, "_backward_serial")]


@pytest.mark.parametrize("mode, dtype, kernel", CASES)
def test_cell_loop_is_vectorised(monkeypatch, mode, dtype, kernel):
    serial = kernel.endswith("_serial")
    for bound in ("SERIAL_WORK", "SERIAL_POINTWISE", "SERIAL_LOOP_WORK"):   # (the build
        monkeypatch.setattr(fused, bound, 1 << 62 if serial else -1)      # tested runs)
    dispatcher = getattr(fused.fused_layer(mode, dtype), kernel)
    if not dispatcher.signatures:
        launch_fused(mode, dtype, 1 if kernel == "_forward_single" else 3)
    assert dispatcher.signatures, f"{mode} {kernel}: the op call did not launch it"
    signature = dispatcher.signatures[0]
    llvm = fresh_compile(dispatcher, signature, parallel=not serial).llvm
    wide = [m for m in CELL_VECTOR_OP.finditer(llvm)
            if int(m.group(1)) >= MIN_LANES[m.group(2)]]
    assert wide, f"{mode} {np.dtype(dtype)} {kernel}: the cell loop is scalar"
