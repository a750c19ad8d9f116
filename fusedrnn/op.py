"""The operator: validate -> look up the cached op -> backend forward / backward."""
from __future__ import annotations

import functools
import threading
import weakref
from typing import NamedTuple

import numpy as np

from .cache import thread_cache
from .config import TORCH_CALLER, dtype_name
from .recurrence import RecurrentOp
from .validate import CheckedCall, check_call

__all__ = ["RNN", "rnn_backward", "TrainingHandle", "RNNGradients", "register_array_type"]

# Array types that a layer above this one wraps (the torch integration registers
# "torch"), keyed by the top-level package of the data's type. A registry, not an
# import: op sits below them, and importing upward would close a cycle.
_ARRAY_HANDLERS = {}


def register_array_type(package, handler):
    """From now on RNN(data, ...) returns handler(data, ...) (RNN's arguments, the
    keywords by name) when type(data) comes from the top-level package `package`."""
    _ARRAY_HANDLERS[package] = handler


def RNN(data, parameters, state=None, state_cell=None, sequence_length=None, *, state_size,
        num_layers, mode, bidirectional=False, p=0.0, state_outputs=False,
        projection_size=None, lstm_state_clip_min=None, lstm_state_clip_max=None,
        lstm_state_clip_nan=False, use_sequence_length=False, train=None, seed=None,
        _stored_as=None):
    """MXNet's RNN operator: the whole sequence, all layers and directions, in one call.

    data (T, N, I); parameters: the flat vector (see fusedrnn.layout); state
    (L*D, N, R) and, for LSTM, state_cell (L*D, N, H), zeros when None (R is
    projection_size when given, else state_size); sequence_length (N,) integers in 1..T,
    read when use_sequence_length=True.
    Returns out, or (out, hy) / (out, hy, cy) with state_outputs=True. With
    train=True a TrainingHandle is appended; pass it to rnn_backward. Dropout (p, between
    layers, training only) draws its masks from the backend's generator seeded by `seed`
    (None: fresh entropy); the same seed gives the same masks.

    torch tensors (CPU or CUDA) cross without copies and return tensors that
    torch.autograd differentiates (no handle is appended; see the torch integration's
    `rnn`). There `train` defaults to whether autograd will need a backward; for arrays,
    to False.

    _stored_as (private; the torch integration's): "bfloat16" or "float16" where float32
    CuPy data stands for data its caller holds in that dtype but could not hand over in it
    (torch's CUDA bfloat16: CuPy has none). The op then runs as for data of that dtype
    (the GPU's products on tensor cores), in float32 at its edges.
    """
    repeat = None
    if type(data) is np.ndarray:   # (first: a small call's every step counts)
        # A call like this thread's last one (its arrays' types, shapes and dtypes, every
        # other argument's value and type) passes the same checks and runs the same op:
        # both are skipped.
        # Measured: bench/results/cpu-kernel-notes.md#a-call-like-the-last-one
        cache = thread_cache()
        args = (state_size, num_layers, mode, bidirectional, p, state_outputs, projection_size,
                lstm_state_clip_min, lstm_state_clip_max, lstm_state_clip_nan,
                use_sequence_length, train, seed, _stored_as)
        # (types first: True is not 1 to validate, and an array's == is no answer)
        repeat = (tuple(map(type, args)), data.shape, data.dtype, _facts(parameters),
                  _facts(state), _facts(state_cell), sequence_length is None,
                  TORCH_CALLER.get(), args)
        last = cache.last
        if last is not None and last.signature == repeat:
            call = CheckedCall(last.config, np.ascontiguousarray(data),
                               _contiguous(parameters), _contiguous(state),
                               _contiguous(state_cell), last.state_outputs, last.options)
            cache.touch(last.key, last.op)
            return _run(last.backend, last.key, last.op, call, bool(train))
        backend = _cpu_backend()
    else:
        handler = _ARRAY_HANDLERS.get(type(data).__module__.split(".")[0])
        if handler is not None:
            return handler(data, parameters, state, state_cell, sequence_length,
                           state_outputs=state_outputs, train=train, state_size=state_size,
                           num_layers=num_layers, mode=mode, bidirectional=bidirectional, p=p,
                           projection_size=projection_size,
                           lstm_state_clip_min=lstm_state_clip_min,
                           lstm_state_clip_max=lstm_state_clip_max,
                           lstm_state_clip_nan=lstm_state_clip_nan,
                           use_sequence_length=use_sequence_length, seed=seed)
        backend = _backend_for(data)
    train = False if train is None else train
    if _stored_as is not None:
        _check_stored_as(backend, data, _stored_as)
    call = check_call(backend, data, parameters, state, state_cell, sequence_length,
                      state_size=state_size, num_layers=num_layers, mode=mode,
                      bidirectional=bidirectional, p=p, state_outputs=state_outputs,
                      projection_size=projection_size, lstm_state_clip_min=lstm_state_clip_min,
                      lstm_state_clip_max=lstm_state_clip_max,
                      lstm_state_clip_nan=lstm_state_clip_nan,
                      use_sequence_length=use_sequence_length, train=train, seed=seed)
    runs_on = backend.for_call(call.config, call.seq_len, call.dtype)   # (the CPU's tiers)
    key = (runs_on.name, runs_on.device_key(call.data), call.config, call.seq_len, call.batch,
           dtype_name(call.dtype), _stored_as)   # (the name: bfloat16's str is any 2-byte void's)
    op = _cached_op(runs_on, key, call, _stored_as)
    outputs = _run(runs_on, key, op, call, train)
    # (not while on the first tier: a later call may find its kernels ready; nor with
    # lengths, whose values are checked at every call)
    if repeat is not None and runs_on is backend and call.options.lengths is None:
        cache.last = LastCall(repeat, runs_on, key, op, call.config, call.options,
                              call.state_outputs)
    return outputs


class LastCall(NamedTuple):
    """A thread's last checked call (OpCache.last): what a call with its signature reuses."""
    signature: tuple
    backend: object
    key: tuple
    op: object
    config: object
    options: object
    state_outputs: bool


def _facts(array):
    """What the checks read of an array argument (None where it may be); anything but an
    array gets a value equal to no other, so its call is checked."""
    if array is None:
        return None
    if isinstance(array, np.ndarray):   # (a subclass too, as the checks take it)
        return type(array), array.shape, array.dtype
    return object()


def _contiguous(array):
    return None if array is None else np.ascontiguousarray(array)


def _run(backend, key, op, call, train):
    """The checked call on its op: the outputs RNN returns."""
    with op.lock, backend.device_context(call.data):
        op.last_stream = backend.follow(op.last_stream)
        reserve = op.take_reserve() if train else None
        out, hy, cy = op.forward(call.data, call.parameters, call.state, call.state_cell,
                                 call.options, reserve, call.state_outputs)
    outputs = (out, hy) + ((cy,) if cy is not None else ()) if call.state_outputs else (out,)
    thread_cache().trim(keep=key)
    if train:
        outputs += (TrainingHandle(backend, key, call, reserve, op),)
    return outputs[0] if len(outputs) == 1 else outputs


class RNNGradients(NamedTuple):
    data: object
    parameters: object
    state: object       # None when the forward had no `state`
    state_cell: object  # None unless LSTM with a `state_cell`


class TrainingHandle:
    """What one training forward keeps for its backward.

    Owns its reserve (states, gate activations and layer inputs of every step) until
    rnn_backward runs or `release()` is called; no other call writes into it. It also
    refers to the forward's data, parameters and states, which must not be modified
    before backward. The backward runs on the forward's op from any thread (torch's
    autograd runs a CUDA backward on its device thread), not on one that thread's cache
    would build with its own scratch and settings; the handle refers to that op weakly,
    so an op its cache has dropped is freed as before (a backward then builds the op in
    the calling thread's cache).
    """

    def __init__(self, backend, key, call, reserve, op):
        self._backend, self._key, self._call, self._reserve = backend, key, call, reserve
        self._op = weakref.ref(op)
        self._guard = threading.Lock()   # the reserve's hand-over only; held for nothing else

    @property
    def released(self) -> bool:
        return self._reserve is None

    def release(self) -> None:
        """Give the reserve back to the forward's op for reuse, where that op is alive and
        not in another thread's call, else leave it to be freed; backward is no longer
        possible. Never waits: the torch integration's finalizer calls it from the
        garbage collector, anywhere in any thread."""
        if self._give_back():
            thread_cache().trim(keep=self._key)

    def _give_back(self):
        """release() but the cache's trim: whether the reserve went back to its op."""
        with self._guard:
            reserve, self._reserve = self._reserve, None
        op = self._op()
        if reserve is None or op is None or not op.lock.acquire(blocking=False):
            return False
        try:
            op.give_back_reserve(reserve)
        finally:
            op.lock.release()
        return True


def rnn_backward(handle, dout=None, dhy=None, dcy=None, *, retain=False) -> RNNGradients:
    """Gradients of sum(out*dout) + sum(hy*dhy) + sum(cy*dcy) w.r.t. the forward's inputs.

    Head gradients that are None count as zero; dhy/dcy need state_outputs=True. The
    handle is released afterwards unless retain=True (to run backward again).
    """
    if not isinstance(handle, TrainingHandle):
        raise TypeError(f"handle: expected the TrainingHandle of RNN(..., train=True), "
                        f"got {type(handle).__name__}")
    if handle.released:
        raise _released()
    backend, call, cfg = handle._backend, handle._call, handle._call.config
    T, N, D, R = call.seq_len, call.batch, cfg.directions, cfg.recurrent_size
    LD = cfg.num_layers * D
    dout = _head_grad(backend, "dout", dout, (T, N, D * R), call, True)
    dhy = _head_grad(backend, "dhy", dhy, (LD, N, R), call, call.state_outputs)
    dcy = _head_grad(backend, "dcy", dcy, (LD, N, cfg.state_size), call,
                     call.state_outputs and cfg.cell.has_cell_state)
    op = handle._op()
    if op is None:   # the forward's op was dropped: this thread's, as for a forward
        op = _cached_op(backend, handle._key, call, handle._key[-1])
    else:
        thread_cache().touch(handle._key, op)
    with op.lock, backend.device_context(call.data):
        reserve = handle._reserve   # once: another thread may release the handle meanwhile
        if reserve is None:         # (its release cannot pool the reserve while we hold op)
            raise _released()
        op.last_stream = backend.follow(op.last_stream)
        g_data, g_params, g_h0, g_c0 = op.backward(reserve, call.data, call.parameters,
                                                   call.state, call.state_cell, call.options,
                                                   dout, dhy, dcy)
        if not retain:
            handle._give_back()   # (the trim below is release()'s)
    thread_cache().trim(keep=handle._key)
    return RNNGradients(g_data, g_params, g_h0 if call.state is not None else None,
                        g_c0 if call.state_cell is not None else None)


def _released():
    return RuntimeError("handle: already released (backward ran, or release() was called); "
                        "run RNN(..., train=True) again, or pass retain=True to backward")


def _cached_op(backend, key, call, stored_as=None):
    return thread_cache().get(key, _build_op, backend, call, stored_as)


def _build_op(backend, call, stored_as):
    with backend.device_context(call.data):  # scratch lives on data's device
        return RecurrentOp(backend, call.config, call.seq_len, call.batch, call.dtype,
                           stored_as)


def _check_stored_as(backend, data, stored_as):
    if stored_as is None:
        return
    if stored_as not in ("bfloat16", "float16") or backend.name != "cuda" or \
            getattr(data, "dtype", None) != np.float32:
        raise ValueError(f"_stored_as: expected None, or 'bfloat16' / 'float16' with float32 "
                         f"CuPy data, got {stored_as!r} with "
                         f"{type(data).__name__} {getattr(data, 'dtype', '')}")


def _head_grad(backend, name, value, shape, call, allowed):
    if value is None:
        return None
    if not allowed:
        raise ValueError(f"{name}: this forward has no such output (state_outputs="
                         f"{call.state_outputs}, mode={call.config.mode!r}); pass None")
    if not backend.is_array(value):
        raise TypeError(f"{name}: expected a {backend.array_name} like data, "
                        f"got {type(value).__name__}")
    if backend.device_key(value) != backend.device_key(call.data):
        raise ValueError(f"{name}: expected an array on data's device "
                         f"{backend.device_key(call.data)}, got {backend.device_key(value)}")
    if value.dtype != call.dtype:
        raise TypeError(f"{name}: expected dtype {call.dtype} (data's dtype), got {value.dtype}")
    if value.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {value.shape}")
    return backend.contiguous(value)


def _backend_for(data):
    if isinstance(data, np.ndarray):
        return _cpu_backend()
    module = type(data).__module__.split(".")[0]
    if module == "cupy":
        from .gpu import backend
        return backend()
    raise TypeError(f"data: expected a numpy.ndarray or a cupy.ndarray, got "
                    f"{type(data).__module__}.{type(data).__name__}")


@functools.cache
def _cpu_backend():
    """fusedrnn.cpu's backend, imported at the first numpy call (Numba loads with it)."""
    from .cpu import BACKEND
    return BACKEND
