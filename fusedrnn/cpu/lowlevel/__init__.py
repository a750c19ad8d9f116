"""The CPU kernels' low-level layer, and its one entry: import from here, never from the
submodules (tests/test_layering.py checks it). What the rest of fusedrnn.cpu uses:

    microkernel  PANEL, VECTOR_BITS, panel_gemm, panel_gemm_t: the register-tiled GEMM
                 against packed panels; tile_settings() for jitcache's stamp
    packing      panels, pack_recurrent, pack_recurrent_rows, pack_input_weights,
                 pack_panel: every weight layout the micro-kernel reads
    gemm         project, CHUNK: the input projection of all steps on Numba's threads
    rows         row_copy, row_add, row_add3: 16-element vector row moves
    workshare    claim, finish, new_counters: the steps' blocks shared in one region
    mathfn       fast_exp, sigmoid, tanh, select, one_like, zero_like: vectorisable math

VECTOR_BITS here is the value at import; microkernel.VECTOR_BITS is the setting a
process may override before it compiles a tile (tile_settings() reads it).
"""
# microkernel first: decorating the cached kernels of gemm and packing stamps them with
# tile_settings() (jitcache.py), which must be here by then.
from .microkernel import PANEL, VECTOR_BITS, panel_gemm, panel_gemm_t, tile_settings
from .gemm import CHUNK, project
from .mathfn import fast_exp, one_like, select, sigmoid, tanh, zero_like
from .packing import (pack_input_weights, pack_panel, pack_recurrent, pack_recurrent_rows,
                      panels)
from .rows import row_add, row_add3, row_copy
from .workshare import claim, finish, new_counters

__all__ = ["CHUNK", "PANEL", "VECTOR_BITS", "claim", "fast_exp", "finish", "new_counters",
           "one_like", "pack_input_weights", "pack_panel", "pack_recurrent",
           "pack_recurrent_rows", "panel_gemm", "panel_gemm_t", "panels", "project",
           "row_add", "row_add3", "row_copy", "select", "sigmoid", "tanh", "tile_settings",
           "zero_like"]
