"""Drop-in replacements for torch.nn.RNN / LSTM / GRU running on fusedrnn.

Same constructor and forward signature as torch.nn (input_size, hidden_size, num_layers,
nonlinearity, bias, batch_first, dropout, bidirectional, proj_size; forward(input, hx)),
PackedSequence and unbatched (T, I) input included; flatten_parameters() and
all_weights. The parameters are torch.nn's (weight_ih_l0, weight_hh_l0, bias_ih_l0, ...,
_reverse, weight_hr_l0), by name and order, so state_dicts load both ways. They are views
of one flat tensor in fusedrnn's layout (as torch.nn's are of cuDNN's buffer after
flatten_parameters()), laid out again after .to(), a copy or unpickling: a call that
records nothing for a backward passes that tensor as it is, and so does an eager CPU call
that trains every parameter (with them, so their gradients reach them); any other call,
or one whose parameters were replaced since, joins them into fusedrnn's flat vector
(`weight`, one copy): _call_weight.
Gradients are differentiable once: a second backward through them raises.
Under torch.onnx.export (either exporter) the forward writes ONNX's own RNN / LSTM / GRU
operators instead of calling fusedrnn's (onnx.py).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..config import CELLS, check_config
from ..layout import BIAS_KINDS, ParamLayout
from . import onnx as _onnx
from .autograd import rnn, views_reach


def _mode_of(torch_class, nonlinearity=None):
    """The mode whose CellSpec names this torch.nn class (and nonlinearity)."""
    for mode, cell in CELLS.items():
        if (cell.torch_class, cell.nonlinearity) == (torch_class, nonlinearity):
            return mode
    known = " or ".join(repr(c.nonlinearity) for c in CELLS.values()
                        if c.torch_class == torch_class)
    raise ValueError(f"nonlinearity: expected {known}, got {nonlinearity!r}")


class _FusedRNNBase(nn.Module):
    def __init__(self, mode, input_size, hidden_size, num_layers=1, bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, proj_size=0,
                 device=None, dtype=None):
        super().__init__()
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout}")
        if proj_size and proj_size >= hidden_size:
            raise ValueError(f"proj_size: expected less than hidden_size={hidden_size}, "
                             f"got {proj_size}")
        self.mode, self.input_size, self.hidden_size = mode, input_size, hidden_size
        self.num_layers, self.bias, self.batch_first = num_layers, bias, batch_first
        self.dropout, self.bidirectional, self.proj_size = float(dropout), bidirectional, proj_size
        self.layout = ParamLayout(check_config(mode, input_size, hidden_size, num_layers,
                                               bidirectional, proj_size or None))
        # torch.nn's parameters, by its names and in its order (so named_parameters,
        # optimizer groups, clipping and state_dicts see what they see on torch.nn; without
        # bias there are none for the biases, which count as zeros).
        cfg = self.layout.config
        kinds = ("W_x", "W_h") + (BIAS_KINDS if bias else ()) + (
            ("W_r",) if cfg.projection_size else ())
        self._keys = [(layer, d, kind) for layer in range(cfg.num_layers)
                      for d in range(cfg.directions) for kind in kinds]
        for key in self._keys:
            shape = self.layout.blocks[key][1]
            self.register_parameter(self.layout.torch_name(*key), nn.Parameter(
                torch.empty(shape, device=device, dtype=dtype)))
        self._flat = None
        self.flatten_parameters()
        self.reset_parameters()

    def reset_parameters(self):
        """torch.nn's initialisation, in its order: every weight and bias
        ~ U(-1/sqrt(H), 1/sqrt(H)) (the same values as torch.nn's under the same seed)."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        with torch.no_grad():
            for p in self.parameters():
                p.uniform_(-bound, bound)

    def views(self):
        """Every parameter keyed (layer, direction, kind) (fusedrnn.layout's names); the
        biases of a module without bias are absent."""
        return {key: getattr(self, self.layout.torch_name(*key)) for key in self._keys}

    @property
    def weight(self):
        """The parameters as one flat vector in fusedrnn's (MXNet's) layout, built from
        them (differentiable: its gradient reaches each parameter)."""
        params, pieces = self._parameters, []
        for name, size in self._pieces():
            p = params.get(name) if name else None
            if p is None and name:   # an attribute: prune's, parametrize's
                p = getattr(self, name)
            pieces.append((p, size))
        like = next(p for p, _ in pieces if p is not None)
        return torch.cat([p.reshape(-1) if p is not None else like.new_zeros(size)
                          for p, size in pieces])

    def _pieces(self):
        """(torch name, size) of every block of the flat vector, in its order; the name
        None for a bias block of a module without bias (no parameter: zeros)."""
        pieces = self.__dict__.get("_pieces_")
        if pieces is None:
            keys = set(self._keys)
            pieces = self.__dict__["_pieces_"] = tuple(
                (self.layout.torch_name(*key) if key in keys else None, math.prod(shape))
                for key, (_, shape) in sorted(self.layout.blocks.items(),
                                              key=lambda b: b[1][0]))
        return pieces

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A flat `weight` in fusedrnn's layout (a checkpoint of fusedrnn.torch before it
        # took torch.nn's names) becomes the named parameters.
        key = prefix + "weight"
        if key in state_dict:
            flat = state_dict.pop(key)
            try:
                named = self.layout.to_torch_state_dict(
                    flat.detach().cpu().float().numpy() if flat.dtype == torch.bfloat16
                    else flat.detach().cpu().numpy())
            except ValueError as e:
                error_msgs.append(str(e))
                return
            for name, value in named.items():
                if hasattr(self, name):
                    state_dict[prefix + name] = torch.as_tensor(value).to(flat.dtype)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def __prepare_scriptable__(self):
        raise NotImplementedError("fusedrnn.torch modules: TorchScript (torch.jit.script) is "
                                  "not supported; torch.compile(fullgraph=True) and "
                                  "torch.export trace them (fusedrnn::rnn)")

    def flatten_parameters(self):
        """Lay the parameters out again as views of one flat tensor in fusedrnn's layout
        (torch.nn's call before cuDNN; here it spares an inference call the joining copy).
        Nothing where they differ in dtype or device. The module calls it itself, on
        construction and after _apply (.to(), .half(), .cuda(), ...); where they are laid
        out already, nothing (torch.nn code calls it before every forward).
        Measured: bench/results/torch-modules.md#the-parameters-as-views-of-one-flat-tensor"""
        if self._flat_weight() is not None:
            return
        views = self.views()
        ps = list(views.values())
        if any(p.dtype != ps[0].dtype or p.device != ps[0].device for p in ps) or \
                ps[0].device.type == "meta":
            self._flat = None
            return
        flat = torch.zeros(self.layout.size, dtype=ps[0].dtype, device=ps[0].device)
        with torch.no_grad():
            for key, p in views.items():
                view = self.layout.view(flat, *key)
                view.copy_(p)
                p.data = view   # (the same Parameter: optimizers keep theirs)
        self._flat = flat

    def _flat_weight(self):
        """The flat tensor the parameters are views of, or None where one was replaced,
        moved or reshaped since flatten_parameters (their addresses tell: the tensor is
        alive, so nothing else can sit at them) or torch.compile traces the module."""
        flat = getattr(self, "_flat", None)   # (absent: a module pickled before it)
        if flat is None or torch.compiler.is_compiling():
            return None
        base, size, params = flat.data_ptr(), flat.element_size(), self._parameters
        dtype, cuda = flat.dtype, flat.is_cuda   # (a device's pointers are its own)
        for name, offset, shape in self._spans():
            p = params.get(name)   # (None: pruned or parametrized, an attribute now)
            if p is None or p.data_ptr() != base + offset * size or p.shape != shape or \
                    not p.is_contiguous() or p.dtype != dtype or p.is_cuda != cuda:
                self._flat = None   # (not to hold a replaced parameter's old memory)
                return None
        return flat

    def _spans(self):
        """(parameter name, offset, shape) of each parameter in the flat vector."""
        spans = self.__dict__.get("_spans_")
        if spans is None:
            spans = self.__dict__["_spans_"] = tuple(
                (self.layout.torch_name(*key), *self.layout.blocks[key]) for key in self._keys)
        return spans

    def _call_weight(self, data, *states):
        """(the flat parameter vector for a call on `data`, rnn's `_views`):
        - a call that records nothing for a backward (grad mode off, or nothing requires
          grad) passes the flat tensor the parameters are views of, as it is;
        - one whose gradient reaches every parameter, eager and casting nothing
          (autograd.views_reach), passes it with them: their gradients go to them in
          pieces (no copy, nor its split in the backward);
        - any other (a frozen or partly frozen module, a traced call, a cast, parameters
          replaced since flatten_parameters) passes `weight`, their joined copy. (Its
          backward reads the copy: a frozen parameter changed in place before backward
          leaves the gradient as computed.)
        Measured: bench/results/torch-modules.md#eager-calls-without-the-operators-dispatch"""
        flat, params = self._flat_weight(), self._parameters
        if torch.is_grad_enabled():
            trained = [p.requires_grad for p in params.values() if p is not None]
            if any(trained) or any(t is not None and t.requires_grad for t in (data, *states)):
                if flat is not None and all(trained) and views_reach(data, *states):
                    spans = self._spans()
                    return flat, (spans, tuple(params[name] for name, _, _ in spans))
                return self.weight, None
        return (flat if flat is not None else self.weight), None

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        if self._flat_weight() is None:   # (share_memory_ and the like keep the views)
            self.flatten_parameters()
        return module

    def __setstate__(self, state):   # copy.deepcopy and unpickling copy each parameter
        super().__setstate__(state)
        if self._flat_weight() is None:
            self.flatten_parameters()

    @property
    def all_weights(self):
        """torch.nn's list per layer and direction of its parameters, in its order."""
        views, cfg = self.views(), self.layout.config
        return [[p for (lyr, d, _), p in views.items() if (lyr, d) == (layer, direction)]
                for layer in range(cfg.num_layers) for direction in range(cfg.directions)]

    def _check_hx(self, hx):
        """hx as _forward takes it: None, h_0, or the tuple (h_0, c_0) of a cell with a
        cell state; a TypeError for any other (an LSTM's pair given to a GRU would
        otherwise run silently with its h_0)."""
        if hx is None:
            return None
        name = type(self).__name__
        if CELLS[self.mode].has_cell_state:
            if isinstance(hx, (tuple, list)) and len(hx) == 2 and all(
                    isinstance(s, torch.Tensor) for s in hx):
                return tuple(hx)
            raise TypeError(f"hx: {name} expected a tuple (h_0, c_0) of two tensors, got "
                            f"{_describe(hx)}")
        if isinstance(hx, torch.Tensor):
            return hx
        hint = (f" ({name} has no cell state: pass h_0 alone, not an LSTM's (h_0, c_0))"
                if isinstance(hx, (tuple, list)) else "")
        raise TypeError(f"hx: {name} expected a tensor h_0, got {_describe(hx)}{hint}")

    def forward(self, input, hx=None):
        hx = self._check_hx(hx)
        packed = isinstance(input, PackedSequence)
        h0, c0 = (hx if isinstance(hx, tuple) else (hx, None)) if hx is not None else (None, None)
        unbatched = not packed and input.dim() == 2
        states = [s for s in (h0, c0) if s is not None]
        if any(s.dim() != (2 if unbatched else 3) for s in states):
            raise ValueError(f"hx: for {'unbatched 2-D' if unbatched else 'batched 3-D'} "
                             f"input expected {2 if unbatched else 3}-D states, got "
                             f"{[s.dim() for s in states]}-D")
        if not unbatched:
            return self._forward(input, hx, self.batch_first)
        # (T, I) and (L*D, H) states, as torch.nn takes them (batch_first does not apply):
        # a batch of one.
        if hx is not None:
            hx = tuple(s.unsqueeze(1) for s in hx) if isinstance(hx, tuple) else hx.unsqueeze(1)
        out, state = self._forward(input.unsqueeze(1), hx, batch_first=False)
        state = (tuple(s.squeeze(1) for s in state) if isinstance(state, tuple)
                 else state.squeeze(1))
        return out.squeeze(1), state

    def _forward(self, input, hx, batch_first):
        packed = isinstance(input, PackedSequence)
        exporting = _onnx.exporting()
        if packed and exporting:
            _onnx.check_packed(self)
        lengths = None
        if packed:
            data, lengths = pad_packed_sequence(input, batch_first=False)
        else:
            data = input.transpose(0, 1) if batch_first else input
        data = data.contiguous()
        h0, c0 = (hx if isinstance(hx, tuple) else (hx, None)) if hx is not None else (None, None)
        has_cell = CELLS[self.mode].has_cell_state
        if exporting:   # torch.onnx.export: ONNX's own operators (fusedrnn/torch/onnx.py)
            outs = _onnx.forward(self, data, h0, c0 if has_cell else None, lengths)
        else:
            weight, views = self._call_weight(data, h0, c0)
            # (pad_packed_sequence's lengths are on the CPU, whatever the data's device)
            outs = rnn(data, weight, h0, c0 if has_cell else None,
                       lengths.to(data.device) if packed else None,
                       _views=views, state_outputs=True, train=self.training,
                       mode=self.mode, state_size=self.hidden_size, num_layers=self.num_layers,
                       bidirectional=self.bidirectional, p=self.dropout,
                       projection_size=self.proj_size or None, use_sequence_length=packed)
        out, hy = outs[0], outs[1]
        if packed:
            out = _onnx.repack(out, input, lengths) if exporting else _repack(out, input)
        elif batch_first:
            out = out.transpose(0, 1)
        return (out, (hy, outs[2])) if has_cell else (out, hy)

    def extra_repr(self):
        s = f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}"
        for name, default in (("bias", True), ("batch_first", False), ("dropout", 0.0),
                              ("bidirectional", False), ("proj_size", 0)):
            if getattr(self, name) != default:
                s += f", {name}={getattr(self, name)}"
        return s


def _describe(value):
    """A value as an error message names it: 'a tuple of 2 tensors', 'a str'."""
    if isinstance(value, (tuple, list)):
        kinds = {"tensor" if isinstance(v, torch.Tensor) else type(v).__name__ for v in value}
        return (f"a {type(value).__name__} of {len(value)} "
                f"{kinds.pop() + 's' if len(kinds) == 1 else 'values'}")
    return f"a {type(value).__name__}"


def _repack(out, like):
    """(T, N, F) padded output -> a PackedSequence with `like`'s batch_sizes and order."""
    order = like.sorted_indices if like.sorted_indices is not None else torch.arange(
        out.shape[1], device=out.device)
    pieces = [out[t, order[:int(n)]] for t, n in enumerate(like.batch_sizes)]
    return PackedSequence(torch.cat(pieces), like.batch_sizes, like.sorted_indices,
                          like.unsorted_indices)


class RNN(_FusedRNNBase):
    """torch.nn.RNN on fusedrnn (nonlinearity 'tanh' or 'relu')."""

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, device=None, dtype=None):
        mode = _mode_of("RNN", nonlinearity)
        self.nonlinearity = nonlinearity
        super().__init__(mode, input_size, hidden_size, num_layers, bias,
                         batch_first, dropout, bidirectional, 0, device, dtype)


class LSTM(_FusedRNNBase):
    """torch.nn.LSTM on fusedrnn (proj_size included)."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None):
        super().__init__(_mode_of("LSTM"), input_size, hidden_size, num_layers, bias,
                         batch_first, dropout, bidirectional, proj_size, device, dtype)


class GRU(_FusedRNNBase):
    """torch.nn.GRU on fusedrnn."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, device=None, dtype=None):
        super().__init__(_mode_of("GRU"), input_size, hidden_size, num_layers, bias,
                         batch_first, dropout, bidirectional, 0, device, dtype)
