"""Every prange of every parallel CPU kernel becomes a parallel loop.

Numba quietly runs a prange it cannot transform as a plain range (fa0b7e6: a conditional
inside prange(...) made the fused forward serial, every call 2.5x slower, and every
result still right). Results cannot show it, so this reads Numba's parfor diagnostics:
each kernel, compiled afresh (diagnostics are not kept in the disk cache) for the first
signature a few op calls gave it, must have a parallel loop on each of its prange lines.
"""
import inspect

import numpy as np
import pytest

import fusedrnn
from fusedrnn.cpu import cells, fused
from fusedrnn.cpu.lowlevel import gemm, packing
from fusedrnn.layout import param_size
from conftest import fresh_compile

MODE, DTYPE = "lstm", np.float32


def _exercise():
    """Op calls that launch every kernel below at least once: a fused T>1 training call,
    a fused T=1 call (on the parallel builds, which its size alone would not pick) and a
    projected LSTM (the generic per-step path)."""
    limits = fused.SERIAL_WORK, fused.SERIAL_POINTWISE
    fused.SERIAL_WORK = fused.SERIAL_POINTWISE = -1
    try:
        _calls()
    finally:
        fused.SERIAL_WORK, fused.SERIAL_POINTWISE = limits


def _calls():
    rng = np.random.default_rng(0)
    for T, projection in ((4, None), (1, None), (3, 3)):
        I, H, N = 5, 6, 3
        size = param_size(mode=MODE, input_size=I, state_size=H, projection_size=projection)
        params = rng.standard_normal(size).astype(DTYPE) * 0.1
        x = rng.standard_normal((T, N, I)).astype(DTYPE)
        h0 = np.zeros((1, N, projection or H), DTYPE)
        c0 = np.zeros((1, N, H), DTYPE)
        out, handle = fusedrnn.RNN(x, params, h0, c0, state_size=H, num_layers=1, mode=MODE,
                                   projection_size=projection, train=True)
        fusedrnn.rnn_backward(handle, np.ones_like(out))


def kernels():
    layer = fused.fused_layer(MODE, DTYPE)
    return {"gemm._project": gemm._project, "packing._pack_rows_at": packing._pack_rows_at,
            "packing._pack_recurrent": packing._pack_recurrent,
            "packing._pack_recurrent_rows": packing._pack_recurrent_rows,
            "fused forward": layer._forward, "fused forward_single": layer._forward_single,
            "fused backward": layer._backward,
            **{f"cells {launch.kernel.py_func.__name__}": launch.kernel
               for launch in cells.cell_kernels(MODE, DTYPE)}}


@pytest.mark.parametrize("name", sorted(kernels()))
def test_every_prange_is_a_parallel_loop(name):
    kernel = kernels()[name]
    if not kernel.signatures:
        _exercise()
    assert kernel.signatures, f"{name}: no op call launched it"
    lines, first = inspect.getsourcelines(kernel.py_func)
    prange_lines = {first + i for i, line in enumerate(lines) if "prange(" in line.split("#")[0]}
    assert prange_lines, name
    signature = kernel.signatures[0]   # the loop structure does not depend on the types
    fresh = fresh_compile(kernel, signature)
    diagnostics = fresh.get_metadata(signature)["parfor_diagnostics"]
    parallel_lines = {parfor.loc.line for parfor in diagnostics.initial_parfors}
    assert prange_lines <= parallel_lines, \
        f"{name}: the prange on lines {sorted(prange_lines - parallel_lines)} runs serially"
