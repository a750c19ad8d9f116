"""fusedrnn.torch.RNN/LSTM/GRU as drop-in torch.nn modules: same outputs and gradients as
torch.nn (float64, <= 1e-10) for every mode, layers, directions, batch_first, packed
input and projection, torch state_dicts loaded as they are, and the same training curve."""
import pytest
import torch
import torch.nn.utils.prune
from torch.nn.utils.rnn import pack_padded_sequence

import fusedrnn.torch as ft
from fusedrnn.config import CELLS

# Every mode's torch.nn class and its fusedrnn.torch drop-in, as the table names them.
CLASSES = {mode: (cell.torch_class, cell.torch_kwargs) for mode, cell in CELLS.items()}


def pair(mode, **kw):
    """(torch.nn module, fusedrnn module with its weights), float64."""
    name, extra = CLASSES[mode]
    torch.manual_seed(0)
    theirs = getattr(torch.nn, name)(**kw, **extra).double()
    ours = getattr(ft, name)(**kw, **extra).double()
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def run_both(theirs, ours, make_input, hx_shape=None, cell=False):
    results = []
    for module in (theirs, ours):
        torch.manual_seed(1)
        x = make_input()
        hx = None
        if hx_shape:
            h = torch.randn(hx_shape[0], dtype=torch.float64, requires_grad=True)
            hx = (h, torch.randn(hx_shape[1], dtype=torch.float64, requires_grad=True)) if cell else h
        out, state = module(x, hx)
        out_t = out.data if hasattr(out, "batch_sizes") else out
        loss = (out_t ** 2).sum() + sum((s ** 3).sum() for s in (state if cell else (state,)))
        loss.backward()
        leaves = ([] if hasattr(x, "batch_sizes") else [x]) + (
            list(hx) if cell and hx else [hx] if hx is not None else [])
        results.append((out_t, state, [leaf.grad for leaf in leaves if leaf is not None]))
    return results


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def weight_grads(theirs, ours):
    return ours.layout.from_torch_state_dict({k: p.grad for k, p in theirs.named_parameters()})


def flat_grad(module):
    """A module's parameter gradients as one flat vector in fusedrnn's layout."""
    return torch.from_numpy(module.layout.from_torch_state_dict(
        {k: p.grad for k, p in module.named_parameters()}))


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_layers", [1, 2, 3])
@pytest.mark.parametrize("mode", list(CLASSES))
def test_module_matches_torch_nn(mode, num_layers, bidirectional, batch_first):
    theirs, ours = pair(mode, input_size=4, hidden_size=5, num_layers=num_layers,
                        bidirectional=bidirectional, batch_first=batch_first)
    D = 2 if bidirectional else 1
    shape = (3, 6, 4) if batch_first else (6, 3, 4)
    hx = ((num_layers * D, 3, 5), (num_layers * D, 3, 5))
    (o1, s1, g1), (o2, s2, g2) = run_both(
        theirs, ours, lambda: torch.randn(*shape, dtype=torch.float64, requires_grad=True),
        hx, cell=CELLS[mode].has_cell_state)
    close(o2, o1)
    for a, b in zip(*((s2, s1) if CELLS[mode].has_cell_state else ((s2,), (s1,)))):
        close(a, b)
    for a, b in zip(g2, g1):
        close(a, b)
    close(flat_grad(ours), torch.from_numpy(weight_grads(theirs, ours)))


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("mode", list(CLASSES))
def test_packed_sequence_input(mode, bidirectional):
    theirs, ours = pair(mode, input_size=3, hidden_size=4, num_layers=2, bidirectional=bidirectional)
    lengths = torch.tensor([5, 2, 4, 1])

    def packed():
        x = torch.randn(5, 4, 3, dtype=torch.float64, requires_grad=True)
        return pack_padded_sequence(x, lengths, enforce_sorted=False)
    (o1, s1, _), (o2, s2, _) = run_both(theirs, ours, packed, cell=CELLS[mode].has_cell_state)
    close(o2, o1)
    for a, b in zip(*((s2, s1) if CELLS[mode].has_cell_state else ((s2,), (s1,)))):
        close(a, b)
    close(flat_grad(ours), torch.from_numpy(weight_grads(theirs, ours)))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_lstm_projection(bidirectional):
    theirs, ours = pair("lstm", input_size=3, hidden_size=6, num_layers=2, proj_size=2,
                        bidirectional=bidirectional)
    D = 2 if bidirectional else 1
    (o1, s1, g1), (o2, s2, g2) = run_both(
        theirs, ours, lambda: torch.randn(4, 3, 3, dtype=torch.float64, requires_grad=True),
        ((2 * D, 3, 2), (2 * D, 3, 6)), cell=True)
    close(o2, o1)
    for a, b in zip(list(s2) + g2, list(s1) + g1):
        close(a, b)
    close(flat_grad(ours), torch.from_numpy(weight_grads(theirs, ours)))


def test_bias_false_keeps_biases_zero():
    theirs, ours = pair("gru", input_size=3, hidden_size=4, bias=False)
    (o1, _, g1), (o2, _, g2) = run_both(
        theirs, ours, lambda: torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True))
    close(o2, o1)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert [n for n, _ in ours.named_parameters()] == ["weight_ih_l0", "weight_hh_l0"]
    views = ours.layout.views(ours.weight.detach())
    assert all(torch.count_nonzero(views[k]) == 0 for k in views if k[2].startswith("b_"))
    close(flat_grad(ours), torch.from_numpy(weight_grads(theirs, ours)))


def test_eval_mode_ignores_dropout_and_train_mode_applies_it():
    _, ours = pair("lstm", input_size=3, hidden_size=4, num_layers=3, dropout=0.5)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    ours.eval()
    a, b = ours(x)[0], ours(x)[0]
    assert torch.equal(a, b)
    ours.train()
    assert not torch.equal(ours(x)[0], a)


def test_sequence_classifier_trains_like_torch_nn():
    """The same small model with torch.nn.LSTM and with fusedrnn.torch.LSTM: same loss curve."""
    def model(cls):
        torch.manual_seed(0)
        rnn = cls(input_size=3, hidden_size=8, num_layers=2, batch_first=True, bidirectional=True)
        head = torch.nn.Linear(16, 2)
        return torch.nn.ModuleDict(dict(rnn=rnn, head=head)).double()

    torch.manual_seed(42)
    x = torch.randn(32, 7, 3, dtype=torch.float64)
    y = (x.sum(dim=(1, 2)) > 0).long()
    theirs = model(torch.nn.LSTM)
    ours = model(ft.LSTM)
    ours["rnn"].load_state_dict(theirs["rnn"].state_dict())
    curves = []
    for m in (theirs, ours):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        losses = []
        for _ in range(25):
            opt.zero_grad()
            out, _ = m["rnn"](x)
            loss = torch.nn.functional.cross_entropy(m["head"](out[:, -1]), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    assert curves[0][-1] < 0.95 * curves[0][0]  # it learns
    for a, b in zip(*curves):
        assert abs(a - b) <= 1e-9 * max(1.0, abs(a))


def test_own_state_dict_round_trip():
    _, ours = pair("gru", input_size=3, hidden_size=4, num_layers=2)
    fresh = ft.GRU(3, 4, num_layers=2).double()
    fresh.load_state_dict(ours.state_dict())
    assert torch.equal(fresh.weight, ours.weight)


@pytest.mark.parametrize("mode", list(CLASSES))
def test_checkpoints_load_both_ways_with_torch_nn(mode):
    """torch.nn's names and shapes: a fusedrnn checkpoint loads into torch.nn and back,
    strictly (no missing or unexpected keys), and both run alike afterwards."""
    kw = dict(input_size=3, hidden_size=4, num_layers=2, bidirectional=True)
    if CELLS[mode].projection:
        kw["proj_size"] = 2
    theirs, ours = pair(mode, **kw)
    torch.manual_seed(7)
    fresh_ours = getattr(ft, CLASSES[mode][0])(**kw, **CLASSES[mode][1]).double()
    theirs.load_state_dict(fresh_ours.state_dict())        # fusedrnn -> torch.nn
    ours.load_state_dict(theirs.state_dict())              # torch.nn -> fusedrnn
    assert list(ours.state_dict()) == list(theirs.state_dict())
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    close(ours(x)[0], theirs(x)[0])
    close(fresh_ours(x)[0], theirs(x)[0])


def test_flat_weight_checkpoints_of_earlier_versions_still_load():
    """fusedrnn.torch modules used to keep one flat `weight` parameter: such a checkpoint
    loads into the named parameters."""
    _, ours = pair("lstm", input_size=3, hidden_size=4, num_layers=2)
    fresh = ft.LSTM(3, 4, num_layers=2).double()
    fresh.load_state_dict({"weight": ours.weight.detach().clone()})
    for (name, a), (_, b) in zip(fresh.named_parameters(), ours.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(RuntimeError, match="expected shape"):
        fresh.load_state_dict({"weight": torch.zeros(5, dtype=torch.float64)})


@pytest.mark.parametrize("mode", list(CLASSES))
def test_parameter_groups_and_clipping_train_as_torch_nn(mode):
    """The same script on both classes: weight decay on weights only (a parameter group per
    kind, chosen by name), gradient clipping by norm, three Adam steps: the same
    parameters after each step."""
    results = {}
    for name, cls in (("torch.nn", getattr(torch.nn, CLASSES[mode][0])),
                      ("fusedrnn", getattr(ft, CLASSES[mode][0]))):
        torch.manual_seed(0)
        m = cls(3, 4, num_layers=2, bidirectional=True, **CLASSES[mode][1]).double()
        decay = [p for n, p in m.named_parameters() if n.startswith("weight")]
        no_decay = [p for n, p in m.named_parameters() if n.startswith("bias")]
        assert len(decay) == 8 and len(no_decay) == 8
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=0.05)
        torch.manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(5, 2, 3, dtype=torch.float64))[0].square().sum().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
        results[name] = dict(m.named_parameters())
    for key, p in results["torch.nn"].items():
        torch.testing.assert_close(results["fusedrnn"][key], p, rtol=1e-9, atol=1e-11)


def test_wrong_state_dict_is_refused():
    ours = ft.LSTM(3, 4)
    with pytest.raises(RuntimeError, match="weight_ih_l0"):
        ours.load_state_dict(torch.nn.LSTM(5, 4).state_dict())


# ---- torch.nn behaviours user code relies on, the same script on both classes ----------

def _both(mode, **kw):
    """{"torch.nn": module, "fusedrnn": module}, float64, the same weights."""
    theirs, ours = pair(mode, **kw)
    return {"torch.nn": theirs, "fusedrnn": ours}


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mode", list(CLASSES))
def test_unbatched_input_as_torch_nn(mode, batch_first):
    """(T, I) input and (L*D, H) states: outputs without a batch dimension; batch_first
    does not apply to them."""
    mods = _both(mode, input_size=3, hidden_size=4, num_layers=2, bidirectional=True,
                 batch_first=batch_first)
    torch.manual_seed(2)
    x = torch.randn(5, 3, dtype=torch.float64)
    h = torch.randn(4, 4, dtype=torch.float64)
    hx = (h, torch.randn(4, 4, dtype=torch.float64)) if CELLS[mode].has_cell_state else h
    results = {name: m(x, hx) for name, m in mods.items()}
    (o1, s1), (o2, s2) = results["torch.nn"], results["fusedrnn"]
    assert o2.shape == o1.shape == (5, 8)
    close(o2, o1)
    for a, b in zip(*((s2, s1) if CELLS[mode].has_cell_state else ((s2,), (s1,)))):
        assert a.shape == b.shape == (4, 4)
        close(a, b)
    close(mods["fusedrnn"](x)[0], mods["torch.nn"](x)[0])   # no hx


@pytest.mark.parametrize("name", ["torch.nn", "fusedrnn"])
def test_state_dimensions_must_match_the_input(name):
    m = _both("gru", input_size=3, hidden_size=4)[name]
    with pytest.raises((ValueError, RuntimeError), match="(2-D|3-D)"):
        m(torch.randn(5, 3, dtype=torch.float64), torch.zeros(1, 1, 4, dtype=torch.float64))
    with pytest.raises((ValueError, RuntimeError), match="(2-D|3-D)"):
        m(torch.randn(5, 2, 3, dtype=torch.float64), torch.zeros(1, 4, dtype=torch.float64))


@pytest.mark.parametrize("mode", list(CLASSES))
def test_hx_of_the_wrong_kind_is_refused_naming_it(mode):
    """An LSTM's (h_0, c_0) given to a GRU or RNN, or a bare h_0 to an LSTM, is a TypeError
    naming hx and what the module takes (it used to run a GRU on h_0 alone); torch.nn
    refuses both too, less clearly. The right kind still runs."""
    mods = _both(mode, input_size=3, hidden_size=4, num_layers=2)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    h, c = torch.zeros(2, 2, 4, dtype=torch.float64), torch.zeros(2, 2, 4, dtype=torch.float64)
    name = CELLS[mode].torch_class
    if CELLS[mode].has_cell_state:
        wrong, expected = [h, (h,), (h, c, c), (h, "c")], r"expected a tuple \(h_0, c_0\) of two tensors"
    else:
        wrong, expected = [(h, c), [h], "h"], "expected a tensor h_0"
    for hx in wrong:
        with pytest.raises(TypeError, match=rf"^hx: {name} {expected}, got a "):
            mods["fusedrnn"](x, hx)
        with pytest.raises((AttributeError, IndexError, RuntimeError)):   # torch.nn's
            mods["torch.nn"](x, hx)
    if not CELLS[mode].has_cell_state:
        with pytest.raises(TypeError, match=r"got a tuple of 2 tensors \(.* no cell state"):
            mods["fusedrnn"](x, (h, c))
    right = (h, c) if CELLS[mode].has_cell_state else h
    close(mods["fusedrnn"](x, right)[0], mods["torch.nn"](x, right)[0])


@pytest.mark.parametrize("mode", list(CLASSES))
def test_flatten_parameters_and_all_weights_as_torch_nn(mode):
    kw = dict(input_size=3, hidden_size=4, num_layers=2, bidirectional=True)
    if CELLS[mode].projection:
        kw["proj_size"] = 2
    mods = _both(mode, **kw)
    for m in mods.values():
        m.flatten_parameters()
    theirs, ours = (mods[k].all_weights for k in ("torch.nn", "fusedrnn"))
    assert len(ours) == len(theirs) == 4
    for a_layer, b_layer in zip(ours, theirs):
        assert len(a_layer) == len(b_layer)
        for a, b in zip(a_layer, b_layer):
            close(a, b)
    # the module's own parameters: a change through one is seen by the module
    with torch.no_grad():
        ours[0][2].add_(1.0)
    assert mods["fusedrnn"].bias_ih_l0 is ours[0][2]


@pytest.mark.parametrize("name", ["fusedrnn"])   # torch.nn differentiates twice
def test_double_backward_raises_instead_of_detaching(name):
    """torch.nn's CPU LSTM differentiates twice; fusedrnn's does not, and says so when a
    second backward reaches its gradient (a named difference), rather than treating the
    gradient as a constant."""
    m = _both("lstm", input_size=3, hidden_size=4)[name]
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(m(x)[0].square().sum(), x, create_graph=True)
    plain = torch.autograd.grad(m(x)[0].square().sum(), x)[0]
    torch.testing.assert_close(g, plain, rtol=0, atol=0)   # the values themselves are right
    with pytest.raises(RuntimeError, match="not differentiable .no double backward"):
        torch.autograd.grad(g.sum(), x)


@pytest.mark.parametrize("mode", list(CLASSES))
def test_a_call_without_gradients_reads_the_parameters_in_place_and_follows_each_change(mode):
    """The parameters are views of one flat tensor, which a call that records nothing for
    a backward passes as it is (no joining copy). Every way of changing them shows in the next
    such call, as torch.nn, given the same weights, computes it: in place (an optimizer's
    step), replaced (.data, a new Parameter: the joined copy, until flatten_parameters),
    converted, deep-copied and pickled (laid out again, each copy its own memory)."""
    import copy
    import io
    kw = dict(input_size=3, hidden_size=4, num_layers=2, bidirectional=True)
    if CELLS[mode].projection:
        kw["proj_size"] = 2
    theirs, ours = pair(mode, **kw)
    x = torch.randn(5, 2, 3, dtype=torch.float64)

    def check(module, flat):
        theirs.load_state_dict(module.state_dict())
        with torch.no_grad():
            assert (module._call_weight(x)[0] is module._flat) == flat
            close(module(x)[0], theirs(x)[0])

    check(ours, True)
    # with gradients: the flat tensor too, the parameters beside it (their gradients' way)
    weight, views = ours._call_weight(x)
    assert weight is ours._flat and all(a is b for a, b in zip(views[1], ours.parameters()))
    torch.optim.SGD(ours.parameters(), lr=0.5).zero_grad()
    (ours(x)[0] ** 2).sum().backward()
    torch.optim.SGD(ours.parameters(), lr=0.5).step()
    check(ours, True)
    ours.weight_hh_l0.data = ours.weight_hh_l0.data + 1.0
    check(ours, False)
    ours.flatten_parameters()
    check(ours, True)
    ours.bias_ih_l1_reverse = torch.nn.Parameter(torch.randn_like(ours.bias_ih_l1_reverse))
    check(ours, False)
    ours.float().double()
    check(ours, True)
    twin = copy.deepcopy(ours)
    check(twin, True)
    with torch.no_grad():
        twin.weight_ih_l0.add_(1.0)
    check(twin, True)
    check(ours, True)   # the copy's change is its own
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    check(torch.load(buffer, weights_only=False), True)


@pytest.mark.parametrize("mode", list(CLASSES))
def test_frozen_parameters_changed_before_the_backward_leave_the_gradient_as_computed(mode):
    """A frozen module (no parameter requires grad) under an input that does: the call
    records a backward, so it passes the joined copy, not the flat tensor the parameters
    are views of. An in-place change of the parameters between forward and backward (an
    EMA update, a load_state_dict) then leaves the input's gradient that of the weights
    the forward ran with, as computed afresh."""
    theirs, ours = pair(mode, input_size=3, hidden_size=4, num_layers=2)
    ours.requires_grad_(False)
    torch.manual_seed(2)
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    assert ours._call_weight(x)[0] is not ours._flat
    (ours(x)[0] ** 2).sum().backward()
    want = x.grad.clone()
    x.grad = None
    out = ours(x)[0]
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(0.5)
    (out ** 2).sum().backward()
    close(x.grad, want)


@pytest.mark.parametrize("mode", list(CLASSES))
def test_a_trained_modules_gradients_reach_its_parameters_without_the_joined_copy(mode):
    """A call whose gradient reaches every parameter passes the flat tensor the
    parameters are views of, with them (no joined copy): their gradients are those of the
    joined copy's path (a frozen layer's, here), bit for bit, and torch.nn's. An in-place
    change of a parameter before backward then raises, as torch.nn's does."""
    kw = dict(input_size=3, hidden_size=4, num_layers=2, bidirectional=True)
    if CELLS[mode].projection:
        kw["proj_size"] = 2
    theirs, ours = pair(mode, **kw)
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    grads = []
    for frozen in (False, True):
        ours.zero_grad(set_to_none=True)
        next(iter(ours.parameters())).requires_grad_(not frozen)
        weight, views = ours._call_weight(x)
        assert (weight is ours._flat and views is not None) != frozen
        (ours(x)[0] ** 2).sum().backward()
        grads.append({k: p.grad for k, p in ours.named_parameters() if p.grad is not None})
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, rtol=0, atol=0)
    (theirs(x)[0] ** 2).sum().backward()
    for name, p in theirs.named_parameters():
        close(grads[0][name], p.grad)
    ours.requires_grad_(True)
    for module in (theirs, ours):
        out = module(x)[0]
        with torch.no_grad():
            module.weight_hh_l0.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@pytest.mark.parametrize("tool", ["prune", "weight_norm"])
def test_pruned_and_parametrized_weights_as_torch_nn(tool):
    """torch.nn.utils.prune and parametrize serve a parameter as an attribute computed from
    others (it leaves the module's parameters): the module joins its weights from the
    attributes, and gives torch.nn's outputs and gradients under the same tool, with
    gradients and without."""
    theirs, ours = pair("lstm", input_size=3, hidden_size=4, num_layers=2)
    for module in (theirs, ours):
        if tool == "prune":
            torch.nn.utils.prune.l1_unstructured(module, "weight_hh_l0", amount=0.4)
        else:
            torch.nn.utils.parametrizations.weight_norm(module, "weight_ih_l1")
    results = run_both(theirs, ours,
                       lambda: torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True),
                       cell=True)
    for a, b in zip(*results):
        for x, y in zip(a if isinstance(a, (tuple, list)) else [a],
                        b if isinstance(b, (tuple, list)) else [b]):
            close(x, y)
    named = dict(ours.named_parameters())
    assert named.keys() == dict(theirs.named_parameters()).keys()
    for name, p in theirs.named_parameters():
        close(named[name].grad, p.grad)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        close(ours(x)[0], theirs(x)[0])
