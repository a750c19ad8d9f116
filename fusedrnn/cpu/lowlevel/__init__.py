"""The CPU kernels' low-level layer, and its one entry: import from here, never from the
submodules (tests/test_layering.py checks it):

    microkernel  the register-tiled GEMM against packed panels; row_dots for few samples
    packing      every weight layout the micro-kernel reads
    gemm         the input projection of all steps (and the input gradient's GEMM)
    batched      a single step's backward GEMMs in one region, B read in place
    rows         16-element vector row moves
    workshare    the steps' blocks shared in one parallel region
    mathfn       vectorisable exp, sigmoid, tanh and selects
    bf16         the AVX512-BF16 register tile (vdpbf16ps) and its panel layout
    bf16gemm     the bfloat16 path's packers, conversions and products
    float16      float16 as uint16 bits (Numba's CPU target has none), read in place

Words, each in one sense here and in fused.py:
    panel        16 columns of a weight, packed (K, 16) contiguous: what the micro-kernel
                 multiplies against; a block of 16 hidden units owns one panel per gate
    register tile  the micro-kernel's accumulators: ROWS rows of A x 16 columns
    block tile   fused.py's per-block scratch (`tiles`): one 256-wide row per sample
                 holding a block's gates, states and record while the cell runs
    spill        gemm's scratch for the partial last panel of the input projection
    strip        batched.py's: B's columns of one work item, read in place (the _free
                 forms: B's own columns as panels) or packed as panels
    row          up to 16 contiguous elements of one sample (rows.py); A's rows and ROWS
                 count samples; pack_recurrent_rows packs W_h's columns for dg @ W_h

VECTOR_BITS here is the value at import; microkernel.VECTOR_BITS is the setting a
process may override before it compiles a tile (tile_settings() reads it).
"""
# microkernel first: decorating the cached kernels of gemm and packing stamps them with
# tile_settings() (jitcache.py), which must be here by then.
from .microkernel import PANEL, VECTOR_BITS, panel_gemm, panel_gemm_t, row_dots, tile_settings

# isort: split
from .batched import ITEM_ROWS, QUAD, job_rows, products
from .bf16 import HAS_BF16, pack_pairs, panel_gemm_bf16, panel_gemm_bf16_bias, panel_gemm_bf16_cols
from .bf16gemm import (
    bf16_bits,
    interleave_rows,
    narrow,
    pack_input_pairs,
    pack_k_pairs,
    pack_recurrent_pairs,
    project_bf16,
    round_rows,
    widen,
)
from .float16 import f16_bits, f16_value, narrow_f16, project_widened, widen_f16
from .gemm import CHUNK, project
from .mathfn import fast_exp, one_like, select, sigmoid, tanh, zero_like
from .packing import pack_input_weights, pack_panel, pack_recurrent, pack_recurrent_rows, panels
from .rows import row_add, row_add3, row_copy, row_round, row_zero
from .workshare import (
    IDLE,
    LINE,
    POSTED,
    claim,
    finish,
    hold_launcher,
    new_counters,
    settle,
    spread,
    team_arrive,
    team_leave,
    team_wait,
)

__all__ = ["CHUNK", "HAS_BF16", "IDLE", "ITEM_ROWS", "LINE", "PANEL", "POSTED", "QUAD", "VECTOR_BITS", "bf16_bits", "claim", "f16_bits",
           "f16_value", "fast_exp", "finish", "hold_launcher", "interleave_rows", "job_rows",
           "narrow",
           "narrow_f16", "new_counters", "one_like", "pack_input_pairs", "pack_input_weights",
           "pack_k_pairs", "pack_pairs", "pack_panel", "pack_recurrent", "pack_recurrent_pairs",
           "pack_recurrent_rows", "panel_gemm", "panel_gemm_bf16", "panel_gemm_bf16_bias",
           "panel_gemm_bf16_cols", "panel_gemm_t", "panels", "products", "project", "project_bf16",
           "project_widened", "round_rows", "row_add", "row_add3", "row_copy", "row_dots",
           "row_round", "row_zero", "select", "settle", "sigmoid", "spread", "tanh",
           "team_arrive", "team_leave", "team_wait", "tile_settings", "widen", "widen_f16",
           "zero_like"]
