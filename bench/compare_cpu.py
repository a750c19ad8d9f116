"""One configuration timed side by side: fusedrnn, torch.nn (oneDNN), a naive numpy loop.

    python bench/compare_cpu.py --mode lstm -T 300 -N 20 -I 800 -H 800 --repeats 5

Inference, float32 by default. Calls are interleaved (fusedrnn, torch, naive, then again)
so machine noise hits all three alike; each is warmed up once; medians and min-max of
`--repeats` runs are printed, and ratios of medians (> 1 means fusedrnn is faster).
The full benchmark suite and CLI are issue 5's; this is the first reading.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

import fusedrnn


def naive_loop(data, params, layout, mode, H):
    """The textbook way: per step x[t] @ W_x.T + h @ W_h.T, one layer, one direction."""
    wx, wh = layout.view(params, 0, 0, "W_x"), layout.view(params, 0, 0, "W_h")
    b = layout.view(params, 0, 0, "b_x") + layout.view(params, 0, 0, "b_h")
    h = np.zeros((data.shape[1], H), data.dtype)
    c = np.zeros_like(h)
    out = np.empty((data.shape[0],) + h.shape, data.dtype)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    for t in range(data.shape[0]):
        a = data[t] @ wx.T + h @ wh.T + b
        if mode == "lstm":
            i, f, g, o = np.split(a, 4, axis=1)
            c = sig(f) * c + sig(i) * np.tanh(g)
            h = sig(o) * np.tanh(c)
        elif mode == "gru":
            raise SystemExit("naive loop: lstm / rnn_tanh only")
        else:
            h = np.tanh(a)
        out[t] = h
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="lstm")
    p.add_argument("-T", type=int, default=300)
    p.add_argument("-N", type=int, default=20)
    p.add_argument("-I", type=int, default=800)
    p.add_argument("-H", type=int, default=800)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import torch
    rng = np.random.default_rng(0)
    dtype = np.dtype(args.dtype)
    layout = fusedrnn.param_layout(mode=args.mode, input_size=args.I, state_size=args.H)
    data = rng.standard_normal((args.T, args.N, args.I)).astype(dtype)
    params = rng.uniform(-args.H ** -0.5, args.H ** -0.5, layout.size).astype(dtype)
    cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}.get(args.mode, torch.nn.RNN)
    module = cls(args.I, args.H).to(getattr(torch, args.dtype))
    module.load_state_dict({k: torch.from_numpy(v) for k, v in
                            layout.to_torch_state_dict(params).items()})
    x = torch.from_numpy(data)
    runs = {
        "fusedrnn": lambda: fusedrnn.RNN(data, params, state_size=args.H, num_layers=1,
                                         mode=args.mode),
        "torch": lambda: module(x),
        "naive": lambda: naive_loop(data, params, layout, args.mode, args.H),
    }
    times = {k: [] for k in runs}
    with torch.no_grad():
        for f in runs.values():
            f()
        for _ in range(args.repeats):
            for k, f in runs.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    flop = 2 * args.T * args.N * (args.I + args.H) * layout.config.gate_rows
    print(f"{args.mode} T={args.T} N={args.N} I={args.I} H={args.H} {args.dtype} inference, "
          f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
          f"median of {args.repeats} (min-max)")
    med = {k: float(np.median(v)) for k, v in times.items()}
    for k, v in times.items():
        print(f"  {k:9s} {med[k] * 1e3:9.1f} ms ({min(v) * 1e3:.1f}-{max(v) * 1e3:.1f})  "
              f"{flop / med[k] / 1e9:6.1f} GFLOP/s  fusedrnn speed-up x{med[k] / med['fusedrnn']:.2f}")


if __name__ == "__main__":
    main()
