"""fusedrnn.RNN on torch tensors as two torch operators (fusedrnn::rnn, whose autograd
formula calls fusedrnn::rnn_backward), which traced calls record, and an autograd.Function
running the same bodies for eager CPU calls; and the tensor <-> array crossing they use
(no copies: numpy's views on the CPU, DLPack on CUDA). Its own module so that modules.py
can import `rnn` at its top without importing the package fusedrnn.torch, which imports
modules.py.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import weakref
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .. import op
from ..config import CELLS, TORCH_CALLER, check_config, dtype_name
from ..validate import check_scalars

__all__ = ["rnn", "to_array", "to_tensor"]


def _ml_dtypes():
    """ml_dtypes (numpy's bfloat16), or None where it is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes


def _arrays_hold(dtype, device):
    """Whether the device's array library has `dtype`: CuPy has no bfloat16, numpy has it
    through ml_dtypes (DLPack carries neither: the crossing goes by 16-bit integer views)."""
    if dtype != torch.bfloat16:
        return True
    return device.type == "cpu" and _ml_dtypes() is not None


def to_array(tensor):
    """The numpy (CPU) or CuPy (CUDA) view of a tensor's memory: on the CPU with the
    tensor's strides (the op reads a strided array through one contiguous copy of its own:
    an expanded head gradient is copied once, by numpy), on CUDA of a contiguous copy
    where the tensor is not contiguous."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_cuda:
        import cupy
        return cupy.from_dlpack(tensor.contiguous())
    if not tensor.is_cpu:
        raise TypeError(f"data: expected a CPU or CUDA tensor, got one on {tensor.device}")
    # (a CPU tensor's numpy view shares its memory as DLPack's does, with no capsule to
    # make: bench/results/torch-modules.md#the-crossing-per-call)
    if tensor.is_neg():   # (numpy has no negative bit; DLPack ignored it)
        tensor = tensor.resolve_neg()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_ml_dtypes().bfloat16)
    return tensor.numpy()


def to_tensor(array):
    if array is None:
        return None
    if dtype_name(array.dtype) == "bfloat16":   # numpy's (ml_dtypes), no DLPack code
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    if isinstance(array, np.ndarray) and array.flags.writeable and \
            min(array.strides, default=0) >= 0:   # (from_numpy warns or refuses else)
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


class TorchHost:
    """What config.TORCH_CALLER holds during a fusedrnn.torch call: torch's operations on
    numpy arrays (zero-copy views), on torch's own thread pool. The arrays must be
    writeable with non-negative strides (torch.from_numpy's conditions; CpuBackend.matmul
    checks)."""

    @staticmethod
    def matmul(a, b, out, transpose_a=False):
        """out = a @ b, or a^T @ b."""
        a = torch.from_numpy(a)
        torch.matmul(a.T if transpose_a else a, torch.from_numpy(b), out=torch.from_numpy(out))
        return out

    @staticmethod
    def deterministic():
        """torch.use_deterministic_algorithms(True): the op's results must not depend on
        when its CPU kernels finish compiling (no first tier: fusedrnn/cpu/warm.py)."""
        return torch.are_deterministic_algorithms_enabled()

    @staticmethod
    def transpose(a, out):
        """out = a^T, a contiguous copy (numpy's transposing copy is far slower).
        Measured: bench/results/cpu-kernel-notes.md#gemm-the-training-gemms"""
        torch.from_numpy(out).copy_(torch.from_numpy(a).T)
        return out


TORCH_HOST = TorchHost()


class _from_torch:   # noqa: N801 (used as a function: `with _from_torch(data):`)
    """Around every call into the op: on torch's stream, and marked as a torch program's
    call (config.TORCH_CALLER: the CPU backend then runs its GEMMs on torch's threads and
    keeps numpy's BLAS off torch's cores). A class, not a generator: it is entered at
    every call (bench/results/torch-modules.md#the-crossing-per-call)."""

    __slots__ = ("_tensor", "_token", "_inner")

    def __init__(self, tensor):
        self._tensor = tensor

    def __enter__(self):
        tensor = self._tensor
        device = "cuda" if tensor.is_cuda else "cpu"
        # The op's own torch GEMMs (TorchHost) run in its float32, whatever autocast says.
        inner = ((_same_stream(tensor),) if tensor.is_cuda else ()) + (
            (torch.autocast(device, enabled=False),) if torch.is_autocast_enabled(device)
            else ())
        for context in inner:
            context.__enter__()
        self._inner = inner
        self._token = TORCH_CALLER.set(TORCH_HOST)
        return self

    def __exit__(self, *exc):
        TORCH_CALLER.reset(self._token)
        for context in reversed(self._inner):
            context.__exit__(*exc)
        return False


def _same_stream(tensor):
    """On CUDA, run CuPy's work on torch's current stream, so the two never race."""
    if tensor.device.type != "cuda":
        return contextlib.nullcontext()
    import cupy
    stream = torch.cuda.current_stream(tensor.device)
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:   # CuPy < 14
        return cupy.cuda.ExternalStream(stream.cuda_stream, tensor.device.index)
    return from_external(_StreamHandle(stream.cuda_stream))


class _StreamHandle:
    """A raw cudaStream_t in the CUDA stream protocol, which CuPy 14's Stream.from_external
    takes (its ExternalStream is deprecated there)."""

    def __init__(self, handle):
        self._handle = handle

    def __cuda_stream__(self):
        return (0, self._handle)


# ---- the operators: fusedrnn::rnn and fusedrnn::rnn_backward ----------------------------
# Registered with torch.library, each with a fake implementation (shapes only), so that
# torch.compile(fullgraph=True) and torch.export trace them as single nodes and never look
# inside (where DLPack needs real memory); eager CUDA calls run them too (eager CPU calls:
# _EagerRNN below, the same bodies). A training forward's reserve cannot leave an
# operator, so the forward returns `key`, a one-element int64 tensor naming its
# TrainingHandle in _HANDLES; the handle is released when the key tensor is freed (with
# the autograd graph that saved it).
_HANDLES = {}
_next_key = itertools.count(1)

_CONFIG = ("mode", "state_size", "num_layers", "bidirectional", "p", "projection_size",
           "clip_min", "clip_max", "clip_nan", "use_lengths", "train", "seed", "stored_as")


_SCALAR_DEFAULTS = dict(lstm_state_clip_min=None, lstm_state_clip_max=None,
                        lstm_state_clip_nan=False, use_sequence_length=False)


def _op_kwargs(mode, state_size, num_layers, bidirectional, p, projection_size, clip_min,
               clip_max, clip_nan, use_lengths, train, seed, stored_as):
    """The operators' flat arguments as fusedrnn.RNN's keywords (stored_as "": None)."""
    return dict(mode=mode, state_size=state_size, num_layers=num_layers,
                bidirectional=bidirectional, p=p, projection_size=projection_size or None,
                lstm_state_clip_min=clip_min, lstm_state_clip_max=clip_max,
                lstm_state_clip_nan=clip_nan, use_sequence_length=use_lengths, train=train,
                seed=None if seed < 0 else seed, _stored_as=stored_as or None)


def _key(handle):
    """A one-element int64 tensor naming a training forward's handle in _HANDLES (0: none);
    the handle is released when the tensor is freed (with the autograd graph that saved it)."""
    if handle is None:
        return torch.zeros(1, dtype=torch.int64)
    number = next(_next_key)
    key = torch.full((1,), number, dtype=torch.int64)   # (one op: not zeros, then a store)
    _HANDLES[number] = handle
    weakref.finalize(key, _release, number)
    return key


def _release(key):
    handle = _HANDLES.pop(key, None)
    if handle is not None:
        handle.release()


def _forward(data, parameters, state, state_cell, lengths, config):
    """Both forwards' body (the operator's and the eager Function's): (out, hy, cy,
    handle), cy empty for cells without a cell state, handle None unless training."""
    kwargs = _op_kwargs(*config)
    arrays = [None if t is None else to_array(t)
              for t in (data, parameters, state, state_cell, lengths)]
    with _from_torch(data):
        result = op.RNN(*arrays, state_outputs=True, **kwargs)
    cy = result[2] if CELLS[kwargs["mode"]].has_cell_state else None
    return (to_tensor(result[0]), to_tensor(result[1]),
            to_tensor(cy) if cy is not None else data.new_empty(0),
            result[-1] if kwargs["train"] else None)


def _backward(handle, heads, data, parameters, state, state_cell, lengths, config):
    """Both backwards' body: gradients (data, parameters, state, state_cell) of the forward
    `handle` kept (empty tensors for absent states). A forward without a handle is
    recomputed in training mode first: an inference forward without dropout, a training
    one (its handle released: a saved-tensor hook kept a copy of the key) with its own p
    and seed, which draw the same masks."""
    with _from_torch(data):
        if handle is None:
            kwargs = _op_kwargs(*config)
            arrays = [None if t is None else to_array(t)
                      for t in (data, parameters, state, state_cell, lengths)]
            kwargs.update(train=True, p=kwargs["p"] if kwargs["train"] else 0.0)
            handle = op.RNN(*arrays, state_outputs=True, **kwargs)[-1]
        heads = [None if g is None else to_array(g) for g in heads]
        if not CELLS[config[0]].has_cell_state:   # (config[0]: the mode, _CONFIG's first)
            heads[2] = None
        # retain: a second backward (retain_graph=True) reads the same record and masks
        grads = op.rnn_backward(handle, *heads, retain=True)
    return (to_tensor(grads.data), to_tensor(grads.parameters),
            to_tensor(grads.state) if state is not None else data.new_empty(0),
            to_tensor(grads.state_cell) if state_cell is not None else data.new_empty(0))


@torch.library.custom_op("fusedrnn::rnn", mutates_args=())
def rnn_op(data: Tensor, parameters: Tensor, state: Optional[Tensor],
           state_cell: Optional[Tensor], lengths: Optional[Tensor], mode: str, state_size: int,
           num_layers: int, bidirectional: bool, p: float, projection_size: int,
           clip_min: Optional[float], clip_max: Optional[float], clip_nan: bool,
           use_lengths: bool, train: bool, seed: int,
           stored_as: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, hy, cy, key): cy empty for cells without a cell state; key names the
    training handle (0: none, an inference forward). stored_as: op.RNN's _stored_as, ""
    for none."""
    out, hy, cy, handle = _forward(data, parameters, state, state_cell, lengths,
                                   (mode, state_size, num_layers, bidirectional, p,
                                    projection_size, clip_min, clip_max, clip_nan,
                                    use_lengths, train, seed, stored_as))
    return out, hy, cy, _key(handle)


def _refuse_onnx_export():
    raise NotImplementedError(
        "fusedrnn.torch.rnn (fusedrnn.RNN on tensors) has no ONNX export: the modules "
        "fusedrnn.torch.RNN/LSTM/GRU export, as ONNX's RNN/LSTM/GRU operators")


@rnn_op.register_fake
def _rnn_shapes(data, parameters, state, state_cell, lengths, mode, state_size, num_layers,
                bidirectional, p, projection_size, clip_min, clip_max, clip_nan, use_lengths,
                train, seed, stored_as):
    if torch.onnx.is_in_onnx_export():
        # The operator reached torch.onnx.export's graph capture, where no ONNX runtime
        # could run it: the functional call, or torch.export's strict retry of a module
        # (dynamo reads is_in_onnx_export as False, so the module took its fused path).
        _refuse_onnx_export()
    T, N = data.shape[0], data.shape[1]
    D, R = (2 if bidirectional else 1), projection_size or state_size
    cy_shape = (num_layers * D, N, state_size) if CELLS[mode].has_cell_state else (0,)
    return (data.new_empty((T, N, D * R)), data.new_empty((num_layers * D, N, R)),
            data.new_empty(cy_shape), torch.empty(1, dtype=torch.int64))


@torch.library.custom_op("fusedrnn::rnn_backward", mutates_args=())
def rnn_backward_op(key: Tensor, dout: Optional[Tensor], dhy: Optional[Tensor],
                    dcy: Optional[Tensor], data: Tensor, parameters: Tensor,
                    state: Optional[Tensor], state_cell: Optional[Tensor],
                    lengths: Optional[Tensor], mode: str, state_size: int, num_layers: int,
                    bidirectional: bool, p: float, projection_size: int,
                    clip_min: Optional[float], clip_max: Optional[float], clip_nan: bool,
                    use_lengths: bool, train: bool, seed: int, stored_as: str
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients (data, parameters, state, state_cell) of the forward `key` names: _backward."""
    return _backward(_HANDLES.get(key.item()), (dout, dhy, dcy), data, parameters, state,
                     state_cell, lengths, (mode, state_size, num_layers, bidirectional, p,
                                           projection_size, clip_min, clip_max, clip_nan,
                                           use_lengths, train, seed, stored_as))


@rnn_backward_op.register_fake
def _rnn_backward_shapes(key, dout, dhy, dcy, data, parameters, state, state_cell, lengths,
                         *config):
    return (torch.empty_like(data), torch.empty_like(parameters),
            torch.empty_like(state) if state is not None else data.new_empty(0),
            torch.empty_like(state_cell) if state_cell is not None else data.new_empty(0))


def _rnn_setup(ctx, inputs, output):
    data, parameters, state, state_cell, lengths = inputs[:5]
    ctx.config = inputs[5:]
    # Saved also for torch's version counters: an in-place change of an input before
    # backward raises there, as with torch.nn, instead of changing the gradients.
    ctx.save_for_backward(output[3], data, parameters, state, state_cell, lengths)


def _rnn_grad(ctx, dout, dhy, dcy, dkey):
    key, data, parameters, state, state_cell, lengths = ctx.saved_tensors
    if dout is None and dhy is None and dcy is None:   # no gradient reached any output
        return (None,) * (5 + len(_CONFIG))
    grads = torch.ops.fusedrnn.rnn_backward(key, dout, dhy, dcy, data, parameters, state,
                                            state_cell, lengths, *ctx.config)
    return (grads[0], grads[1], grads[2] if state is not None else None,
            grads[3] if state_cell is not None else None) + (None,) * (1 + len(_CONFIG))


rnn_op.register_autograd(_rnn_grad, setup_context=_rnn_setup)


def _no_double_backward(ctx, *grads):
    raise RuntimeError("fusedrnn: the RNN's gradients are not differentiable (no double "
                       "backward); take them without create_graph=True, or use torch.nn "
                       "where second derivatives are needed")


rnn_backward_op.register_autograd(_no_double_backward,
                                  setup_context=lambda ctx, inputs, output: None)


# ---- eager calls: the same bodies without the operators' dispatch ---------------------
# An eager call on plain tensors, outside any tracer, mode or functorch transform, runs
# the bodies directly (no gradient to record) or through _EagerRNN (an autograd.Function):
# the operator's dispatch fills in and checks every argument again at each call.
# Measured: bench/results/torch-modules.md#eager-calls-without-the-operators-dispatch
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _eager(tensors):
    """Whether a call on these tensors (data first) runs eagerly: plain CPU tensors, nothing
    tracing. (CUDA calls keep the operator until a GPU session has timed the eager path.)"""
    return (tensors[0].is_cpu and _untraced()
            and all(t is None or type(t) in _PLAIN for t in tensors))


def _untraced():
    """Whether nothing is tracing or intercepting torch's calls here (a torch.compile or
    torch.export trace, torch.jit.trace, a dispatch or torch-function mode such as
    FakeTensorMode, a torch.func transform): such a call needs the operator."""
    return not (torch.compiler.is_compiling() or torch.jit.is_tracing()
                or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled()
                or torch._C._functorch.peek_interpreter_stack() is not None)


def views_reach(data, *states):
    """Whether a call on `data` and `states` (a module's) may take the module's flat tensor
    as it is, with the parameters that are views of it (rnn's `_views`): it runs eagerly
    (_call) and casts no parameter (no autocast, and a dtype the arrays hold)."""
    return (_eager((data, *states)) and not torch.is_autocast_enabled("cpu")
            and (data.dtype != torch.bfloat16 or _arrays_hold(data.dtype, data.device)))


class _EagerRNN(torch.autograd.Function):
    """fusedrnn::rnn's autograd formula for eager calls: the same forward and backward.
    With `views` (parameter tensors that are views of `parameters`, at `spans`: (name,
    offset, shape) each), the parameters' gradient goes to them, in pieces, as a module's
    parameters would receive it through its joined copy (`weight`), without the copy."""

    @staticmethod
    def forward(ctx, data, parameters, state, state_cell, lengths, config, spans, *views):
        out, hy, cy, handle = _forward(data, parameters, state, state_cell, lengths, config)
        ctx.config, ctx.spans = config, spans
        # The handle lives as long as a saved key, as the operator's: freed by the backward
        # (or at once where torch.utils.checkpoint saves nothing, recomputing at backward).
        key = _key(handle)
        # (as _rnn_setup; the views for their version counters: an in-place change of a
        # parameter before backward raises there, as with torch.nn)
        ctx.save_for_backward(key, data, parameters, state, state_cell, lengths, *views)
        ctx.set_materialize_grads(False)
        return out, hy, cy

    @staticmethod
    def backward(ctx, dout, dhy, dcy):
        key, data, parameters, state, state_cell, lengths = ctx.saved_tensors[:6]
        if dout is None and dhy is None and dcy is None:   # no gradient reached any output
            return (None,) * (7 + len(ctx.spans))
        if torch.is_grad_enabled():   # create_graph=True: the operator, which refuses a second
            grads = torch.ops.fusedrnn.rnn_backward(key, dout, dhy, dcy, data, parameters,
                                                    state, state_cell, lengths, *ctx.config)
        else:
            grads = _backward(_HANDLES.get(key.item()), (dout, dhy, dcy), data, parameters,
                              state, state_cell, lengths, ctx.config)
        g_params = grads[1]
        base = g_params.storage_offset()   # (as_strided counts from the storage's start)
        return (grads[0], None if ctx.spans else g_params,
                grads[2] if state is not None else None,
                grads[3] if state_cell is not None else None, None, None, None,
                *(g_params.as_strided(shape, _strides(shape), base + offset)   # (one op each)
                  for _, offset, shape in ctx.spans))


@functools.cache
def _strides(shape):
    """A contiguous tensor's strides for `shape` (in elements)."""
    return tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))


def _call(tensors, config, needs_grad, views=None):
    """(out, hy, cy) of fusedrnn::rnn on tensors (data, parameters, state, state_cell,
    lengths) with the operator's flat config: eager on plain tensors, else the operator.
    views: rnn's `_views` (its caller checked views_reach)."""
    if views is not None or _eager(tensors):
        if needs_grad:
            spans, params = views if views is not None else ((), ())
            return _EagerRNN.apply(*tensors, config, spans, *params)
        out, hy, cy, handle = _forward(*tensors, config)
        if handle is not None:   # (dropout's masks drawn in training mode, no backward)
            handle.release()
        return out, hy, cy
    return torch.ops.fusedrnn.rnn(*tensors, *config)[:3]


def _autocast(*tensors):
    """Under torch.autocast for data's device, the float32 tensors in autocast's dtype (as
    torch.nn's RNNs run there); float64 is left alone, as autocast does."""
    device = "cuda" if tensors[0].is_cuda else "cpu"   # (others: to_array refuses them)
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None and t.dtype == torch.float32 else t
                 for t in tensors)


def rnn(data, parameters, state=None, state_cell=None, sequence_length=None, *,
        state_outputs=False, train=None, _stored_as="", _views=None, **kwargs):
    """fusedrnn.RNN for torch tensors, differentiable with torch.autograd.

    `train` is training mode: dropout applies and, when autograd will need a backward,
    the forward keeps what backward reads. It defaults to whether autograd needs one. In
    inference mode (train=False) a backward still works: it recomputes the forward.
    _views (a module's): (spans, tensors) where `parameters` is a flat tensor the tensors
    are views of, at spans ((name, offset, shape) each): its gradient goes to them (_EagerRNN);
    the caller has checked views_reach(data, state, state_cell)."""
    where = data.get_device()   # (an int, not a device object; -1 for the CPU and meta alike)
    for name, value in (("parameters", parameters), ("state", state),
                        ("state_cell", state_cell), ("sequence_length", sequence_length)):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor like data, got "
                            f"{type(value).__module__}.{type(value).__name__}")
        if value.get_device() != where or value.is_cpu != data.is_cpu or \
                value.is_cuda != data.is_cuda:
            raise ValueError(f"{name}: expected a tensor on data's device {data.device}, "
                             f"got one on {value.device}")
    if train is not None and not isinstance(train, bool):
        raise TypeError(f"train: expected a bool or None, got {type(train).__name__} {train!r}")
    # (traced shapes would fail check_config below; a module's views: an eager call)
    if _views is None and torch.onnx.is_in_onnx_export():
        _refuse_onnx_export()
    data, parameters, state, state_cell = _autocast(data, parameters, state, state_cell)
    if data.dtype == torch.bfloat16 and not _arrays_hold(data.dtype, data.device):
        # bfloat16 the arrays cannot hold (on CUDA; on CPU without ml_dtypes): the same
        # float32 computation, with torch's casts (differentiable) on either side. On CUDA
        # the op is told what the data was (op.RNN's _stored_as): its products then run in
        # bfloat16, as for CPU bfloat16 data.
        with torch.autocast(data.device.type, enabled=False):
            outs = rnn(*(t if t is None or not t.is_floating_point() else t.float()
                         for t in (data, parameters, state, state_cell, sequence_length)),
                       state_outputs=True, train=train,
                       _stored_as="bfloat16" if data.device.type == "cuda" else "", **kwargs)
        outs = tuple(t.to(data.dtype) for t in outs)
        return outs if state_outputs else outs[0]
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (data, parameters, state, state_cell,
                                                    *(_views[1] if _views else ())))
    train = needs_grad if train is None else train
    p = kwargs.get("p", 0.0)
    if train and isinstance(p, (int, float)) and p > 0 and kwargs.get("seed") is None:
        kwargs["seed"] = int(torch.randint(0, 2 ** 62, (1,)).item())  # follows torch.manual_seed
    lengths = None
    if sequence_length is not None:
        lengths = sequence_length.to(device=data.device, dtype=torch.int64)
    if data.dim() == 3:   # (shape errors are the operator's: op.RNN says them)
        check_scalars(check_config(kwargs.get("mode"), data.shape[2], kwargs.get("state_size"),
                                   kwargs.get("num_layers"), kwargs.get("bidirectional", False),
                                   kwargs.get("projection_size")),
                      p=p, train=train, seed=kwargs.get("seed"),
                      **{k: kwargs.get(k, d) for k, d in _SCALAR_DEFAULTS.items()})
    if train and not needs_grad and not (isinstance(p, (int, float)) and p > 0
                                         and kwargs.get("num_layers", 1) > 1):
        # Training mode that autograd will not differentiate (a module left in train()
        # under torch.no_grad) with no dropout to draw: the same results as inference, so
        # no record is kept.
        # Measured: bench/results/torch-modules.md#training-mode-without-a-gradient
        train = False
    config = (kwargs["mode"], kwargs["state_size"], kwargs["num_layers"],   # (_CONFIG's order)
              kwargs.get("bidirectional", False), p, kwargs.get("projection_size") or 0,
              kwargs.get("lstm_state_clip_min"), kwargs.get("lstm_state_clip_max"),
              kwargs.get("lstm_state_clip_nan", False), kwargs.get("use_sequence_length", False),
              train, -1 if kwargs.get("seed") is None else kwargs["seed"], _stored_as)
    out, hy, cy = _call((data, parameters, state, state_cell, lengths), config, needs_grad,
                        _views)
    if not state_outputs:
        return out
    return (out, hy, cy) if CELLS[kwargs["mode"]].has_cell_state else (out, hy)
