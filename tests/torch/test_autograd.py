"""fusedrnn.RNN against torch.nn with the same weights (state_dict mapped): on numpy arrays
(float64 and float32, up to 3 layers) and on torch tensors, where DLPack passes them
without copies and torch.autograd's gradients equal torch.nn's; gradcheck, and backward
after an inference-mode forward (which cuDNN refuses)."""
import contextlib

import numpy as np
import pytest
import torch

import fusedrnn
import fusedrnn.torch as ft

from conftest import CELLS, MODES, make_case, rel_err, tolerance
from torch_ref import torch_module


def _tensors(case, requires_grad=True):
    return {k: None if v is None else torch.from_numpy(v).requires_grad_(requires_grad)
            for k, v in case.items()}


def _torch_module(mode, kw, I, params):
    """torch.nn's module of `params`' dtype, loaded with the flat vector `params`."""
    H, L, bidirectional = kw["state_size"], kw["num_layers"], kw["bidirectional"]
    module = torch_module(mode, I, H, L, 2 if bidirectional else 1, dtype=params.dtype)
    layout = fusedrnn.param_layout(mode=mode, input_size=I, state_size=H, num_layers=L,
                                   bidirectional=bidirectional)
    module.load_state_dict({k: torch.from_numpy(v)
                            for k, v in layout.to_torch_state_dict(params).items()})
    return module, layout


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_numpy_call_matches_torch_nn(mode, L, D, dtype):
    T, N, I, H = 6, 4, 5, 7
    case, kw, heads = make_case(mode, T=T, N=N, I=I, H=H, L=L, D=D, dtype=dtype, seed=L + 3 * D)
    module, layout = _torch_module(mode, kw, I, case["parameters"])

    *outs, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    grads = fusedrnn.rnn_backward(handle, **heads)

    x = torch.from_numpy(case["data"]).requires_grad_()
    h0 = torch.from_numpy(case["state"]).requires_grad_()
    if CELLS[mode].has_cell_state:
        c0 = torch.from_numpy(case["state_cell"]).requires_grad_()
        t_out, (t_hy, t_cy) = module(x, (h0, c0))
        t_outs = (t_out, t_hy, t_cy)
    else:
        t_out, t_hy = module(x, h0)
        t_outs = (t_out, t_hy)
    loss = sum((o * torch.from_numpy(heads[k])).sum() for o, k in zip(t_outs, ("dout", "dhy", "dcy")))
    loss.backward()

    tol = tolerance(dtype)
    for ours, theirs in zip(outs, t_outs):
        assert rel_err(ours, theirs.detach().numpy()) <= tol
    assert rel_err(grads.data, x.grad.numpy()) <= tol
    assert rel_err(grads.state, h0.grad.numpy()) <= tol
    if CELLS[mode].has_cell_state:
        assert rel_err(grads.state_cell, c0.grad.numpy()) <= tol
    torch_grads = {k: p.grad.numpy() for k, p in module.named_parameters()}
    assert rel_err(grads.parameters, layout.from_torch_state_dict(torch_grads)) <= tol


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_autograd_matches_torch_nn(mode, L, D):
    case, kw, heads = make_case(mode, L=L, D=D, seed=L * D)
    t = _tensors(case)
    outs = fusedrnn.RNN(**t, **kw, state_outputs=True)
    assert all(isinstance(o, torch.Tensor) for o in outs)
    loss = sum((o * torch.from_numpy(heads[k])).sum() for o, k in zip(outs, ("dout", "dhy", "dcy")))
    loss.backward()
    module, layout = _torch_module(mode, kw, case["data"].shape[2], case["parameters"])
    x = torch.from_numpy(case["data"]).requires_grad_()
    h0 = torch.from_numpy(case["state"]).requires_grad_()
    has_cell = CELLS[mode].has_cell_state
    c0 = torch.from_numpy(case["state_cell"]).requires_grad_() if has_cell else None
    ref = module(x, (h0, c0) if has_cell else h0)
    ref_outs = (ref[0], *ref[1]) if has_cell else ref
    sum((o * torch.from_numpy(heads[k])).sum()
        for o, k in zip(ref_outs, ("dout", "dhy", "dcy"))).backward()
    for ours, theirs in zip(outs, ref_outs):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t["data"].grad, x.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t["state"].grad, h0.grad, rtol=1e-10, atol=1e-12)
    if has_cell:
        torch.testing.assert_close(t["state_cell"].grad, c0.grad, rtol=1e-10, atol=1e-12)
    ref_grad = layout.from_torch_state_dict({k: p.grad for k, p in module.named_parameters()})
    np.testing.assert_allclose(t["parameters"].grad.numpy(), ref_grad, rtol=1e-10, atol=1e-12)


def test_dlpack_shares_memory_both_ways():
    x = torch.randn(3, 4, dtype=torch.float64)
    a = ft.to_array(x)
    assert a.ctypes.data == x.data_ptr()
    back = ft.to_tensor(a)
    assert back.data_ptr() == x.data_ptr()


def test_to_array_views_a_strided_cpu_tensor_and_the_op_reads_it():
    """to_array of a non-contiguous CPU tensor (a transpose, an expanded tensor) is numpy's
    view of its memory with its strides, no copy; a backward from an expanded head gradient
    (`out.sum()`'s) gives the gradients of the same gradient made contiguous."""
    x = torch.randn(4, 3)
    for t in (x.T, x[:1].expand(5, 3)):
        a = ft.to_array(t)
        assert a.ctypes.data == t.data_ptr()
        assert a.strides == tuple(s * t.element_size() for s in t.stride())
        np.testing.assert_array_equal(a, t.numpy())
    rnn = ft.GRU(3, 4)
    data = torch.randn(2, 5, 3, requires_grad=True)
    grads = []
    for head in (lambda out: out.sum(), lambda out: (out * torch.ones(out.shape)).sum()):
        data.grad = None
        rnn.zero_grad()
        head(rnn(data)[0]).backward()
        grads.append([data.grad] + [p.grad for p in rnn.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck(mode):
    case, kw, _ = make_case(mode, T=3, N=2, I=2, H=2, L=2, D=2, seed=9)
    t = _tensors(case)
    names = [k for k in ("data", "parameters", "state", "state_cell") if t[k] is not None]

    def f(*args):
        return fusedrnn.RNN(**dict(t, **dict(zip(names, args))), **kw, state_outputs=True)
    assert torch.autograd.gradcheck(f, tuple(t[k] for k in names), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("mode", MODES)
def test_backward_after_inference_mode_forward(mode):
    """train=False keeps no reserve; backward recomputes it and gets the same gradients."""
    case, kw, heads = make_case(mode, L=2, D=2)
    grads = []
    for train in (False, True):
        t = _tensors(case)
        out = ft.rnn(**t, **kw, train=train)
        (out * torch.from_numpy(heads["dout"])).sum().backward()
        grads.append([t[k].grad for k in ("data", "parameters", "state")])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_dropout_follows_torch_manual_seed():
    case, kw, _ = make_case("gru", L=3, D=2)
    t = _tensors(case)
    torch.manual_seed(3)
    a = ft.rnn(**t, **kw, p=0.5, train=True)
    torch.manual_seed(3)
    b = ft.rnn(**t, **kw, p=0.5, train=True)
    c = ft.rnn(**t, **kw, p=0.5, train=True)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(ft.rnn(**t, **kw, p=0.5, train=False),
                       ft.rnn(**t, **kw, p=0.0, train=False))


def test_no_grad_inference_keeps_no_graph():
    case, kw, _ = make_case("lstm")
    with torch.no_grad():
        out = fusedrnn.RNN(**_tensors(case), **kw)
    assert out.grad_fn is None and not out.requires_grad


def test_training_mode_without_a_backward_keeps_no_record(monkeypatch):
    """train=True that autograd will not differentiate (a module left in train() under
    torch.no_grad) reaches the op as inference when there is no dropout to draw, with the
    same result; with dropout between layers it stays a training forward (the masks)."""
    from fusedrnn import op
    seen = []
    real = op.RNN
    monkeypatch.setattr(op, "RNN", lambda *a, **k: seen.append(k["train"]) or real(*a, **k))
    for L, p, expected in ((1, 0.5, False), (2, 0.0, False), (2, 0.5, True)):
        case, kw, _ = make_case("lstm", L=L)
        t = _tensors(case)
        with torch.no_grad():
            out = ft.rnn(**t, **kw, p=p, train=True, seed=2)
        assert seen.pop() is expected, (L, p)
        reference = ft.rnn(**t, **kw, p=p, train=True, seed=2)   # autograd needs it
        assert seen.pop() is True
        torch.testing.assert_close(out, reference.detach(), rtol=0, atol=0)


def test_second_backward_with_retain_graph_reuses_the_dropout_masks():
    case, kw, heads = make_case("gru", L=2, D=2)
    t = _tensors(case)
    out = ft.rnn(**t, **kw, p=0.5, train=True, seed=5)
    loss = (out * torch.from_numpy(heads["dout"])).sum()
    loss.backward(retain_graph=True)
    first = t["parameters"].grad.clone()
    t["parameters"].grad = None
    loss.backward()
    torch.testing.assert_close(t["parameters"].grad, first, rtol=0, atol=0)


def test_in_place_change_before_backward_raises_like_torch_nn():
    case, kw, _ = make_case("lstm")
    t = _tensors(case)
    w = t["parameters"].detach().clone().requires_grad_()
    scaled = w * 1.0                      # a non-leaf that can be changed in place
    out = fusedrnn.RNN(**dict(t, parameters=scaled), **kw)
    scaled.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_rnn_on_tensors_trains_when_autograd_needs_it():
    """fusedrnn.RNN's train defaults, for tensors, to whether a backward will come: dropout
    applies (and one forward serves the backward) without passing train=True."""
    case, kw, _ = make_case("gru", L=2)
    t = _tensors(case)
    dropped = fusedrnn.RNN(**t, **kw, p=0.5, seed=1)
    plain = fusedrnn.RNN(**t, **kw, p=0.0)
    assert not torch.equal(dropped, plain)
    with torch.no_grad():
        assert torch.equal(fusedrnn.RNN(**t, **kw, p=0.5), plain)


def test_torch_path_checks_its_arguments():
    case, kw, _ = make_case("gru", L=2)
    t = _tensors(case)
    with pytest.raises(TypeError, match="train: expected a bool"):
        ft.rnn(**t, **kw, train="no")
    with pytest.raises(TypeError, match="p: expected a float"):
        ft.rnn(**t, **kw, p="0.5", train=True)


def test_calls_through_torch_are_marked_as_a_torch_programs(monkeypatch):
    """The forward and the backward reach the op with config.TORCH_CALLER holding torch's
    operations (the CPU backend runs its GEMMs there and keeps numpy's BLAS off torch's
    cores), and it is unset afterwards."""
    from fusedrnn import op
    from fusedrnn.config import TORCH_CALLER
    from fusedrnn.torch import autograd
    seen = []
    for name in ("RNN", "rnn_backward"):
        real = getattr(op, name)
        monkeypatch.setattr(op, name, lambda *a, _r=real, _n=name, **k:
                            seen.append((_n, TORCH_CALLER.get())) or _r(*a, **k))
    rnn = ft.GRU(4, 5)
    out, _ = rnn(torch.randn(3, 2, 4))
    out.sum().backward()
    assert seen == [("RNN", autograd.TORCH_HOST), ("rnn_backward", autograd.TORCH_HOST)]
    assert TORCH_CALLER.get() is None


def test_a_torch_programs_cpu_call_raises_glibcs_mmap_threshold_once():
    """fusedrnn/cpu/heap.py: the first CPU call from torch raises it, later ones find it
    done or, repeating that call (op.py), do not ask (tests/cpu/test_heap.py checks what
    it does to glibc)."""
    from fusedrnn.cpu import heap
    rnn, x = ft.LSTM(3, 4), torch.randn(2, 1, 3)
    heap.raise_mmap_threshold.cache_clear()
    rnn(x)
    rnn(x)[0].sum().backward()
    assert heap.raise_mmap_threshold.cache_info().misses == 1
    assert heap.raise_mmap_threshold() is (heap.glibc() is not None)


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_torch_gemm_computes_into_numpy_views(dtype, transpose_a):
    """The GEMM a torch program's call hands the CPU backend (autograd.TorchHost.matmul):
    a column slice of a wider matrix as a (the op's dG of one direction), into a
    NaN-poisoned row slice of a bigger output, against float64."""
    from fusedrnn.torch import autograd
    rng = np.random.default_rng(5)
    M, K, C = 19, 33, 21
    wide = rng.standard_normal((K, 2 * M) if transpose_a else (M, 2 * K)).astype(dtype)
    a = wide[:, M:] if transpose_a else wide[:, K:]
    b = rng.standard_normal((K, C)).astype(dtype)
    big = np.full((M + 3, C), np.nan, dtype)
    out = big[1:M + 1]
    assert autograd.TORCH_HOST.matmul(a, b, out, transpose_a) is out
    want = (a.T if transpose_a else a).astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(out - want)) <= (2e-6 if dtype == np.float32 else 1e-13) * \
        np.max(np.abs(want))
    assert np.isnan(big[0]).all() and np.isnan(big[M + 1:]).all()


def test_torch_transpose_copies_a_strided_view():
    """TorchHost.transpose: a column slice of a wider matrix into a contiguous a^T."""
    from fusedrnn.torch import autograd
    wide = np.random.default_rng(6).standard_normal((33, 40)).astype(np.float32)
    a = wide[:, 7:]
    out = np.full((33, 33), np.nan, np.float32)
    assert autograd.TORCH_HOST.transpose(a, out) is out
    assert np.array_equal(out, a.T)


@pytest.mark.parametrize("size", ["past HOST_GEMM_WORK", "small"])
def test_a_torch_programs_training_gemms_run_on_torch(monkeypatch, size):
    """In a fusedrnn.torch training step the CPU backend's GEMMs past HOST_GEMM_WORK and
    below the micro-kernel's threshold reach torch's GEMM (CpuBackend.matmul's rule; its
    products apart), a small step's stay on numpy's, and the gradients equal torch.nn's."""
    from fusedrnn.cpu import HOST_GEMM_WORK, CpuBackend
    from fusedrnn.torch import autograd
    monkeypatch.setattr(CpuBackend, "sequence_products", staticmethod(lambda *a: False))
    T, N, I, H = (5, 3, 6, 7) if size == "small" else (8, 32, 64, 64)
    assert (T * N * 4 * H * I > HOST_GEMM_WORK) == (size != "small")
    calls = []
    real = autograd.TorchHost.matmul
    monkeypatch.setattr(autograd.TorchHost, "matmul",
                        staticmethod(lambda *a: calls.append(a[3]) or real(*a)))
    torch.manual_seed(0)
    ref = torch.nn.LSTM(I, H, num_layers=2, bidirectional=True).double()
    mine = ft.LSTM(I, H, num_layers=2, bidirectional=True).double()
    mine.load_state_dict(ref.state_dict())
    grads = []
    for m in (ref, mine):
        x = torch.randn(T, N, I, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(1), requires_grad=True)
        m(x)[0].square().sum().backward()
        grads.append(x.grad)
    if size == "small":
        assert calls == []
    else:
        assert True in calls and False in calls, calls   # weight and input gradients
    assert torch.allclose(grads[0], grads[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("mode", MODES)
def test_a_torch_programs_backward_runs_its_products_together(monkeypatch, mode, T):
    """A training step through fusedrnn.torch (float32, two bidirectional layers, small)
    hands each layer's backward products to the CPU backend's `products` at once
    (CpuBackend.step_products at T=1: in a torch program from any size; sequence_products
    past it, within Zen 5's bounds on any kind), calls neither torch's GEMM
    nor the backend's one-by-one matmul, enters no BLAS scope (no numpy GEMM is left to
    scope; the op is built with one, BLAS_SERIAL_WORK lowered), and its gradients (input,
    states, parameters) equal torch.nn's in float64 within float32's rounding."""
    from fusedrnn import cpu
    from fusedrnn.cpu import threads
    from fusedrnn.torch import autograd
    monkeypatch.setattr(cpu, "BLAS_SERIAL_WORK", 0)   # (else this size's op has no scope)
    monkeypatch.setattr(cpu, "SEQUENCE_PRODUCTS", cpu.sequence_products_bounds("znver5"))
    fusedrnn.clear_cache()
    calls = []
    for owner, name in ((cpu.CpuBackend, "products"), (cpu.CpuBackend, "matmul"),
                        (autograd.TorchHost, "matmul")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, staticmethod(
            lambda *a, _r=real, _n=f"{owner.__name__}.{name}", **k: calls.append(_n) or
            _r(*a, **k)))
    real_enter = threads.BlasOneThread.__enter__
    monkeypatch.setattr(threads.BlasOneThread, "__enter__",
                        lambda self: calls.append("blas scope") or real_enter(self))
    name, extra = CELLS[mode].torch_class, CELLS[mode].torch_kwargs
    torch.manual_seed(0)
    ref = getattr(torch.nn, name)(6, 7, num_layers=2, bidirectional=True, **extra).double()
    mine = getattr(ft, name)(6, 7, num_layers=2, bidirectional=True, **extra)
    mine.load_state_dict(ref.state_dict())
    grads = []
    for module, dtype in ((ref, torch.float64), (mine, torch.float32)):
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(T, 3, 6, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        h0 = torch.randn(4, 3, 7, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        hx = (h0, torch.zeros_like(h0)) if CELLS[mode].has_cell_state else h0
        calls.clear()
        out, _ = module(x, hx)
        if T > 1:   # (the loop's input projection: the forward's, not the products')
            calls.clear()
        out.square().sum().backward()
        grads.append([x.grad, h0.grad] + [p.grad for p in module.parameters()])
    fusedrnn.clear_cache()   # (its op holds the lowered bound's scope)
    assert calls == ["CpuBackend.products"] * 2, calls
    for want, got in zip(*grads, strict=True):
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_one_op_answers_a_numpy_and_a_torch_programs_single_step_apart(monkeypatch):
    """RecurrentOp remembers whether a single step's products go together per program kind:
    the same op (one cache entry), called in turn from a numpy program (a small step: the
    products one by one) and from a torch program (together), answers each as it is."""
    from fusedrnn import cpu
    calls = []
    real = cpu.CpuBackend.products
    monkeypatch.setattr(cpu.CpuBackend, "products",
                        staticmethod(lambda *a: calls.append("together") or real(*a)))
    fusedrnn.clear_cache()
    kw = dict(mode="gru", state_size=8, num_layers=1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 3, 5)).astype(np.float32)
    w = rng.uniform(-0.3, 0.3, fusedrnn.param_size(input_size=5, **kw)).astype(np.float32)
    dout = np.ones((1, 3, 8), np.float32)
    seen, grads = [], []
    for program in ("numpy", "torch", "numpy", "torch"):
        calls.clear()
        if program == "numpy":
            out, handle = fusedrnn.RNN(x, w, **kw, train=True)
            grads.append(fusedrnn.rnn_backward(handle, dout).parameters)
        else:
            params = torch.from_numpy(w.copy()).requires_grad_()
            ft.rnn(torch.from_numpy(x), params, **kw).sum().backward()
            grads.append(params.grad.numpy())
        seen.append((program, calls == ["together"]))
    assert fusedrnn.cache_info().entries == 1
    assert seen == [("numpy", False), ("torch", True), ("numpy", False), ("torch", True)]
    for g in grads[1:]:
        np.testing.assert_allclose(g, grads[0], rtol=1e-5, atol=1e-6)


class _Intercept(torch.overrides.TorchFunctionMode):
    """A torch-function mode that changes nothing: under it (as under a tracer or a
    FakeTensorMode) a call takes the operator fusedrnn::rnn, not the eager Function."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", MODES)
def test_eager_calls_and_the_operator_agree_exactly(mode):
    """An eager call runs the operator's bodies without its dispatch (_EagerRNN); under a
    mode it takes the operator. Both give the same outputs and gradients, bit for bit,
    with gradients reaching every input, and in training mode with dropout."""
    case, kw, heads = make_case(mode, L=2, D=2, seed=4)
    results = []
    for intercept in (False, True):
        t = _tensors(case)
        with _Intercept() if intercept else contextlib.nullcontext():
            outs = ft.rnn(**t, **kw, p=0.3, seed=7, state_outputs=True)
            node = type(outs[0].grad_fn).__name__
            loss = sum((o * torch.from_numpy(heads[k])).sum()
                       for o, k in zip(outs, ("dout", "dhy", "dcy")))
            loss.backward(retain_graph=True)
            alone = torch.autograd.grad((outs[1] * torch.from_numpy(heads["dhy"])).sum(),
                                        t["data"])   # (no gradient reaches out or cy)
            with torch.no_grad():
                inference = ft.rnn(**t, **kw, state_outputs=True)
        assert (node == "_EagerRNNBackward") != intercept, node
        results.append([*outs, *inference, *alone]
                       + [t[k].grad for k in case if t[k] is not None])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("intercept", [False, True])
def test_a_saved_tensor_hook_that_copies_keeps_the_dropout_masks(intercept):
    """A saved-tensor hook that keeps copies (offloading, compression) frees the forward's
    key, and with it the training record: the backward recomputes the forward with its own
    p and seed, so the same masks, and the gradients are those without the hook."""
    case, kw, heads = make_case("gru", L=2, D=2, seed=6)
    grads = []
    for hooked in (False, True):
        t = _tensors(case)
        copies = torch.autograd.graph.saved_tensors_hooks(lambda x: x.clone(), lambda x: x)
        with _Intercept() if intercept else contextlib.nullcontext(), \
                copies if hooked else contextlib.nullcontext():
            out = ft.rnn(**t, **kw, p=0.5, seed=3, train=True)
        (out * torch.from_numpy(heads["dout"])).sum().backward()
        grads.append([t[k].grad for k in ("data", "parameters", "state")])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
