"""What describes one RNN op instance: the cell table, the frozen config and its check,
and the per-call options with the clip flags the kernels read.

Everything a backend needs to plan a call is derived from `RNNConfig` plus the
call's (T, N, dtype); the op cache keys on exactly these. This module is the bottom
layer: it imports nothing else of the package, so layout, validate, the driver and the
backends (whose cached kernels compile the clip flags in) can all read it.
"""
from __future__ import annotations

import contextvars
import numbers
from dataclasses import dataclass

import numpy as np

__all__ = ["CellSpec", "CELLS", "MODES", "modes_with", "RNNConfig", "check_config",
           "CallOptions", "CLIP", "CLIP_NAN", "Precision", "PRECISIONS"]

CLIP, CLIP_NAN = 1, 2  # clip_flags bits, as the kernels read them

# None, or while fusedrnn.torch calls the op, torch's own operations on numpy arrays, run
# on torch's thread pool: an object with matmul(a, b, out, transpose_a) (out = a @ b, or
# a^T @ b), transpose(a, out) (out = a^T) and deterministic() (torch's deterministic-algorithms
# switch). The program's other work is torch's, so the CPU backend runs its GEMMs there too
# (CpuBackend.matmul) and keeps numpy's BLAS threads off torch's cores (cpu/threads.py).
TORCH_CALLER = contextvars.ContextVar("fusedrnn_torch_caller", default=None)


@dataclass(frozen=True)
class CellSpec:
    """Static facts about one cell type: the one table a mode is defined by.

    Everything else that depends on the mode (validation, the drivers, the torch
    bindings, the GPU kernel names, the benchmark's torch peer, the tests) reads these
    fields, so a new mode is a row here plus its unit math in cpu/units.py and
    gpu/cells.cuh and its reference in tests/reference.py (docs/internals.md#adding-a-cell).

    gates:        G, the number of H-row gate blocks in W_x / W_h, in this order.
    gate_names:   the G blocks' names, in layout order ([i,f,g,o], [r,z,n], ...).
    saved:        width of the per-step training record, in units of H (what backward
                  reads instead of recomputing: activated gates, plus GRU's W_hn h + b_hn).
    carry:        the extra gradient carried between backward steps besides dh:
                  "c" (LSTM: dc flows to c_{t-1}), "h" (GRU: z*dh flows straight to
                  h_{t-1}), or None.
    cuda_cell:    the cell's struct in gpu/cells.cuh (namespace fusedrnn), the first
                  template argument of every GPU kernel instantiated for this mode.
    torch_class:  the torch.nn class with the same math and layout ("RNN", "LSTM", "GRU").
    nonlinearity: that class's `nonlinearity` argument for this mode, or None where it
                  takes none.
    projection:   projection_size (LSTMP's W_r) applies to this mode.
    state_clip:   lstm_state_clip_min/max apply (they clip the cell state c).

    ONNX export (fusedrnn/torch/onnx.py) writes the mode as one node per layer of
    ONNX's own operator, from these:
    onnx_op:          that operator ("RNN", "LSTM", "GRU"), with the same math.
    onnx_gates:       gate_names in the operator's gate order (ONNX LSTM is i,o,f,c;
                      GRU is z,r,h): the export reorders W_x, W_h and the biases by it.
    onnx_activations: the operator's `activations` for one direction, or None where its
                      defaults are this cell's (they are then left out, as torch.nn's
                      export does).
    onnx_linear_before_reset: the operator's linear_before_reset=1 (GRU: W_hn h + b_hn
                      is taken before r multiplies it, as in torch's and cuDNN's GRU).
    """

    gates: int
    gate_names: tuple
    saved: int
    carry: str | None
    cuda_cell: str
    torch_class: str
    onnx_op: str
    onnx_gates: tuple
    nonlinearity: str | None = None
    projection: bool = False
    state_clip: bool = False
    onnx_activations: tuple | None = None
    onnx_linear_before_reset: bool = False

    def __post_init__(self):
        # The table's own consistency: a slip here would surface far away.
        assert len(self.gate_names) == self.gates, self.gate_names
        assert self.carry in (None, "c", "h"), self.carry
        assert not self.state_clip or self.has_cell_state, "state_clip needs a cell state"
        assert sorted(self.onnx_gates) == sorted(self.gate_names), self.onnx_gates

    @property
    def onnx_gate_order(self) -> tuple:
        """For each of ONNX's gate blocks in its order, the index of that block in ours."""
        return tuple(self.gate_names.index(g) for g in self.onnx_gates)

    @property
    def has_cell_state(self) -> bool:
        return self.carry == "c"

    @property
    def reads_h_prev(self) -> bool:
        # Only a cell with a direct h_{t-1} -> h_t path (GRU's z * h_prev, whose gradient
        # is the "h" carry) reads h_{t-1} in its pointwise math, forward or backward; the
        # others see it only through W_h h (the fused loops then leave it out of the tile).
        return self.carry == "h"

    @property
    def split_gate_grads(self) -> bool:
        # GRU's n gate sees W_hn h through r, so d(gh) != d(gx) there; the others
        # share one pre-activation gradient for both GEMM inputs.
        return self.carry == "h"

    @property
    def torch_kwargs(self) -> dict:
        """The extra constructor arguments of torch.nn.<torch_class> for this mode."""
        return {} if self.nonlinearity is None else {"nonlinearity": self.nonlinearity}

    def torch_module(self, nn, *args, **kwargs):
        """This mode's module from `nn` (torch.nn, or fusedrnn.torch's drop-ins), built
        with torch.nn's constructor arguments; the namespace is passed in, so the table
        itself never imports torch."""
        return getattr(nn, self.torch_class)(*args, **self.torch_kwargs, **kwargs)


CELLS = {
    "rnn_relu": CellSpec(gates=1, gate_names=("a",), saved=1, carry=None, cuda_cell="ReluCell",
                         torch_class="RNN", nonlinearity="relu", onnx_op="RNN",
                         onnx_gates=("a",), onnx_activations=("Relu",)),
    "rnn_tanh": CellSpec(gates=1, gate_names=("a",), saved=1, carry=None, cuda_cell="TanhCell",
                         torch_class="RNN", nonlinearity="tanh", onnx_op="RNN",
                         onnx_gates=("a",), onnx_activations=("Tanh",)),
    "lstm": CellSpec(gates=4, gate_names=("i", "f", "g", "o"), saved=4, carry="c",
                     cuda_cell="LstmCell", torch_class="LSTM", projection=True, state_clip=True,
                     onnx_op="LSTM", onnx_gates=("i", "o", "f", "g")),
    "gru": CellSpec(gates=3, gate_names=("r", "z", "n"), saved=4, carry="h", cuda_cell="GruCell",
                    torch_class="GRU", onnx_op="GRU", onnx_gates=("z", "r", "n"),
                    onnx_linear_before_reset=True),
}
MODES = tuple(CELLS)


def modes_with(flag):
    """The modes whose CellSpec has `flag` set, as error messages name them: "'lstm'"."""
    return ", ".join(repr(m) for m, c in CELLS.items() if getattr(c, flag))


@dataclass(frozen=True)
class RNNConfig:
    """One op instance, independent of batch and sequence length."""

    mode: str
    input_size: int
    state_size: int
    num_layers: int
    bidirectional: bool = False
    projection_size: int | None = None

    @property
    def cell(self) -> CellSpec:
        return CELLS[self.mode]

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def gate_rows(self) -> int:
        """G*H: rows of one direction's W_x and W_h."""
        return self.cell.gates * self.state_size

    @property
    def recurrent_size(self) -> int:
        """R: width of the recurrent state h carried between steps (P when projected)."""
        return self.projection_size or self.state_size

    def layer_input_size(self, layer: int) -> int:
        return self.input_size if layer == 0 else self.directions * self.recurrent_size


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return int(value)


def _bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return bool(value)


_CONFIGS: dict = {}   # check_config's results by its arguments and their types
_DTYPE_NAMES: dict = {}   # dtype_name's


def check_config(mode, input_size, state_size, num_layers, bidirectional, projection_size):
    """The RNNConfig of these arguments, or a TypeError/ValueError naming the bad one.
    Remembered per argument values and types (True is not 1 here), since every call checks
    the same few configurations again."""
    args = (mode, input_size, state_size, num_layers, bidirectional, projection_size)
    return remembered(_CONFIGS, tuple((type(a), a) for a in args), lambda: _check_config(*args))


def remembered(table, key, make):
    """make()'s result, kept in `table` (a dict of at most 256 entries) under `key`; a key
    that cannot be hashed is not kept (make() refuses it, or its result is not stored)."""
    try:
        return table[key]
    except (KeyError, TypeError):
        pass
    value = make()
    if len(table) >= 256:
        table.clear()
    try:
        table[key] = value
    except TypeError:
        pass
    return value


def dtype_name(dtype) -> str:
    """dtype.name, remembered: numpy builds the name in Python at every access, and a call
    reads it several times (bfloat16 is told apart by its name: validate._array)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        if len(_DTYPE_NAMES) >= 64:
            _DTYPE_NAMES.clear()
        name = _DTYPE_NAMES[dtype] = dtype.name
        return name


def _check_config(mode, input_size, state_size, num_layers, bidirectional, projection_size):
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if projection_size is not None:
        projection_size = _positive_int("projection_size", projection_size)
        if not CELLS[mode].projection:
            raise ValueError(f"projection_size: only mode={modes_with('projection')} has a "
                             f"projection, got mode={mode!r}")
    return RNNConfig(mode=mode,
                     input_size=_positive_int("input_size (data.shape[2])", input_size),
                     state_size=_positive_int("state_size", state_size),
                     num_layers=_positive_int("num_layers", num_layers),
                     bidirectional=_bool("bidirectional", bidirectional),
                     projection_size=projection_size)


@dataclass(frozen=True)
class Precision:
    """One data dtype the op takes. Arrays in and out (data, parameters, states, outputs,
    gradients) are in `name`; the recurrence runs in `compute` (scratch, the training
    reserve, every product's accumulation and the cell math)."""
    name: str
    compute: str
    unit_roundoff: float   # u: half the gap between 1 and the next value (2^-p)


# float16 and bfloat16 run in float32: their arrays are converted at the op's edges
# (recurrence.RecurrentOp says where, and where float32 copies are kept). A numpy
# bfloat16 array is ml_dtypes.bfloat16's (the dtype JAX uses); its name is matched, so
# fusedrnn itself never needs ml_dtypes.
PRECISIONS = {p.name: p for p in (
    Precision("float32", "float32", 2.0 ** -24),
    Precision("float64", "float64", 2.0 ** -53),
    Precision("float16", "float32", 2.0 ** -11),
    Precision("bfloat16", "float32", 2.0 ** -8),
)}


@dataclass(frozen=True)
class CallOptions:
    """Per-call settings that do not change the plan (so not part of the cache key)."""
    lengths: object = None       # (N,) int64 array of the backend, or None: all T steps
    clip_lo: float = 0.0
    clip_hi: float = 0.0
    clip_flags: int = 0
    dropout: float = 0.0         # training only, between layers
    seed: int | None = None
