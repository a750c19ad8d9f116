"""fusedrnn.torch's modules through torch.onnx.export (issue 45), under both of torch's
exporters (the default, dynamo, and dynamo=False, TorchScript), the user passing nothing
extra: the model passes onnx.checker, its graph holds ONNX's own RNN / LSTM / GRU
operator, one node per layer and nothing of fusedrnn's, and ONNX Runtime's outputs match
torch.nn's (same state_dict, float32) within 1e-5 at batch sizes and sequence lengths
other than the exported ones.

Dynamic axes: asked for with `dynamic_axes`, both exporters keep batch and sequence length
dynamic for these modules (the default exporter's nodes take their output shapes from the
input's symbolic sizes; torch.nn's own export fixes the length there). Every case checks
both axes: the graph declares them symbolic, and ONNX Runtime runs at two other batch sizes
and two other lengths.

Of the matrix (mode x 1, 3 layers x directions x batch_first x states given or not x
exporter), the quick cases below each value once per exporter; with the `exhaustive` ones,
every combination of the values of any four of the six factors.
"""
import io
import itertools
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fusedrnn.torch as ft
from fusedrnn.config import CELLS

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

EXPORTERS = {"dynamo": True, "torchscript": False}
I, H, T, N = 4, 5, 6, 3              # the exported sizes
OTHER_SIZES = [(T, 1), (T, 5), (2, N), (11, N)]   # (T, N): two batch sizes, two lengths
ATOL = 1e-5


def export(model, args, input_names, output_names, dynamic_axes, exporter, **kwargs):
    """The ONNX model's bytes, checked by onnx.checker."""
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the exporters' advice (dynamic_axes, eval, ...)
        torch.onnx.export(model, args, f, dynamo=EXPORTERS[exporter], input_names=input_names,
                          output_names=output_names, dynamic_axes=dynamic_axes,
                          verbose=False, **kwargs)
    onnx.checker.check_model(onnx.load_from_string(f.getvalue()), full_check=True)
    return f.getvalue()


def session(model_bytes):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def dims(value_info):
    """A graph input's or output's shape: ints where fixed, names where symbolic."""
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def assert_rnn_nodes(model_bytes, op_type, num_layers, directions):
    """One node of ONNX's `op_type` per layer, with its hidden size and direction; no
    other recurrent node, and nothing outside ONNX's own domain (no fusedrnn operator)."""
    graph = onnx.load_from_string(model_bytes).graph
    nodes = [n for n in graph.node if n.op_type == op_type]
    assert len(nodes) == num_layers, [n.op_type for n in graph.node]
    assert not [n.op_type for n in graph.node
                if n.op_type in ("RNN", "LSTM", "GRU", "Loop", "Scan") and n.op_type != op_type]
    assert all(n.domain in ("", "ai.onnx") for n in graph.node), \
        sorted({(n.domain, n.op_type) for n in graph.node})
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["hidden_size"] == H
        assert attrs.get("direction", b"forward") == (b"bidirectional" if directions == 2
                                                      else b"forward")
    return graph


def assert_close(got, expected):
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e.detach().numpy(), rtol=0, atol=ATOL)


def modules(mode, **kw):
    """(torch.nn module, fusedrnn.torch module with its state_dict), float32, eval mode."""
    cell = CELLS[mode]
    torch.manual_seed(0)
    theirs = cell.torch_module(torch.nn, **kw).eval()
    ours = cell.torch_module(ft, **kw).eval()
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def check_module(mode, num_layers, bidirectional, batch_first, states, exporter):
    cell, D = CELLS[mode], 2 if bidirectional else 1
    # Inter-layer dropout in eval mode: nothing to export, nothing to change.
    theirs, ours = modules(mode, input_size=I, hidden_size=H, num_layers=num_layers,
                           bidirectional=bidirectional, batch_first=batch_first,
                           dropout=0.25 if num_layers > 1 else 0.0)
    state_names = ["h0", "c0"][:1 + cell.has_cell_state] if states else []
    out_names = ["y", "hy", "cy"][:2 + cell.has_cell_state]

    def inputs(t, n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(*((n, t, I) if batch_first else (t, n, I)), generator=g)
        return [x] + [torch.randn(num_layers * D, n, H, generator=g) for _ in state_names]

    def call(module, args):
        hx = None if not states else tuple(args[1:]) if cell.has_cell_state else args[1]
        out, state = module(args[0], hx)
        return [out, *(state if cell.has_cell_state else (state,))]

    t_axis, n_axis = (1, 0) if batch_first else (0, 1)
    dynamic = {"x": {t_axis: "T", n_axis: "N"}, "y": {t_axis: "T", n_axis: "N"},
               **{name: {1: "N"} for name in state_names + out_names[1:]}}
    args = inputs(T, N, seed=1)
    hx = None if not states else tuple(args[1:]) if cell.has_cell_state else args[1]
    model = export(ours, (args[0], hx) if states else (args[0],), ["x", *state_names],
                   out_names, dynamic, exporter)
    graph = assert_rnn_nodes(model, cell.onnx_op, num_layers, D)
    x_dims = dims(graph.input[0])
    assert isinstance(x_dims[t_axis], str) and isinstance(x_dims[n_axis], str), x_dims
    y_dims = dims(graph.output[0])
    assert isinstance(y_dims[t_axis], str) and isinstance(y_dims[n_axis], str), y_dims
    run = session(model)
    for seed, (t, n) in enumerate(OTHER_SIZES, start=2):
        args = inputs(t, n, seed)
        got = run.run(out_names, {name: a.numpy() for name, a in zip(["x", *state_names], args)})
        with torch.no_grad():
            assert_close(got, call(theirs, args))


# Each exporter sees every mode, 1 and 3 layers, both directions, batch_first both ways and
# states given and not; the exhaustive tier every combination of the values of any four of
# the six (COVERING).
QUICK = [
    # mode, num_layers, bidirectional, batch_first, states, exporter
    ("rnn_relu", 1, False, False, False, "dynamo"),
    ("rnn_tanh", 3, True, True, True, "dynamo"),
    ("lstm", 3, True, False, True, "dynamo"),
    ("gru", 1, False, True, False, "dynamo"),
    ("rnn_relu", 3, True, True, True, "torchscript"),
    ("rnn_tanh", 1, False, False, False, "torchscript"),
    ("lstm", 1, False, True, False, "torchscript"),
    ("gru", 3, True, False, True, "torchscript"),
]
FULL = list(itertools.product(CELLS, (1, 3), (False, True), (False, True), (False, True),
                              EXPORTERS))
STRENGTH = 4


def _combinations(case):
    return {(at, tuple(case[i] for i in at))
            for at in itertools.combinations(range(len(case)), STRENGTH)}


def _covering(first):
    """`first`, then cases of FULL (greedily, the most new combinations first) until every
    STRENGTH of the factors has met each combination of their values: a third of the
    product, where an export fault that needs fewer than five factors set shows."""
    chosen = list(first)
    left = set().union(*map(_combinations, FULL)) - set().union(*map(_combinations, chosen))
    while left:
        best = max(FULL, key=lambda case: len(_combinations(case) & left))
        chosen.append(best)
        left -= _combinations(best)
    return chosen


COVERING = _covering(QUICK)


def _id(case):
    mode, layers, bi, bf, states, exporter = case
    return (f"{mode}-L{layers}-{'bi' if bi else 'uni'}-{'bf' if bf else 'tf'}-"
            f"{'states' if states else 'nostates'}-{exporter}")


@pytest.mark.parametrize("case", QUICK, ids=_id)
def test_module_exports_to_onnx_native_operators(case):
    check_module(*case)


@pytest.mark.exhaustive
@pytest.mark.parametrize("case", COVERING[len(QUICK):], ids=_id)
def test_module_exports_to_onnx_native_operators_covering_matrix(case):
    check_module(*case)


def test_quick_and_exhaustive_cases_cover_every_four_factors():
    assert set(QUICK) <= set(FULL) and len(FULL) == 4 * 2 * 2 * 2 * 2 * 2
    assert len(set(COVERING)) == len(COVERING) < len(FULL) // 2
    for at in itertools.combinations(range(6), 4):
        assert {tuple(c[i] for i in at) for c in COVERING} == {
            tuple(c[i] for i in at) for c in FULL}, at
    for exporter in EXPORTERS:
        cases = [c for c in QUICK if c[-1] == exporter]
        for i, values in enumerate((set(CELLS), {1, 3}, {False, True}, {False, True},
                                    {False, True})):
            assert {c[i] for c in cases} == values, (exporter, i)


class Tagger(torch.nn.Module):
    """A model mixing torch layers with an LSTM: embedding, 2-layer bidirectional LSTM
    (batch_first, dropout, states given), linear head."""

    def __init__(self, lstm_class):
        super().__init__()
        self.embed = torch.nn.Embedding(20, I)
        self.lstm = lstm_class(I, H, num_layers=2, batch_first=True, bidirectional=True,
                               dropout=0.2)
        self.head = torch.nn.Linear(2 * H, 3)

    def forward(self, tokens, h0, c0):
        out, (h, c) = self.lstm(self.embed(tokens), (h0, c0))
        return self.head(out), h, c


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_model_mixing_torch_layers_and_an_lstm_exports(exporter):
    torch.manual_seed(0)
    theirs = Tagger(torch.nn.LSTM).eval()
    ours = Tagger(ft.LSTM).eval()
    ours.load_state_dict(theirs.state_dict())

    def inputs(t, n, seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, 20, (n, t), generator=g),
                torch.randn(4, n, H, generator=g), torch.randn(4, n, H, generator=g))

    names, outs = ["tokens", "h0", "c0"], ["logits", "hy", "cy"]
    dynamic = {"tokens": {0: "N", 1: "T"}, "logits": {0: "N", 1: "T"},
               **{k: {1: "N"} for k in ("h0", "c0", "hy", "cy")}}
    model = export(ours, inputs(T, N, 1), names, outs, dynamic, exporter)
    graph = assert_rnn_nodes(model, "LSTM", 2, 2)
    assert {"Gather", "LSTM"} <= {n.op_type for n in graph.node}   # the embedding's lookup
    run = session(model)
    for seed, (t, n) in enumerate(OTHER_SIZES, start=2):
        args = inputs(t, n, seed)
        got = run.run(outs, {k: a.numpy() for k, a in zip(names, args)})
        with torch.no_grad():
            assert_close(got, theirs(*args))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_unbatched_input_exports(exporter):
    """(T, I) input and (L*D, H) states, as torch.nn takes them."""
    theirs, ours = modules("gru", input_size=I, hidden_size=H, num_layers=2,
                           bidirectional=True)
    model = export(ours, (torch.randn(T, I), torch.randn(4, H)), ["x", "h0"], ["y", "hy"],
                   {"x": {0: "T"}, "y": {0: "T"}}, exporter)
    assert_rnn_nodes(model, "GRU", 2, 2)
    run = session(model)
    for t in (2, 11):
        x, h = torch.randn(t, I), torch.randn(4, H)
        with torch.no_grad():
            assert_close(run.run(["y", "hy"], {"x": x.numpy(), "h0": h.numpy()}), theirs(x, h))


class Packed(torch.nn.Module):
    """Variable lengths through a PackedSequence, packed and unpacked in the model."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, lengths):
        out, state = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return pad_packed_sequence(out)[0], state


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_packed_sequence_exports_under_torchscript_as_sequence_lens(mode):
    """Under dynamo=False the packing cancels out (as for torch.nn) and the lengths become
    the operators' sequence_lens: outputs past a sample's length are 0, its state is its
    own last step's, its reverse direction starts at its own end."""
    theirs, ours = (Packed(m) for m in modules(mode, input_size=I, hidden_size=H,
                                                num_layers=2, bidirectional=True))
    model = export(ours, (torch.randn(T, N, I), torch.tensor([6, 2, 4])), ["x", "lengths"],
                   None, {"x": {0: "T", 1: "N"}, "lengths": {0: "N"}}, "torchscript")
    graph = assert_rnn_nodes(model, CELLS[mode].onnx_op, 2, 2)
    assert all(n.input[4] for n in graph.node if n.op_type == CELLS[mode].onnx_op)
    run = session(model)
    for lengths in ([11, 3, 7, 1, 9], [2, 1]):   # (the longest sets the output's length)
        x, lengths = torch.randn(max(lengths), len(lengths), I), torch.tensor(lengths)
        got = run.run(None, {"x": x.numpy(), "lengths": lengths.numpy()})
        with torch.no_grad():
            out, state = theirs(x, lengths)
        assert_close(got, [out, *(state if isinstance(state, tuple) else (state,))])
        assert all(np.all(got[0][n:, i] == 0) for i, n in enumerate(lengths.tolist()))


# What a refused export raises: the module's NotImplementedError, which the default
# exporter wraps in its own error (the NotImplementedError its cause).
REFUSAL = (NotImplementedError, torch.onnx.OnnxExporterError)


def _root(error):
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def test_packed_sequence_under_the_default_exporter_is_refused():
    """torch.export cannot trace pack_padded_sequence at all (torch.nn's export fails
    there too); a PackedSequence built otherwise reaches the module, which says what to
    do instead."""
    _, ours = modules("gru", input_size=I, hidden_size=H)

    class Built(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = ours

        def forward(self, data, batch_sizes):
            return self.rnn(torch.nn.utils.rnn.PackedSequence(data, batch_sizes))[1]

    with pytest.raises(REFUSAL) as info:
        export(Built(), (torch.randn(5, I), torch.tensor([3, 2])), None, None, None, "dynamo")
    assert isinstance(_root(info.value), NotImplementedError)
    assert "PackedSequence input needs the TorchScript exporter" in str(info.value)


REFUSED = {
    "proj_size": (lambda: ft.LSTM(I, H, proj_size=2).eval(), {},
                  ("fusedrnn.torch.LSTM: ONNX export with proj_size=2 is not supported: "
                   "ONNX's LSTM operator has no projection")),
    "train_dropout": (lambda: ft.GRU(I, H, num_layers=2, dropout=0.3).train(),
                      {"training": torch.onnx.TrainingMode.PRESERVE},
                      ("fusedrnn.torch.GRU: ONNX export in training mode with dropout=0.3 "
                       "is not supported")),
}


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("what", REFUSED)
def test_what_onnx_cannot_express_is_refused_naming_it(what, exporter):
    """NotImplementedError naming the feature, from either exporter (the default one wraps
    it: the message is in its error too)."""
    make, kwargs, message = REFUSED[what]
    if exporter == "dynamo":
        kwargs = {}   # (it exports the module in the mode it is in)
    with pytest.raises(REFUSAL) as info:
        export(make(), (torch.randn(T, N, I),), None, None, None, exporter, **kwargs)
    assert isinstance(_root(info.value), NotImplementedError), repr(info.value)
    assert message in str(_root(info.value)) and message in str(info.value)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_the_functional_op_is_refused_clearly(exporter):
    """fusedrnn.torch.rnn in a model: no ONNX form; said so, not a shape error."""
    weight = torch.nn.Parameter(ft.LSTM(I, H).weight.detach())

    class Functional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = weight

        def forward(self, x):
            return ft.rnn(x, self.weight, mode="lstm", state_size=H, num_layers=1)

    with pytest.raises(REFUSAL) as info:
        export(Functional(), (torch.randn(T, N, I),), None, None, None, exporter)
    assert isinstance(_root(info.value), NotImplementedError), repr(info.value)
    assert "fusedrnn.torch.rnn (fusedrnn.RNN on tensors) has no ONNX export" in str(info.value)


def test_eager_calls_after_an_export_run_the_fused_operator():
    theirs, ours = modules("lstm", input_size=I, hidden_size=H)
    export(ours, (torch.randn(T, N, I),), None, None, None, "torchscript")
    assert not torch.onnx.is_in_onnx_export()
    x = torch.randn(T, N, I)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], theirs(x)[0], rtol=1e-5, atol=1e-6)


def test_importing_fusedrnn_torch_imports_no_onnx_package():
    """onnx, onnxscript and onnxruntime are the optional [onnx] extra."""
    code = ("import sys, fusedrnn.torch; "
            "print(sorted(m for m in ('onnx', 'onnxscript', 'onnxruntime', 'onnx_ir') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_the_docs_example_runs(tmp_path, monkeypatch):
    """docs/export.md's example: both exporters, ONNX Runtime at another batch and length."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    example = re.search(r"## Example\n\n```python\n(.*?)```", text, re.DOTALL).group(1)
    monkeypatch.chdir(tmp_path)   # (it writes its .onnx files)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(example, "docs/export.md example", "exec"), {})  # noqa: S102
    assert {p.name for p in tmp_path.glob("*.onnx")} == {"tagger.onnx", "tagger_ts.onnx"}
