"""Checks of real use on a lent GPU, one process: (1) a fusedrnn.torch module's forward and
backward on CUDA under torch.cuda.set_sync_debug_mode("error") (any host synchronisation
raises), (2) torch.compile(mode="reduce-overhead") trains 3 steps as eager does.

    PYTHONPATH=. python3 -m fusedrnn.benchmark.gpu_checks
"""
import traceback

import torch

import fusedrnn.torch as frt
from fusedrnn.config import CELLS


def model(mode):
    torch.manual_seed(0)
    return CELLS[mode].torch_module(frt, input_size=64, hidden_size=128, num_layers=2).cuda()


def sync_free(mode):
    net = model(mode)
    x = torch.randn(20, 8, 64, device="cuda", requires_grad=True)
    net(x)[0].sum().backward()   # warm: compiles, allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            out = net(x)[0]
            out.sum().backward()
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def compiled_matches(mode, compile_mode):
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
    dp = max((a - b).abs().max().item() for a, b in zip(p0, p1, strict=True))
    return f"eager {['%.7g' % v for v in l0]} compiled {['%.7g' % v for v in l1]} max|dparam| {dp:.3g}"


def main():
    for mode in ("lstm", "gru"):
        for what, fn, args in (("sync-free fwd+bwd", sync_free, ()),
                               ("compile reduce-overhead", compiled_matches, ("reduce-overhead",))):
            try:
                print(f"{mode} {what}: {fn(mode, *args)}", flush=True)
            except Exception:  # noqa: BLE001
                print(f"{mode} {what}: FAILED\n{traceback.format_exc()[-1500:]}", flush=True)


if __name__ == "__main__":
    main()
