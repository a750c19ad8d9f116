"""fusedrnn.torch on CUDA tensors (needs a CUDA device with CuPy; skipped cleanly without)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

try:
    import cupy
    HAVE_GPU = torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001  (no CuPy or no driver: no GPU)
    HAVE_GPU = False
if not HAVE_GPU:
    pytest.skip("no CUDA device (or no CuPy)", allow_module_level=True)

import fusedrnn  # noqa: E402
import fusedrnn.torch as ft  # noqa: E402
from fusedrnn.config import CELLS  # noqa: E402


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_module_on_cuda_matches_torch_nn_on_cuda(mode):
    torch.manual_seed(0)
    name = CELLS[mode].torch_class
    theirs = getattr(torch.nn, name)(5, 7, num_layers=2, bidirectional=True).double().cuda()
    ours = getattr(ft, name)(5, 7, num_layers=2, bidirectional=True)
    ours = ours.double().cuda()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(6, 3, 5, dtype=torch.float64, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # a non-default stream: CuPy must run on it too
        outs = [m(x)[0] for m in (theirs, ours)]
        for o in outs:
            o.square().sum().backward()
    torch.cuda.synchronize()
    assert outs[1].is_cuda
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-12)
    grad = ours.layout.from_torch_state_dict({k: p.grad for k, p in theirs.named_parameters()})
    flat = ours.layout.from_torch_state_dict({k: p.grad for k, p in ours.named_parameters()})
    torch.testing.assert_close(torch.from_numpy(flat), torch.from_numpy(grad), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("tensor_cores, half_gemms", [("0", "0"), ("1", "0"), ("1", "1")],
                         ids=["float32-products", "tensor-cores", "tensor-cores+half-gemms"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])   # (relu's kink: test_parity)
def test_half_module_on_cuda_equals_the_cpu_module(mode, dtype, tensor_cores, half_gemms,
                                                   monkeypatch):
    """float16 (CuPy's half path) and bfloat16 (float32 through torch's casts, the op told
    the data was bfloat16: CuPy has none) on CUDA, the persistent kernels' products on
    tensor cores or not (FUSEDRNN_GPU_TENSOR_CORES), the large GEMMs in half or not
    (FUSEDRNN_GPU_HALF_GEMMS): outputs and gradients as the same module on the CPU within
    test_precision's bound, twice (each side is within it of the float64 result)."""
    monkeypatch.setenv("FUSEDRNN_GPU_TENSOR_CORES", tensor_cores)
    monkeypatch.setenv("FUSEDRNN_GPU_HALF_GEMMS", half_gemms)
    fusedrnn.clear_cache()   # the setting is read as an op is built
    from fusedrnn.gpu import halfgemm
    calls, real = [], halfgemm.HalfGemm.matmul
    monkeypatch.setattr(halfgemm.HalfGemm, "matmul",
                        lambda self, *args, **kw: calls.append(args[5]) or real(self, *args, **kw))
    torch.manual_seed(0)
    name = CELLS[mode].torch_class
    cpu = getattr(ft, name)(5, 16, num_layers=2, bidirectional=True).to(dtype)
    gpu = getattr(ft, name)(5, 16, num_layers=2, bidirectional=True).to(dtype).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(6, 3, 5).to(dtype)
    outs = []
    for module, inp in ((cpu, x), (gpu, x.cuda())):
        out = module(inp)[0]
        out.float().square().sum().backward()
        outs.append((out.cpu(), module.weight_hh_l0.grad.cpu()))
    # the backward's GEMMs in the module's dtype (T*N = 18 rows: the projections float32)
    want = {str(dtype).split(".")[1]} if half_gemms == "1" else set()
    assert set(calls) == want and len(calls) == (2 * (1 + 2 * 2) if want else 0)
    u = 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8
    for a, b in zip(outs[1], outs[0]):
        assert a.dtype == dtype
        a, b = a.double(), b.double()
        assert (a - b).abs().max() <= 2 * (2 * u + 16 * 32 ** 0.5 * 2.0 ** -24) * b.abs().max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast_runs_in_its_dtype_like_torch_nn(dtype):
    torch.manual_seed(0)
    theirs = torch.nn.LSTM(5, 16).cuda()
    ours = ft.LSTM(5, 16).cuda()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(6, 3, 5, device="cuda")
    with torch.autocast("cuda", dtype):
        out_theirs = theirs(x)[0]
        out = ours(x)[0]
    # fusedrnn runs in autocast's dtype. torch.nn's cuDNN RNN runs in float16 under either
    # (its autocast wrapper casts to half: torch 2.11, seen on an H200 on 2026-11-26), so
    # its dtype is not compared; its values are, within bfloat16's unit roundoff.
    assert out.dtype == dtype and out_theirs.dtype in (dtype, torch.float16)
    torch.testing.assert_close(out.float(), out_theirs.float(), rtol=0, atol=4 * 2.0 ** -8)


def test_fullgraph_compiled_model_trains_as_eager_on_cuda():
    import copy

    from test_torch_compile import make, train_three_steps
    torch._dynamo.reset()
    eager, tokens, targets = make("cuda")
    compiled = copy.deepcopy(eager)
    want = train_three_steps(eager, eager, tokens, targets)
    got = train_three_steps(compiled, torch.compile(compiled, fullgraph=True), tokens,
                            targets)
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_packed_sequence_on_cuda_matches_torch_nn(enforce_sorted):
    """A PackedSequence of CUDA data: pad_packed_sequence gives its lengths on the CPU,
    which the module moves to the data's device (rnn() refuses mixed devices); outputs,
    states and gradients as torch.nn's, h_0 given where the batch is not sorted."""
    torch.manual_seed(0)
    theirs = torch.nn.GRU(5, 7, num_layers=2).double().cuda()
    ours = ft.GRU(5, 7, num_layers=2).double().cuda()
    ours.load_state_dict(theirs.state_dict())
    lengths = [6, 4, 1] if enforce_sorted else [4, 6, 1]
    x = torch.randn(6, 3, 5, dtype=torch.float64, device="cuda")
    h0 = None if enforce_sorted else torch.randn(2, 3, 7, dtype=torch.float64, device="cuda")
    results = []
    for module in (theirs, ours):
        xs = x.clone().requires_grad_()
        packed = torch.nn.utils.rnn.pack_padded_sequence(xs, lengths,
                                                         enforce_sorted=enforce_sorted)
        out, hy = module(packed, h0)
        (out.data.square().sum() + hy.sum()).backward()
        results.append((out.data, hy, xs.grad, module.weight_hh_l1.grad))
    assert all(t.is_cuda for t in results[1])
    for got, want in zip(*reversed(results)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
