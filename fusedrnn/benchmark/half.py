"""bfloat16 on the CPU against torch's bfloat16, issue 25's targets: the design size
(T=300 N=20 I=H=800), inference and a training step (forward + backward of out.sum()),
through the torch modules, each peer in its own process, the peers alternating round by
round; fusedrnn in float32 beside them.

    python -m fusedrnn.benchmark.half [--rounds 2] [--modes lstm,gru,rnn_tanh]

Prints per round and peer the median of 5 blocks of 3 back-to-back calls, and the ratio
of the medians over rounds (torch's time / fusedrnn's: above 1, fusedrnn is faster).
"""
from __future__ import annotations

import argparse

import numpy as np

from ..config import CELLS
from .processes import alternate, seconds_per_call

SHAPE = dict(T=300, N=20, I=800, H=800)
PEERS = {"torch": ("torch.nn", "bfloat16"), "fusedrnn": ("fusedrnn.torch", "bfloat16"),
         "fusedrnn-f32": ("fusedrnn.torch", "float32")}


def _one(mode, peer, train):
    """Seconds per call of one peer (runs in its own process)."""
    import torch
    module_name, dtype = PEERS[peer]
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cell = CELLS[mode]
    import fusedrnn.torch as ft
    package = torch.nn if module_name == "torch.nn" else ft
    T, N, I, H = SHAPE["T"], SHAPE["N"], SHAPE["I"], SHAPE["H"]
    module = cell.torch_module(package, input_size=I, hidden_size=H).to(getattr(torch, dtype))
    x = torch.randn(T, N, I).to(getattr(torch, dtype))

    def call():
        if train:
            xx = x.detach().requires_grad_(True)
            module(xx)[0].float().sum().backward()
        else:
            with torch.no_grad():
                module(x)
    return seconds_per_call(call)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default="lstm,gru,rnn_tanh")
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)   # mode infer|train peer
    args = p.parse_args(argv)
    if args.one:
        print(_one(args.one[0], args.one[2], args.one[1] == "train"))
        return
    T, N, I, H = SHAPE["T"], SHAPE["N"], SHAPE["I"], SHAPE["H"]
    print(f"T={T} N={N} I={I} H={H}, 2 torch threads; ms per call (GFLOP/s)")
    for mode in args.modes.split(","):
        flops = 2 * T * N * CELLS[mode].gates * H * (I + H)
        for phase in ("infer", "train"):
            times = alternate("fusedrnn.benchmark.half", PEERS, args.rounds, mode, phase)
            work = flops * (3 if phase == "train" else 1)
            cells = [f"{peer} " + " ".join(f"{t * 1e3:.1f}" for t in ts) +
                     f" ({work / np.median(ts) / 1e9:.0f})" for peer, ts in times.items()]
            ratio = np.median(times["torch"]) / np.median(times["fusedrnn"])
            print(f"{mode:8s} {phase}: " + "; ".join(cells) + f"; torch/fusedrnn {ratio:.2f}")


if __name__ == "__main__":
    main()
