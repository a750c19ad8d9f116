"""fusedrnn.torch under torch.compile(fullgraph=True) against the same model eager, issue
26's target: the benchmark's train-step models (cases.TRAIN_MODELS: an RNN, a linear head,
cross-entropy, Adam), each variant in its own process, alternating round by round.

    python -m fusedrnn.benchmark.compiled [--rounds 2] [--models tagger,encoder,acoustic]

Prints per model the milliseconds per step of each round (median of 5 blocks of 3 steps,
after warm-up steps that include the compile) and eager / compiled (above 1: the compiled
step is faster).
"""
from __future__ import annotations

import argparse

import numpy as np

from .cases import TRAIN_MODELS
from .processes import alternate, seconds_per_call


def _one(model, compiled):
    """Seconds per training step of one variant (runs in its own process)."""
    import torch

    import fusedrnn.torch as ft

    from ..config import CELLS
    name, mode, B, T, I, H, L, bi = next(m for m in TRAIN_MODELS if m[0] == model)
    torch.manual_seed(0)
    rnn = CELLS[mode].torch_module(ft, I, H, num_layers=L, bidirectional=bi)
    head = torch.nn.Linear((2 if bi else 1) * H, 32)
    params = list(rnn.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    x, y = torch.randn(T, B, I), torch.randint(0, 32, (T * B,))

    def loss_of(x, y):
        out = rnn(x)[0]
        return torch.nn.functional.cross_entropy(head(out.reshape(-1, out.shape[-1])), y)
    if compiled:
        loss_of = torch.compile(loss_of, fullgraph=True)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_of(x, y).backward()
        opt.step()
    return seconds_per_call(step, warmup=3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--models", default=",".join(m[0] for m in TRAIN_MODELS))
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)   # model eager|compiled
    args = p.parse_args(argv)
    if args.one:
        print(_one(args.one[0], args.one[1] == "compiled"))
        return
    print("ms per training step, fusedrnn.torch eager vs torch.compile(fullgraph=True)")
    for model in args.models.split(","):
        times = alternate("fusedrnn.benchmark.compiled", ("eager", "compiled"), args.rounds,
                          model)
        cells = "; ".join(f"{k} " + " ".join(f"{t * 1e3:.1f}" for t in v)
                          for k, v in times.items())
        ratio = np.median(times["eager"]) / np.median(times["compiled"])
        print(f"{model:9s} {cells}; eager/compiled {ratio:.2f}")


if __name__ == "__main__":
    main()
