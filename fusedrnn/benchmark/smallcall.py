"""One small call in a loop, the op's per-call cost alone: T=1 N=1 float32, I = H, one
layer; blocks of back-to-back calls after a warm-up, in this process (run two trees
alternately to compare them).

    python -m fusedrnn.benchmark.smallcall [MODE] [H] [train] [--blocks 7] [--calls 2000]
prints "MODE H infer|train us/call median M min L".
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import fusedrnn


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", default="lstm")
    parser.add_argument("H", nargs="?", type=int, default=8)
    parser.add_argument("phase", nargs="?", choices=("infer", "train"), default="infer")
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    kw = dict(mode=args.mode, state_size=args.H, num_layers=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, args.H)).astype(np.float32)
    p = (rng.standard_normal(fusedrnn.param_size(input_size=args.H, **kw)) * 0.1
         ).astype(np.float32)

    def call():
        if args.phase == "train":
            y, handle = fusedrnn.RNN(x, p, train=True, **kw)
            fusedrnn.rnn_backward(handle, np.ones_like(y))
        else:
            fusedrnn.RNN(x, p, **kw)

    for _ in range(200):
        call()
    per_call = []
    for _ in range(args.blocks):
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        per_call.append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"{args.mode} {args.H} {args.phase} us/call median "
          f"{statistics.median(per_call):.1f} min {min(per_call):.1f}")


if __name__ == "__main__":
    main()
