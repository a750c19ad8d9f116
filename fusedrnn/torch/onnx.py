"""ONNX export of the drop-in modules: under `torch.onnx.export` a module's
forward writes ONNX's own RNN / LSTM / GRU operator, one node per layer, instead of
calling fusedrnn::rnn (which no ONNX runtime knows).

Both of torch's exporters are served, and the user passes nothing extra:
- the default (dynamo) exporter runs the forward on fake tensors under torch.export:
  each layer is `torch.onnx.ops.symbolic_multi_out`, which the exporter writes as the
  named ONNX node; its output shapes are the input's symbolic sizes, so batch and
  sequence length stay dynamic where `dynamic_shapes` / `dynamic_axes` ask for it.
- `dynamo=False` traces the forward with torch.jit.trace: each layer is an
  autograd.Function whose `symbolic` the TorchScript exporter calls (the forward gives
  zeros of the right shapes: the trace records only the node, never values).
Neither runs the fused kernels (fake or traced tensors have no memory to hand them).

The weights are converted in the graph (gate blocks reordered to ONNX's order, the two
biases joined as B = [Wb; Rb], both directions stacked); the exporters fold those
operations on the parameters into constants. ONNX's layer output (T, D, N, H) is turned
into torch's (T, N, D*H) between layers. PackedSequence input becomes the operators'
`sequence_lens` under the TorchScript exporter (check_packed: why not the other). What
ONNX's operators cannot express is refused with NotImplementedError naming it: LSTM
projection (proj_size), inter-layer dropout in training mode. docs/export.md is the
user's account.

This module imports torch only: onnx, onnxscript and onnxruntime (the `[onnx]` extra) are
the exporter's business, so importing fusedrnn.torch never needs them.
"""
from __future__ import annotations

import torch

from ..config import CELLS

__all__ = ["check_packed", "exporting", "forward", "repack"]


def exporting():
    """Whether torch.onnx.export is running the forward, under either exporter.
    (torch.compile and torch.export alone see False: the fused operator stays.)"""
    return torch.onnx.is_in_onnx_export()


def _name(module):
    return f"fusedrnn.torch.{type(module).__name__}"


def check_packed(module):
    """PackedSequence input exports under the TorchScript exporter only, as torch.nn's: its
    packing and unpacking (prim::PackPadded / PadPacked) cancel out in that exporter's
    graph, leaving the padded batch and its lengths, ONNX's `sequence_lens`. torch.export
    cannot trace packing at all (nor can the default exporter, torch.nn's included)."""
    if not torch.jit.is_tracing():
        raise NotImplementedError(
            f"{_name(module)}: ONNX export of PackedSequence input needs the TorchScript "
            f"exporter (torch.onnx.export(..., dynamo=False)); the default exporter cannot "
            f"trace packing. Or export on the padded tensor")


def repack(out, like, lengths):
    """(T, N, F) padded output -> a PackedSequence with `like`'s batch_sizes and order,
    in operations the TorchScript exporter traces (packing that the model's unpacking
    cancels)."""
    order = like.sorted_indices
    if order is not None:
        out, lengths = out.index_select(1, order), lengths[order]
    data, batch_sizes = torch._VF._pack_padded_sequence(out, lengths, False)
    return type(like)(data, batch_sizes, like.sorted_indices, like.unsorted_indices)


def _refuse_unsupported(module):
    cfg = module.layout.config
    if cfg.projection_size:
        raise NotImplementedError(
            f"{_name(module)}: ONNX export with proj_size={cfg.projection_size} is not "
            f"supported: ONNX's LSTM operator has no projection")
    if module.training and module.dropout > 0 and cfg.num_layers > 1:
        raise NotImplementedError(
            f"{_name(module)}: ONNX export in training mode with dropout={module.dropout} "
            f"is not supported: ONNX's operators have no dropout between layers; call "
            f"model.eval() before torch.onnx.export")


def _attributes(cell, hidden_size, directions):
    """The node's attributes for this mode (the table's onnx_* fields)."""
    attrs = {"hidden_size": hidden_size,
             "direction": "bidirectional" if directions == 2 else "forward"}
    if cell.onnx_activations is not None:   # one list entry per direction
        attrs["activations"] = list(cell.onnx_activations) * directions
    if cell.onnx_linear_before_reset:
        attrs["linear_before_reset"] = 1
    return attrs


def _onnx_gate_order(w, cell, hidden_size):
    """w's H-row gate blocks (rows of W_x, W_h, or a bias) in the ONNX operator's order."""
    order = cell.onnx_gate_order
    if order == tuple(range(cell.gates)):
        return w
    return torch.cat([w[g * hidden_size:(g + 1) * hidden_size] for g in order])


def _layer_weights(params, layer, cfg, cell):
    """One layer's W (D, G*H, In), R (D, G*H, H) and B (D, 2*G*H) or None (no bias: the
    operator's default is zeros), both directions stacked, forward first."""
    H, dirs = cfg.state_size, range(cfg.directions)

    def stacked(kinds):
        return torch.stack([torch.cat([_onnx_gate_order(params[(layer, d, k)], cell, H)
                                       for k in kinds]) for d in dirs])
    B = stacked(("b_x", "b_h")) if (layer, 0, "b_x") in params else None
    return stacked(("W_x",)), stacked(("W_h",)), B


class _TorchScriptNode(torch.autograd.Function):
    """One layer as one ONNX node under the TorchScript exporter (dynamo=False)."""

    @staticmethod
    def forward(ctx, x, W, R, B, lens, h, c, op_type, attrs, outputs):
        # Traced, never run for real: zeros of the node's output shapes.
        T, N, D, H = x.shape[0], x.shape[1], W.shape[0], dict(attrs)["hidden_size"]
        return (x.new_zeros((T, D, N, H)),) + tuple(
            x.new_zeros((D, N, H)) for _ in range(outputs - 1))

    @staticmethod
    def symbolic(g, x, W, R, B, lens, h, c, op_type, attrs, outputs):
        def absent():   # an omitted optional input ("" in ONNX)
            node = g.op("prim::Constant")
            node.setType(torch._C.OptionalType.ofTensor())
            return node
        inputs = [x, W, R, B, lens, h, c]
        while inputs[-1] is None:
            inputs.pop()
        suffix = {int: "_i", str: "_s", list: "_s"}
        kwargs = {name + suffix[type(value)]: value for name, value in attrs}
        return g.op(op_type, *[absent() if t is None else t for t in inputs],
                    outputs=outputs, **kwargs)


def _torchscript_node(cell, x, W, R, B, lens, h, c, attrs):
    outputs = 3 if cell.has_cell_state else 2   # Y, Y_h (and Y_c)
    return _TorchScriptNode.apply(x, W, R, B, lens, h, c, cell.onnx_op, tuple(attrs.items()),
                                  outputs)


def _dynamo_node(cell, x, W, R, B, lens, h, c, attrs):
    from torch.onnx import ops
    T, N, D, H = x.shape[0], x.shape[1], W.shape[0], attrs["hidden_size"]
    inputs = [x, W, R, B, lens, h] + ([c] if cell.has_cell_state else [])
    outputs = 3 if cell.has_cell_state else 2   # Y, Y_h (and Y_c)
    return ops.symbolic_multi_out(cell.onnx_op, inputs, attrs, dtypes=[x.dtype] * outputs,
                                  shapes=[(T, D, N, H)] + [(D, N, H)] * (outputs - 1))


def forward(module, data, h0, c0, lengths=None):
    """The module's forward on data (T, N, I) for torch.onnx.export: (out (T, N, D*H),
    hy (L*D, N, H), cy (L*D, N, H) or None), as ONNX operators; `lengths` (N,), each
    sample's own length (a PackedSequence's), or None: all T steps."""
    _refuse_unsupported(module)
    cfg, cell = module.layout.config, CELLS[module.mode]
    D, H = cfg.directions, cfg.state_size
    attrs = _attributes(cell, H, D)
    node = _torchscript_node if torch.jit.is_tracing() else _dynamo_node
    params = module.views()
    lens = None if lengths is None else lengths.to(torch.int32)   # ONNX's sequence_lens
    x, hs, cs = data, [], []
    for layer in range(cfg.num_layers):
        W, R, B = _layer_weights(params, layer, cfg, cell)
        h, c = (None if s is None else s[layer * D:(layer + 1) * D]
                for s in (h0, c0 if cell.has_cell_state else None))
        y, *states = node(cell, x, W, R, B, lens, h, c, attrs)
        # ONNX's Y is (T, D, N, H); torch's output and the next layer's input (T, N, D*H).
        # (select, not squeeze: squeeze of a dimension the TorchScript exporter cannot see
        # is 1 becomes an If node.)
        x = y.select(1, 0) if D == 1 else y.transpose(1, 2).flatten(2)
        hs.append(states[0])
        cs.extend(states[1:])
    hy = hs[0] if len(hs) == 1 else torch.cat(hs)
    cy = None if not cs else cs[0] if len(cs) == 1 else torch.cat(cs)
    return x, hy, cy
