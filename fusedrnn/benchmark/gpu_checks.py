"""Checks of real use on a lent GPU, one process: (1) a fusedrnn.torch module's forward and
backward on CUDA under torch.cuda.set_sync_debug_mode("error") (any host synchronisation
raises), (2) torch.compile(mode="reduce-overhead") trains 3 steps as eager does (within
TOLERANCE). Exits 1 if any check failed.

    PYTHONPATH=. python3 -m fusedrnn.benchmark.gpu_checks
"""
import sys
import traceback

import torch

import fusedrnn.torch as frt
from fusedrnn.config import CELLS


def model(mode):
    torch.manual_seed(0)
    return CELLS[mode].torch_module(frt, input_size=64, hidden_size=128, num_layers=2).cuda()


# The compiled training run against eager (float32, both on the same GPU kernels): the
# losses and parameters after three SGD steps agree to float32 rounding of a few ops' order.
TOLERANCE = 1e-5


def sync_free(mode):
    """(passed, what): two forward + backward passes under sync debug mode "error"."""
    net = model(mode)
    x = torch.randn(20, 8, 64, device="cuda", requires_grad=True)
    net(x)[0].sum().backward()   # warm: compiles, allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            net(x)[0].sum().backward()
        return True, "no host synchronisation"
    except RuntimeError as e:
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def compiled_matches(mode, compile_mode):
    """(passed, what): 3 training steps of torch.compile(mode=compile_mode) against eager."""
    results = []
    for compiled in (False, True):
        net = model(mode)
        step_fn = torch.compile(net, mode=compile_mode) if compiled else net
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        torch.manual_seed(1)
        losses = []
        for _ in range(3):
            x = torch.randn(20, 8, 64, device="cuda")
            opt.zero_grad()
            loss = step_fn(x)[0].pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        results.append((losses, [p.detach().clone() for p in net.parameters()]))
    (l0, p0), (l1, p1) = results
    dloss = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(l0, l1, strict=True))
    dparam = max((a - b).abs().max().item() for a, b in zip(p0, p1, strict=True))
    return (dloss <= TOLERANCE and dparam <= TOLERANCE,
            f"losses' relative difference {dloss:.3g}, parameters' {dparam:.3g}")


def main():
    """One line per check, "check MODE WHAT: ok|FAILED ..."; exit 1 if any failed."""
    failed = 0
    for mode in ("lstm", "gru"):
        for what, fn, args in (("sync-free fwd+bwd", sync_free, ()),
                               ("compile reduce-overhead", compiled_matches, ("reduce-overhead",))):
            try:
                passed, detail = fn(mode, *args)
            except Exception:  # noqa: BLE001  (a check that raises has failed; say where)
                passed, detail = False, "raised\n" + traceback.format_exc()[-1500:]
            failed += not passed
            print(f"check {mode} {what}: {'ok' if passed else 'FAILED'} ({detail})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
