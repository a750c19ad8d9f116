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
    torch.testing.assert_close(ours.weight.grad.cpu(), torch.from_numpy(grad), rtol=1e-10,
                               atol=1e-12)
