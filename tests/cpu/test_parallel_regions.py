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

from conftest import FRESH_COMPILE, fresh_compile

pytestmark = FRESH_COMPILE

MODE, DTYPE = "lstm", np.float32


def _exercise():
    """Op calls that launch every kernel below at least once: a fused T>1 training call,
    a fused T=1 call (on the parallel builds, which its size alone would not pick) and a
    projected LSTM (the generic per-step path)."""
    limits = (fused.SERIAL_WORK, fused.SERIAL_POINTWISE, fused.SERIAL_LOOP_WORK,
              gemm.SERIAL_WORK, packing.SERIAL_ELEMENTS)
    # (the loops, the projection and the packers too: at these sizes they would take
    # their serial builds, and run alone this file then found no launch of the parallel
    # ones)
    fused.SERIAL_WORK = fused.SERIAL_POINTWISE = fused.SERIAL_LOOP_WORK = -1
    gemm.SERIAL_WORK = packing.SERIAL_ELEMENTS = -1
    team, fused.TEAM = fused.TEAM, None   # (a team launches the serial builds)
    try:
        _calls()
    finally:
        fused.TEAM = team
        (fused.SERIAL_WORK, fused.SERIAL_POINTWISE, fused.SERIAL_LOOP_WORK,
         gemm.SERIAL_WORK, packing.SERIAL_ELEMENTS) = limits


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
    # the loop structure does not depend on the types
    _assert_every_prange_parallel(name, kernel, kernel.signatures[0])


def _assert_every_prange_parallel(name, kernel, signature):
    lines, first = inspect.getsourcelines(kernel.py_func)
    prange_lines = {first + i for i, line in enumerate(lines) if "prange(" in line.split("#")[0]}
    assert prange_lines, name
    parallel_lines = fresh_compile(kernel, signature).parallel_lines
    assert prange_lines <= parallel_lines, \
        f"{name}: the prange on lines {sorted(prange_lines - parallel_lines)} runs serially"


def _half_kernels():
    """The half-precision kernels (lowlevel/float16.py, bf16gemm.py) with arguments of the
    types the op gives them: compiled from their types alone, no launch needed. The
    vdpbf16ps products only where the CPU has AVX512-BF16 (elsewhere they do not compile)."""
    from fusedrnn.cpu.lowlevel import HAS_BF16, bf16gemm, float16
    u16 = np.zeros(8, np.uint16)
    f32, u32 = np.zeros(8, np.float32), np.zeros((2, 2), np.uint32)
    f32_2d, u16_2d = np.zeros((2, 2), np.float32), np.zeros((2, 2), np.uint16)
    panels3, tiles3 = np.zeros((1, 2, 16), np.float32), np.zeros((1, 2, 16), np.uint32)
    table = {
        "float16._widen_f16": (float16._widen_f16, (u16, f32)),
        "float16._narrow_f16": (float16._narrow_f16, (f32, u16)),
        "float16._project_widened": (float16._project_widened,
                                     (u16_2d, True, panels3, f32_2d, panels3,
                                      np.zeros((1, 2, 2), np.float32))),
        "bf16gemm._widen": (bf16gemm._widen, (u16, f32.view(np.uint32))),
        "bf16gemm._narrow": (bf16gemm._narrow, (f32, u16)),
        "bf16gemm._round_rows": (bf16gemm._round_rows, (f32_2d, u16_2d)),
        "bf16gemm._interleave_rows": (bf16gemm._interleave_rows, (f32_2d, u32)),
        "bf16gemm._pack_k_pairs": (bf16gemm._pack_k_pairs, (f32_2d, tiles3)),
        "bf16gemm._pack_recurrent_pairs": (bf16gemm._pack_recurrent_pairs,
                                           (u16_2d, 1, np.zeros((1, 1, 2, 16), np.uint32))),
        "bf16gemm._pack_pairs_at": (bf16gemm._pack_pairs_at, (f32_2d, 0, tiles3)),
    }
    if HAS_BF16:
        table["bf16gemm._project_bf16"] = (bf16gemm._project_bf16,
                                           (u32, tiles3, f32_2d, panels3, True))
    return table


@pytest.mark.parametrize("name", sorted(_half_kernels()))
def test_every_half_precision_prange_is_a_parallel_loop(name):
    import numba as nb
    kernel, args = _half_kernels()[name]
    _assert_every_prange_parallel(name, kernel, tuple(nb.typeof(arg) for arg in args))
