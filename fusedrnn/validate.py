"""Argument checking: every bad input becomes a TypeError/ValueError naming the
argument, what was expected and what came, before any backend sees it. The config's
own arguments are checked by config.check_config, which this calls."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

from .config import (
    CLIP,
    CLIP_NAN,
    PRECISIONS,
    CallOptions,
    RNNConfig,
    _bool,
    check_config,
    dtype_name,
    modes_with,
    remembered,
)
from .layout import expected_size

__all__ = ["check_call", "check_scalars", "CheckedCall"]

DTYPE_NAMES = " or ".join((", ".join(list(PRECISIONS)[:-1]), list(PRECISIONS)[-1]))


@dataclass(slots=True)
class CheckedCall:
    config: RNNConfig
    data: object
    parameters: object
    state: object
    state_cell: object
    state_outputs: bool
    options: CallOptions

    @property
    def seq_len(self):
        return self.data.shape[0]

    @property
    def batch(self):
        return self.data.shape[1]

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def precision(self):
        return PRECISIONS[dtype_name(self.data.dtype)]


def _array(name, value, ndim, backend, like=None):
    """`value` checked against the backend (and, unless it is data, against data's
    dtype and device), as a C-contiguous array of that backend."""
    if not backend.is_array(value):
        raise TypeError(f"{name}: expected a {backend.array_name} like data, "
                        f"got {type(value).__module__}.{type(value).__name__}")
    if like is not None and backend.device_key(value) != backend.device_key(like):
        raise ValueError(f"{name}: expected an array on data's device "
                         f"{backend.device_key(like)}, got one on {backend.device_key(value)}")
    dtype = None if like is None else like.dtype
    if value.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {value.shape}")
    if dtype is None:
        # By name: numpy's bfloat16 is ml_dtypes' (config.PRECISIONS), kind "V" like
        # any 2-byte void, so the name is what tells it apart.
        if dtype_name(value.dtype) not in PRECISIONS:
            raise TypeError(f"{name}: expected dtype {DTYPE_NAMES}, got {value.dtype}")
    elif value.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (data's dtype), got {value.dtype}")
    # Strided and negative-stride inputs are read through one contiguous copy.
    return backend.contiguous(value)


def check_call(backend, data, parameters, state, state_cell, sequence_length, *, state_size,
               num_layers, mode, bidirectional, p, state_outputs, projection_size,
               lstm_state_clip_min, lstm_state_clip_max, lstm_state_clip_nan,
               use_sequence_length, train, seed=None) -> CheckedCall:
    data = _array("data", data, 3, backend)
    if min(data.shape) < 1:
        raise ValueError(f"data: expected shape (T, N, I) with T, N, I >= 1, got {data.shape}")
    # Every argument but the arrays, checked once per values and types (True is not 1
    # here): a program passes the same few again at every call.
    args = (mode, data.shape[2], state_size, num_layers, bidirectional, projection_size,
            state_outputs, p, train, lstm_state_clip_min, lstm_state_clip_max,
            lstm_state_clip_nan, use_sequence_length, seed)
    cfg, state_outputs, options, expected = remembered(
        _SETTINGS, (args, tuple(map(type, args))), lambda: _settings(*args))

    parameters = _array("parameters", parameters, 1, backend, data)
    if parameters.shape[0] != expected:
        H = cfg.state_size
        formula = ("D*G*H*(I+P+2) + (L-1)*D*G*H*(D*P+P+2) + L*D*P*H" if cfg.projection_size
                   else "D*G*H*(I+H+2) + (L-1)*D*G*H*(D*H+H+2)")
        sizes = f"H={H}" + (f", P={cfg.projection_size}" if cfg.projection_size else "")
        raise ValueError(
            f"parameters: expected {expected} elements for {cfg.mode} with I={cfg.input_size}, "
            f"{sizes}, num_layers={cfg.num_layers}, directions={cfg.directions} "
            f"({formula}), got {parameters.shape[0]}")
    LD, N = cfg.num_layers * cfg.directions, data.shape[1]
    if state is not None:
        state = _array("state", state, 3, backend, data)
        if state.shape != (LD, N, cfg.recurrent_size):
            raise ValueError(f"state: expected shape (num_layers*directions, N, R) = "
                             f"{(LD, N, cfg.recurrent_size)}, got {state.shape}")
    if state_cell is not None:
        if not cfg.cell.has_cell_state:
            raise ValueError(f"state_cell: only mode={modes_with('has_cell_state')} has a cell "
                             f"state, got one for mode={cfg.mode!r}")
        state_cell = _array("state_cell", state_cell, 3, backend, data)
        if state_cell.shape != (LD, N, cfg.state_size):
            raise ValueError(f"state_cell: expected shape (num_layers*directions, N, H) = "
                             f"{(LD, N, cfg.state_size)}, got {state_cell.shape}")
    if use_sequence_length or sequence_length is not None:   # (a checked bool by now)
        options = replace(options, lengths=_check_lengths(backend, data, sequence_length,
                                                          use_sequence_length))
    return CheckedCall(cfg, data, parameters, state, state_cell, state_outputs, options)


_SETTINGS: dict = {}   # _settings' results by argument values and their types


def _settings(mode, input_size, state_size, num_layers, bidirectional, projection_size,
              state_outputs, p, train, clip_min, clip_max, clip_nan, use_sequence_length,
              seed):
    """(config, state_outputs, the CallOptions but lengths, the parameters' size) of a
    call's arguments that are not arrays, by check_config's and check_scalars' rules."""
    cfg = check_config(mode, input_size, state_size, num_layers, bidirectional, projection_size)
    outputs = _bool("state_outputs", state_outputs)
    check_scalars(cfg, p=p, train=train, lstm_state_clip_min=clip_min,
                  lstm_state_clip_max=clip_max, lstm_state_clip_nan=clip_nan,
                  use_sequence_length=use_sequence_length, seed=seed)
    return cfg, outputs, CallOptions(
        **_check_clip(cfg, clip_min, clip_max, clip_nan),
        dropout=float(p) if train and cfg.num_layers > 1 else 0.0,
        seed=_check_seed(seed)), expected_size(cfg)


def check_scalars(cfg, *, p, train, lstm_state_clip_min, lstm_state_clip_max,
                  lstm_state_clip_nan, use_sequence_length, seed):
    """The call's arguments that are not arrays, checked (check_call's rules) before any
    array is read: the torch operator's schema would refuse a wrong type less clearly."""
    _bool("train", train)
    _bool("use_sequence_length", use_sequence_length)
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"p: expected a float in [0, 1), got {type(p).__name__} {p!r}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p: expected a dropout probability in [0, 1), got {p}")
    _check_clip(cfg, lstm_state_clip_min, lstm_state_clip_max, lstm_state_clip_nan)
    _check_seed(seed)


def _check_lengths(backend, data, sequence_length, use_sequence_length):
    if not _bool("use_sequence_length", use_sequence_length):
        if sequence_length is not None:
            raise ValueError("sequence_length: given, but use_sequence_length=False; "
                             "pass use_sequence_length=True to use it")
        return None
    if sequence_length is None:
        raise ValueError("sequence_length: use_sequence_length=True needs a (N,) integer "
                         "array of lengths, got None")
    T, N, _ = data.shape
    if not backend.is_array(sequence_length):
        raise TypeError(f"sequence_length: expected a {backend.array_name} like data, got "
                        f"{type(sequence_length).__module__}.{type(sequence_length).__name__}")
    if backend.device_key(sequence_length) != backend.device_key(data):
        raise ValueError(f"sequence_length: expected an array on data's device "
                         f"{backend.device_key(data)}, got {backend.device_key(sequence_length)}")
    if sequence_length.dtype.kind not in "iu":
        raise TypeError(f"sequence_length: expected an integer dtype, got {sequence_length.dtype}")
    if sequence_length.shape != (N,):
        raise ValueError(f"sequence_length: expected shape (N,) = ({N},), "
                         f"got {sequence_length.shape}")
    # One reduction on the array's device; on a GPU only its boolean crosses to the host.
    if bool(((sequence_length < 1) | (sequence_length > T)).any()):
        raise ValueError(f"sequence_length: expected every length in 1..T = 1..{T}, got "
                         f"values from {int(sequence_length.min())} to {int(sequence_length.max())}")
    # Always a copy: backward must see the lengths the forward saw.
    return backend.contiguous(sequence_length.astype("int64", copy=True))


def _check_clip(cfg, lo, hi, clip_nan):
    clip_nan = _bool("lstm_state_clip_nan", clip_nan)
    if lo is None and hi is None:
        return {}  # MXNet: clip_nan without a range is ignored
    if not cfg.cell.state_clip:
        raise ValueError(f"lstm_state_clip_min/lstm_state_clip_max: only mode="
                         f"{modes_with('state_clip')} has a cell state to clip, got mode={cfg.mode!r}")
    if lo is None or hi is None:
        raise ValueError(f"lstm_state_clip_min/lstm_state_clip_max: give both bounds or "
                         f"neither, got min={lo!r}, max={hi!r}")
    for name, value in (("lstm_state_clip_min", lo), ("lstm_state_clip_max", hi)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
        if value != value:
            raise ValueError(f"{name}: expected a number, got NaN")
    if lo > hi:
        raise ValueError(f"lstm_state_clip_min: expected min <= max, got min={lo}, max={hi}")
    return dict(clip_lo=float(lo), clip_hi=float(hi),
                clip_flags=CLIP | (CLIP_NAN if clip_nan else 0))


def _check_seed(seed):
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed: expected None or a non-negative int, got {seed!r}")
    return int(seed)
