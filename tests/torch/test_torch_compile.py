"""fusedrnn.torch under torch.compile and torch.export: the operators fusedrnn::rnn and
fusedrnn::rnn_backward (fusedrnn/torch/autograd.py) trace as single nodes with
fullgraph=True, a compiled model trains as the eager one, an exported one runs as it, the
operators pass torch.library.opcheck, and training handles are released with their graphs.
The CUDA twin of the training test is in test_cuda.py."""
import copy
import gc

import pytest
import torch

import fusedrnn.torch as ft
from fusedrnn.torch import autograd as fa


class Tagger(torch.nn.Module):
    """embedding -> 2-layer bidirectional LSTM -> linear (issue 26's model)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.rnn = ft.LSTM(8, 16, num_layers=2, bidirectional=True)
        self.out = torch.nn.Linear(32, 5)

    def forward(self, tokens):
        return self.out(self.rnn(self.emb(tokens))[0])


def train_three_steps(model, forward, tokens, targets):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(tokens).reshape(-1, 5),
                                                 targets.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def make(device="cpu"):
    torch.manual_seed(0)
    model = Tagger().to(device)
    tokens = torch.randint(0, 50, (7, 4), device=device)
    targets = torch.randint(0, 5, (7, 4), device=device)
    return model, tokens, targets


def test_fullgraph_compiled_model_trains_as_eager():
    torch._dynamo.reset()
    eager, tokens, targets = make()
    compiled = copy.deepcopy(eager)
    want = train_three_steps(eager, eager, tokens, targets)
    got = train_three_steps(compiled, torch.compile(compiled, fullgraph=True), tokens,
                            targets)
    assert got == pytest.approx(want, rel=1e-6)
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_the_graph_holds_the_operators():
    torch._dynamo.reset()
    model, tokens, _ = make()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward
    torch.compile(model, backend=backend, fullgraph=True)(tokens)
    assert any("fusedrnn.rnn" in target for target in seen), seen


def test_export_runs_and_matches():
    model, tokens, _ = make()
    model.eval()
    program = torch.export.export(model, (tokens,))
    assert any("fusedrnn.rnn" in str(n.target) for n in program.graph.nodes)
    torch.testing.assert_close(program.module()(tokens), model(tokens), rtol=0, atol=0)


def test_compiled_under_cpu_autocast_runs_in_bfloat16():
    torch._dynamo.reset()
    model, tokens, _ = make()
    with torch.autocast("cpu", torch.bfloat16):
        eager = model.rnn(model.emb(tokens))[0]
        compiled = torch.compile(lambda t: model.rnn(model.emb(t))[0], fullgraph=True)(tokens)
    assert compiled.dtype == eager.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_opcheck():
    """torch.library's own checks of the operators' schema, fake implementations and
    autograd registration, on a training call with states and on an inference one. Not
    its AOT-dispatch comparison: the `key` output numbers each training forward, so two
    runs differ by design (test_fullgraph_compiled_model_trains_as_eager covers AOT)."""
    torch.manual_seed(0)
    size = ft.GRU(3, 4).weight.numel()
    data = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    params = (0.3 * torch.randn(size, dtype=torch.float64)).requires_grad_(True)
    state = torch.randn(1, 2, 4, dtype=torch.float64, requires_grad=True)
    config = ("gru", 4, 1, False, 0.0, 0, None, None, False, False, True, -1, "")
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.fusedrnn.rnn.default,
                          (data, params, state, None, None, *config), test_utils=checks)
    torch.library.opcheck(torch.ops.fusedrnn.rnn.default,
                          (data.detach(), params.detach(), None, None, None,
                           *config[:-3], False, -1, ""), test_utils=checks)


def test_training_handles_are_released_with_their_graphs():
    gc.collect()
    before = len(fa._HANDLES)
    model, tokens, targets = make()
    loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 5), targets.reshape(-1))
    assert len(fa._HANDLES) == before + 1          # one forward in training mode
    loss.backward()
    gc.collect()
    assert len(fa._HANDLES) == before              # the backward frees it, graph or not
    del loss
    out = model(tokens)                              # a graph that never runs backward
    assert len(fa._HANDLES) == before + 1
    del out
    gc.collect()
    assert len(fa._HANDLES) == before
    with torch.no_grad():                            # inference keeps no handle
        model(tokens)
    assert len(fa._HANDLES) == before
    # torch.utils.checkpoint keeps no record from the forward; its recomputation's goes
    # with the backward
    out = torch.utils.checkpoint.checkpoint(model, tokens, use_reentrant=False)
    gc.collect()
    assert len(fa._HANDLES) == before
    torch.nn.functional.cross_entropy(out.reshape(-1, 5), targets.reshape(-1)).backward()
    gc.collect()
    assert len(fa._HANDLES) == before


def test_torchscript_says_it_is_not_supported():
    with pytest.raises(NotImplementedError, match="torch.compile"):
        torch.jit.script(ft.LSTM(3, 4))
