"""Ragged batches cost what the padded batch of the same T costs.

    python -m fusedrnn.benchmark.ragged --mode lstm -T 100 -N 32 -I 256 -H 256 --repeats 7

Times, interleaved and after a warm-up, fusedrnn on the padded batch (every sample T
steps) and on the same batch with random lengths in 1..T (use_sequence_length=True);
torch.nn on the padded batch and on the PackedSequence of the same lengths is shown for
context. Loop timing, as in fusedrnn/benchmark/runner.py: each turn is untimed warm-in
calls, then a block of back-to-back calls lasting at least --block-ms (all four in this
one process). Prints medians (min-max) of the blocks' time per call and the
ragged/padded ratio for each.
"""
from __future__ import annotations

import argparse

import numpy as np

import fusedrnn
from fusedrnn.config import CELLS

from . import runner


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="lstm")
    p.add_argument("-T", type=int, default=100)
    p.add_argument("-N", type=int, default=32)
    p.add_argument("-I", type=int, default=256)
    p.add_argument("-H", type=int, default=256)
    p.add_argument("--train", action="store_true", help="forward+backward instead of inference")
    p.add_argument("--repeats", type=int, default=7, help="timed blocks of each")
    p.add_argument("--block-ms", type=float, default=1e3 * runner.BLOCK_S,
                   help="a timed block of back-to-back calls lasts at least this long")
    args = p.parse_args()
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence

    rng = np.random.default_rng(0)
    T, N = args.T, args.N
    kw = dict(mode=args.mode, state_size=args.H, num_layers=1)
    layout = fusedrnn.param_layout(input_size=args.I, **kw)
    data = rng.standard_normal((T, N, args.I), dtype=np.float32)
    params = rng.uniform(-args.H ** -0.5, args.H ** -0.5, layout.size).astype(np.float32)
    lengths = rng.integers(1, T + 1, N).astype(np.int32)
    lengths[0] = T
    cell = CELLS[args.mode]
    module = cell.torch_module(torch.nn, args.I, args.H)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in
                            layout.to_torch_state_dict(params).items()})
    x = torch.from_numpy(data)

    def ours(ragged):
        extra = dict(sequence_length=lengths, use_sequence_length=True) if ragged else {}
        if not args.train:
            return fusedrnn.RNN(data, params, **kw, **extra)
        out, handle = fusedrnn.RNN(data, params, **kw, **extra, train=True)
        return fusedrnn.rnn_backward(handle, np.ones_like(out))

    def theirs(ragged):
        inp = pack_padded_sequence(x, torch.from_numpy(lengths), enforce_sorted=False) if ragged else x
        with torch.set_grad_enabled(args.train):
            if args.train:
                module.zero_grad()
            out = module(inp)[0]
            if args.train:  # a PackedSequence's .data is its (grad-tracking) packed tensor
                (out.data if ragged else out).sum().backward()

    runs = {"fusedrnn padded": lambda: ours(False), "fusedrnn ragged": lambda: ours(True),
            "torch padded": lambda: theirs(False), "torch packed": lambda: theirs(True)}
    device = runner.Device("cpu")
    sizes = {}
    for k, f in runs.items():
        f()  # compilation, allocation
        sizes[k] = runner.size_block(device, f, args.block_ms / 1e3)
    times = {k: [] for k in runs}
    for _ in range(args.repeats):
        for k, f in runs.items():
            times[k].append(runner.time_block(device, f, *sizes[k]))
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"{args.mode} T={T} N={N} I={args.I} H={args.H} float32 "
          f"{'training' if args.train else 'inference'}, lengths 1..{T} (mean "
          f"{lengths.mean():.1f}), torch threads {torch.get_num_threads()}, median of "
          f"{args.repeats} blocks of >= {args.block_ms:g} ms (min-max)")
    for k, v in times.items():
        print(f"  {k:16s} {med[k] * 1e3:8.1f} ms ({min(v) * 1e3:.1f}-{max(v) * 1e3:.1f})")
    print(f"  ragged/padded: fusedrnn {med['fusedrnn ragged'] / med['fusedrnn padded']:.3f}, "
          f"torch {med['torch packed'] / med['torch padded']:.3f}")


if __name__ == "__main__":
    main()
