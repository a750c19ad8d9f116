"""Device memory of a training step and of an inference, fusedrnn.torch against torch.nn
(cuDNN), on a lent GPU: issue 41's and 47's peak memory, and 47's growth over a long loop.

Each peer runs in its own process (torch's caching allocator and CuPy's pool start empty)
and reports, above what the module and its input held before the first call:
  peak     the most the call held at once: torch's max_memory_allocated (cuDNN's
           workspace and reserve included) plus, for fusedrnn, the bytes CuPy's pool holds
           after the call (its scratch, reserve and results; the pool keeps what it took,
           so this is its own high-water mark)
  steps    for a training loop: the same figure after 10 steps and after --steps steps
           (the loop must not grow: equal within the allocator's rounding)

    PYTHONPATH=. python3 -m fusedrnn.benchmark.gpu_memory [--modes lstm,gru]
        [--batches 20,256] [--steps 1000] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from ..config import CELLS

SHAPE = dict(T=300, I=800, H=800)
PEERS = ("torch", "fusedrnn")


def _held(torch, cupy):
    """(bytes torch's allocator holds in tensors, bytes CuPy's pool holds)."""
    return torch.cuda.memory_allocated(), (cupy.get_default_memory_pool().total_bytes()
                                           if cupy is not None else 0)


def _one(peer, mode, batch, train, steps):
    """{"peak": bytes, "after_10": bytes, "after_steps": bytes} above the baseline."""
    import torch
    cupy = None
    if peer == "fusedrnn":
        import cupy

        import fusedrnn.torch as package
    else:
        package = torch.nn
    torch.manual_seed(0)
    T, I, H = SHAPE["T"], SHAPE["I"], SHAPE["H"]
    module = CELLS[mode].torch_module(package, input_size=I, hidden_size=H).cuda()
    x = torch.randn(T, batch, I, device="cuda", requires_grad=train)
    torch.cuda.synchronize()
    base = sum(_held(torch, cupy))
    torch.cuda.reset_peak_memory_stats()

    def step():
        if train:
            module.zero_grad(set_to_none=True)
            x.grad = None
            module(x)[0].sum().backward()
        else:
            with torch.no_grad():
                module(x)

    step()
    torch.cuda.synchronize()
    pool = _held(torch, cupy)[1]
    result = {"peak": torch.cuda.max_memory_allocated() + pool - base}
    if train and steps:
        held = {}
        for i in range(1, steps + 1):
            step()
            if i in (10, steps):
                torch.cuda.synchronize()
                held[i] = sum(_held(torch, cupy)) - base
        result.update(after_10=held[10], after_steps=held[steps])
    return result


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="lstm,gru")
    parser.add_argument("--batches", default="20,256")
    parser.add_argument("--steps", type=int, default=1000,
                        help="training steps of the growth check (0: none)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if 0 < args.steps < 10:
        parser.error(f"--steps: expected 0 or at least 10 (it compares step 10 with the "
                     f"last), got {args.steps}")
    if args.one:
        peer, mode, batch, train, steps = args.one
        print(json.dumps(_one(peer, mode, int(batch), train == "train", int(steps))))
        return 0
    rows = []
    print(f"T={SHAPE['T']} I=H={SHAPE['H']}, one layer, float32; MiB above the module and "
          f"its input; each peer in its own process")
    print("| mode | N | kind | cuDNN peak | fusedrnn peak | fusedrnn / cuDNN | "
          "fusedrnn after 10 steps | after N steps |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for train in (False, True):
                kind = "train" if train else "infer"
                got = {}
                for peer in PEERS:
                    done = subprocess.run(
                        [sys.executable, "-m", "fusedrnn.benchmark.gpu_memory", "--one", peer,
                         mode, str(batch), kind, str(args.steps if peer == "fusedrnn" else 0)],
                        capture_output=True, text=True)
                    if done.returncode:
                        print(done.stderr, file=sys.stderr)
                        got[peer] = None
                        continue
                    got[peer] = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(dict(mode=mode, N=batch, kind=kind, **got))
                mib = {p: (g["peak"] / 2 ** 20 if g else float("nan")) for p, g in got.items()}
                fused = got.get("fusedrnn") or {}
                growth = (f"{fused['after_10'] / 2 ** 20:.1f} | {fused['after_steps'] / 2 ** 20:.1f}"
                          if "after_10" in fused else "n/a | n/a")
                print(f"| {mode} | {batch} | {kind} | {mib['torch']:.1f} | {mib['fusedrnn']:.1f} "
                      f"| {mib['fusedrnn'] / mib['torch']:.2f} | {growth} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=SHAPE, steps=args.steps, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
