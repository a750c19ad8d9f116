"""The flat parameter vector: sizes, named views, and torch state_dict conversion.

Layout (MXNet's and cuDNN's): all weights of all layers first, then all biases.
For each layer l and direction d, in that order: W_x (G*H, In_l), W_h (G*H, R) and,
with projection, W_r (R, H), all row-major; then for each (l, d): b_x (G*H,),
b_h (G*H,). In_l = I for layer 0 and D*R above it. Weights act as W @ x, the
same convention as torch.nn, so torch's weight_ih/weight_hh/bias_ih/bias_hh/
weight_hr map one to one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .config import RNNConfig, check_config

__all__ = ["ParamLayout", "param_size", "param_layout"]

WEIGHT_KINDS = ("W_x", "W_h", "W_r")
BIAS_KINDS = ("b_x", "b_h")
_CELL_BLOCKS = ("W_x", "W_h", "b_x", "b_h")   # ParamLayout.cell_views'
_TORCH_NAMES = {"W_x": "weight_ih", "W_h": "weight_hh", "W_r": "weight_hr",
                "b_x": "bias_ih", "b_h": "bias_hh"}


@dataclass(frozen=True)
class ParamLayout:
    """Offsets and shapes of every block of one config's flat parameter vector."""

    config: RNNConfig

    @cached_property
    def blocks(self) -> dict[tuple[int, int, str], tuple[int, tuple[int, ...]]]:
        """(layer, direction, kind) -> (offset, shape), in storage order."""
        cfg = self.config
        gh, h, r = cfg.gate_rows, cfg.state_size, cfg.recurrent_size
        out, offset = {}, 0

        def put(key, shape):
            nonlocal offset
            out[key] = (offset, shape)
            offset += math.prod(shape)

        for layer in range(cfg.num_layers):
            for d in range(cfg.directions):
                put((layer, d, "W_x"), (gh, cfg.layer_input_size(layer)))
                put((layer, d, "W_h"), (gh, r))
                if cfg.projection_size:
                    put((layer, d, "W_r"), (r, h))
        for layer in range(cfg.num_layers):
            for d in range(cfg.directions):
                put((layer, d, "b_x"), (gh,))
                put((layer, d, "b_h"), (gh,))
        return out

    @cached_property
    def size(self) -> int:
        offset, shape = list(self.blocks.values())[-1]
        return offset + math.prod(shape)

    @cached_property
    def _spans(self) -> dict[tuple[int, int, str], tuple[int, int, tuple[int, ...]]]:
        """(start, stop, shape) of each block: view's, once (a call takes several); shape
        None for a vector (a slice is its view)."""
        return {key: (offset, offset + math.prod(shape), shape if len(shape) > 1 else None)
                for key, (offset, shape) in self.blocks.items()}

    def view(self, flat, layer: int, direction: int, kind: str):
        """A view (no copy) of one block of `flat`; works for numpy and CuPy arrays."""
        start, stop, shape = self._spans[(layer, direction, kind)]
        return flat[start:stop] if shape is None else flat[start:stop].reshape(shape)

    @cached_property
    def _cell_spans(self):
        """_spans of W_x, W_h, b_x and b_h by (layer, direction): cell_views'."""
        return {(layer, d): tuple(self._spans[layer, d, kind] for kind in _CELL_BLOCKS)
                for layer, d, kind in self.blocks if kind == "W_x"}

    def cell_views(self, flat, layer: int, direction: int):
        """(W_x, W_h, b_x, b_h) of one layer direction: view's four in one lookup (the
        single step's path, at every call)."""
        (a, b, x_shape), (c, e, h_shape), (f, g, _), (i, j, _) = \
            self._cell_spans[layer, direction]
        return flat[a:b].reshape(x_shape), flat[c:e].reshape(h_shape), flat[f:g], flat[i:j]

    def views(self, flat) -> dict[tuple[int, int, str], object]:
        """Every block of `flat` as a view, keyed (layer, direction, kind)."""
        return {key: self.view(flat, *key) for key in self.blocks}

    @staticmethod
    def torch_name(layer: int, direction: int, kind: str) -> str:
        return f"{_TORCH_NAMES[kind]}_l{layer}" + ("_reverse" if direction else "")

    def to_torch_state_dict(self, flat) -> dict[str, np.ndarray]:
        """torch.nn.RNN/LSTM/GRU state_dict entries (as numpy copies) from a flat vector.

        Wrap with torch.from_numpy (or `{k: torch.tensor(v) ...}`) for load_state_dict.
        """
        flat = np.asarray(flat)
        self._check_flat(flat)
        return {self.torch_name(*key): np.array(self.view(flat, *key)) for key in self.blocks}

    def from_torch_state_dict(self, state_dict, dtype=None) -> np.ndarray:
        """A flat vector from a torch.nn.RNN/LSTM/GRU state_dict (tensors or arrays).

        A module built with bias=False has no bias entries: its biases become zeros.
        """
        names = {self.torch_name(*key): key for key in self.blocks}
        has_bias = any(k.startswith("bias_") for k in state_dict)
        missing = [n for n, key in names.items()
                   if n not in state_dict and (has_bias or key[2] not in BIAS_KINDS)]
        unknown = sorted(set(state_dict) - set(names))
        if missing or unknown:
            raise ValueError(f"state_dict does not match {self.config}: "
                             f"missing {missing}, unexpected {unknown}")
        first = _to_numpy(next(iter(state_dict.values())))
        flat = np.zeros(self.size, dtype=dtype or first.dtype)
        for name, key in names.items():
            if name not in state_dict:
                continue
            value = _to_numpy(state_dict[name])
            _, shape = self.blocks[key]
            if value.shape != shape:
                raise ValueError(f"state_dict[{name!r}]: expected shape {shape}, got {value.shape}")
            self.view(flat, *key)[...] = value
        return flat

    def _check_flat(self, flat):
        if flat.shape != (self.size,):
            raise ValueError(f"parameters: expected shape ({self.size},), got {flat.shape}")


def expected_size(cfg) -> int:
    """The flat vector's length by the spec's closed formula (Python ints: no overflow,
    no per-layer loop), so absurd sizes are refused before anything is built."""
    D, G, H, I, L = cfg.directions, cfg.cell.gates, cfg.state_size, cfg.input_size, cfg.num_layers
    R = cfg.recurrent_size
    size = D * G * H * (I + R + 2) + (L - 1) * D * G * H * (D * R + R + 2)
    return size + (L * D * R * H if cfg.projection_size else 0)


def _to_numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, on any device
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":   # numpy has none: float32 holds it exactly
            value = value.float()
        value = value.numpy()
    return np.asarray(value)


def param_layout(*, mode: str, input_size: int, state_size: int, num_layers: int = 1,
                 bidirectional: bool = False, projection_size: int | None = None) -> ParamLayout:
    """The layout of one configuration's flat parameter vector."""
    return ParamLayout(check_config(mode, input_size, state_size, num_layers,
                                    bidirectional, projection_size))


def param_size(*, mode: str, input_size: int, state_size: int, num_layers: int = 1,
               bidirectional: bool = False, projection_size: int | None = None) -> int:
    """Length of the flat parameter vector (MXNet's formula, see the spec)."""
    return param_layout(mode=mode, input_size=input_size, state_size=state_size,
                        num_layers=num_layers, bidirectional=bidirectional,
                        projection_size=projection_size).size
