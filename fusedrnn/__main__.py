"""`python -m fusedrnn bench`: the benchmark (fusedrnn/benchmark); `python -m fusedrnn demo`:
one small training step, checked against torch when installed."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import fusedrnn
from fusedrnn.config import CELLS


def demo(args) -> int:
    T, N, I, H, L = args.seq_len, args.batch, args.input_size, args.hidden, args.layers
    rng = np.random.default_rng(0)
    kw = dict(mode=args.mode, state_size=H, num_layers=L, bidirectional=args.bidirectional)
    D = 2 if args.bidirectional else 1
    layout = fusedrnn.param_layout(input_size=I, **kw)
    data = rng.standard_normal((T, N, I))
    params = rng.uniform(-H ** -0.5, H ** -0.5, layout.size)
    start = time.perf_counter()
    out, handle = fusedrnn.RNN(data, params, **kw, train=True)
    grads = fusedrnn.rnn_backward(handle, np.ones_like(out))
    elapsed = time.perf_counter() - start
    print(f"fusedrnn {fusedrnn.__version__}: {args.mode} T={T} N={N} I={I} H={H} layers={L} "
          f"directions={D}, float64")
    print(f"  out {out.shape}, |grad parameters| = {np.linalg.norm(grads.parameters):.6f}, "
          f"forward+backward {elapsed * 1e3:.1f} ms (first call includes kernel load)")
    try:
        import torch
    except ImportError:
        print("  torch not installed: skipped the comparison with torch.nn")
        return 0
    cell = CELLS[args.mode]
    module = cell.torch_module(torch.nn, I, H, num_layers=L,
                               bidirectional=args.bidirectional).double()
    module.load_state_dict({k: torch.from_numpy(v) for k, v in
                            layout.to_torch_state_dict(params).items()})
    x = torch.from_numpy(data).requires_grad_()
    t_out = module(x)[0]
    t_out.sum().backward()
    t_grad = layout.from_torch_state_dict({k: p.grad for k, p in module.named_parameters()})
    err_out = np.abs(out - t_out.detach().numpy()).max()
    err_grad = np.abs(grads.parameters - t_grad).max()
    print(f"  torch {torch.__version__} nn.{cell.torch_class}: max |out diff| = {err_out:.1e}, "
          f"max |grad diff| = {err_grad:.1e}")
    return 0 if max(err_out, err_grad) < 1e-9 else 1


def _compile(args):
    from . import precompile
    return precompile.main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedrnn")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run one small training step (and compare with torch)")
    p.add_argument("--mode", default="lstm", choices=fusedrnn.MODES)
    p.add_argument("--seq-len", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--input-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--bidirectional", action="store_true")
    p.set_defaults(run=demo)
    c = sub.add_parser("compile", help="compile the CPU kernels into Numba's disk cache "
                                        "ahead of the first call (images, CI)")
    c.add_argument("--modes", default="all", help="comma-separated, or all")
    c.add_argument("--dtypes", default="float32", help="comma-separated, of float32, "
                                                       "float64, float16, bfloat16")
    c.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="kernel sets compiled at a time")
    c.add_argument("--force", action="store_true", help="compile sets already marked ready")
    c.set_defaults(run=_compile)
    from . import benchmark
    b = sub.add_parser("bench", help="fusedrnn vs torch.nn and naive loops, side by side")
    benchmark.add_arguments(b)
    b.set_defaults(run=benchmark.run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
