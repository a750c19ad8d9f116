"""What describes one RNN op instance: the cell table and the frozen config.

Everything a backend needs to plan a call is derived from `RNNConfig` plus the
call's (T, N, dtype); the op cache keys on exactly these.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CellSpec", "CELLS", "MODES", "RNNConfig"]


@dataclass(frozen=True)
class CellSpec:
    """Static facts about one cell type.

    gates:  G, the number of H-row gate blocks in W_x / W_h ([i,f,g,o], [r,z,n], ...).
    saved:  width of the per-step training record, in units of H (what backward
            reads instead of recomputing: activated gates, plus GRU's W_hn h + b_hn).
    carry:  the extra gradient carried between backward steps besides dh:
            "c" (LSTM: dc flows to c_{t-1}), "h" (GRU: z*dh flows straight to
            h_{t-1}), or None.
    """

    gates: int
    saved: int
    carry: str | None

    @property
    def has_cell_state(self) -> bool:
        return self.carry == "c"

    @property
    def split_gate_grads(self) -> bool:
        # GRU's n gate sees W_hn h through r, so d(gh) != d(gx) there; the others
        # share one pre-activation gradient for both GEMM inputs.
        return self.carry == "h"


CELLS = {
    "rnn_relu": CellSpec(gates=1, saved=1, carry=None),
    "rnn_tanh": CellSpec(gates=1, saved=1, carry=None),
    "lstm": CellSpec(gates=4, saved=4, carry="c"),
    "gru": CellSpec(gates=3, saved=4, carry="h"),
}
MODES = tuple(CELLS)


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
