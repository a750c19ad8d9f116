"""fusedrnn.RNN on torch tensors as a torch.autograd.Function, and the tensor <-> array
crossing it uses (DLPack, no copies). Its own module so that modules.py can import `rnn`
at its top without importing the package fusedrnn.torch, which imports modules.py.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from .. import op
from ..config import CELLS, TORCH_CALLER

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
    """The numpy (CPU) or CuPy (CUDA) view of a tensor's memory; no copy when contiguous."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.device.type == "cuda":
        import cupy
        return cupy.from_dlpack(tensor)
    if tensor.device.type != "cpu":
        raise TypeError(f"data: expected a CPU or CUDA tensor, got one on {tensor.device}")
    if tensor.dtype == torch.bfloat16:
        return np.from_dlpack(tensor.view(torch.int16)).view(_ml_dtypes().bfloat16)
    return np.from_dlpack(tensor)


def to_tensor(array):
    if array is None:
        return None
    if array.dtype.name == "bfloat16":   # numpy's (ml_dtypes), no DLPack code
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
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
    def transpose(a, out):
        """out = a^T (a contiguous copy: numpy's transposing copy of a 26 MB dG took 46 ms)."""
        torch.from_numpy(out).copy_(torch.from_numpy(a).T)
        return out


TORCH_HOST = TorchHost()


@contextlib.contextmanager
def _from_torch(tensor):
    """Around every call into the op: on torch's stream, and marked as a torch program's
    call (config.TORCH_CALLER: the CPU backend then runs its GEMMs on torch's threads and
    keeps numpy's BLAS off torch's cores)."""
    token = TORCH_CALLER.set(TORCH_HOST)
    try:
        # The op's own torch GEMMs (TorchHost) run in its float32, whatever autocast says.
        with _same_stream(tensor), torch.autocast(tensor.device.type, enabled=False):
            yield
    finally:
        TORCH_CALLER.reset(token)


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


class _RNNFunction(torch.autograd.Function):
    """out, hy, cy = f(data, parameters, state, state_cell); cy is an empty tensor for
    cells without a cell state. Backward calls rnn_backward on the forward's reserve; a
    forward that ran without one (inference mode) is recomputed in training mode first."""

    @staticmethod
    def forward(ctx, data, parameters, state, state_cell, lengths, kwargs):
        arrays = [None if t is None else to_array(t)
                  for t in (data, parameters, state, state_cell, lengths)]
        train = kwargs["train"]
        with _from_torch(data):
            result = op.RNN(*arrays[:4], arrays[4], **dict(kwargs, state_outputs=True))
        handle = result[-1] if train else None
        if handle is not None and not any(ctx.needs_input_grad[:4]):
            handle.release()  # training mode (dropout) without a backward to come
            handle = None
        out, hy = result[0], result[1]
        cy = result[2] if CELLS[kwargs["mode"]].has_cell_state else None
        ctx.handle, ctx.arrays, ctx.kwargs = handle, arrays, kwargs
        # Saved for torch's version counters: an in-place change of an input before
        # backward raises there, as with torch.nn, instead of changing the gradients.
        ctx.save_for_backward(*(t for t in (data, parameters, state, state_cell)
                                if t is not None))
        ctx.has_state, ctx.has_cell = state is not None, state_cell is not None
        ctx.set_materialize_grads(False)
        outputs = (to_tensor(out), to_tensor(hy),
                   to_tensor(cy) if cy is not None else data.new_empty(0))
        if cy is None:
            ctx.mark_non_differentiable(outputs[2])
        return outputs

    @staticmethod
    def backward(ctx, dout, dhy, dcy):
        ctx.saved_tensors  # noqa: B018  (raises if an input was modified in place)
        handle = ctx.handle
        given = [g for g in (dout, dhy, dcy) if g is not None]
        if not given:  # no gradient reached any output
            return (None,) * 6
        with _from_torch(given[0]):
            if handle is None:  # the forward ran in inference mode: recompute its record
                kwargs = dict(ctx.kwargs, train=True, p=0.0, state_outputs=True)
                handle = ctx.handle = op.RNN(*ctx.arrays[:4], ctx.arrays[4], **kwargs)[-1]
            heads = [None if g is None else to_array(g) for g in (dout, dhy, dcy)]
            if not CELLS[ctx.kwargs["mode"]].has_cell_state:
                heads[2] = None
            # retain: a second backward (retain_graph=True) reuses the same record and
            # dropout masks; the reserve is freed with the graph (ctx).
            grads = op.rnn_backward(handle, *heads, retain=True)
        results = (to_tensor(grads.data), to_tensor(grads.parameters),
                   to_tensor(grads.state) if ctx.has_state else None,
                   to_tensor(grads.state_cell) if ctx.has_cell else None)
        if torch.is_grad_enabled() and any(g.requires_grad for g in given):
            # create_graph=True: the gradients are not differentiable; a second backward
            # that reaches them raises (_NoDoubleBackward) instead of seeing constants.
            results = tuple(None if r is None else _NoDoubleBackward.apply(r, *given)
                            for r in results)
        return results + (None, None)


class _NoDoubleBackward(torch.autograd.Function):
    """grad, tied to the heads it came from, whose own backward raises: what a gradient of
    the op taken with create_graph=True returns."""

    @staticmethod
    def forward(ctx, grad, *heads):
        return grad.clone()

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("fusedrnn: the RNN's gradients are not differentiable (no double "
                           "backward); take them without create_graph=True, or use torch.nn "
                           "where second derivatives are needed")


def _autocast(*tensors):
    """Under torch.autocast for data's device, the float32 tensors in autocast's dtype (as
    torch.nn's RNNs run there); float64 is left alone, as autocast does."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None and t.dtype == torch.float32 else t
                 for t in tensors)


def rnn(data, parameters, state=None, state_cell=None, sequence_length=None, *,
        state_outputs=False, train=None, **kwargs):
    """fusedrnn.RNN for torch tensors, differentiable with torch.autograd.

    `train` is training mode: dropout applies and, when autograd will need a backward,
    the forward keeps what backward reads. It defaults to whether autograd needs one. In
    inference mode (train=False) a backward still works: it recomputes the forward."""
    for name, value in (("parameters", parameters), ("state", state),
                        ("state_cell", state_cell), ("sequence_length", sequence_length)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor like data, got "
                            f"{type(value).__module__}.{type(value).__name__}")
        if value is not None and value.device != data.device:
            raise ValueError(f"{name}: expected a tensor on data's device {data.device}, "
                             f"got one on {value.device}")
    if train is not None and not isinstance(train, bool):
        raise TypeError(f"train: expected a bool or None, got {type(train).__name__} {train!r}")
    data, parameters, state, state_cell = _autocast(data, parameters, state, state_cell)
    if not _arrays_hold(data.dtype, data.device):
        # bfloat16 the arrays cannot hold (on CUDA; on CPU without ml_dtypes): the same
        # float32 computation, with torch's casts (differentiable) on either side.
        with torch.autocast(data.device.type, enabled=False):
            outs = rnn(*(t if t is None or not t.is_floating_point() else t.float()
                         for t in (data, parameters, state, state_cell, sequence_length)),
                       state_outputs=True, train=train, **kwargs)
        outs = tuple(t.to(data.dtype) for t in outs)
        return outs if state_outputs else outs[0]
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (data, parameters, state, state_cell))
    train = needs_grad if train is None else train
    p = kwargs.get("p", 0.0)
    if train and isinstance(p, (int, float)) and p > 0 and kwargs.get("seed") is None:
        kwargs["seed"] = int(torch.randint(0, 2 ** 62, (1,)).item())  # follows torch.manual_seed
    lengths = None
    if sequence_length is not None:
        lengths = sequence_length.to(device=data.device, dtype=torch.int64)
    kwargs["train"] = train
    out, hy, cy = _RNNFunction.apply(data, parameters, state, state_cell, lengths, kwargs)
    if not state_outputs:
        return out
    return (out, hy, cy) if CELLS[kwargs["mode"]].has_cell_state else (out, hy)
