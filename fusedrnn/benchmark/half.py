"""Half precision against torch in the same dtype, issue 25's targets: the design size
(T=300 N=20 I=H=800), inference and a training step (forward + backward of out.sum()),
through the torch modules, each peer in its own process, the peers alternating round by
round.

    python -m fusedrnn.benchmark.half [--rounds 2] [--modes lstm,gru,rnn_tanh]
    python -m fusedrnn.benchmark.half --device cuda --dtypes float16,bfloat16 --modes lstm,gru

CPU: torch's bfloat16 (oneDNN), fusedrnn's bfloat16 and, beside them, fusedrnn in float32;
and the ceiling (bfloat16): the grid's GEMM ceiling (worker.gemm_ceilings: the fastest
2048^3 GEMM, usually oneDNN's mkldnn Linear) in a process of its own, printed as the time
the call's FLOPs would take at that rate, and each peer's fraction of it ("of the ceiling").
CUDA: cuDNN (torch.nn) in the dtype, fusedrnn as it runs by default (the persistent
kernels' tensor-core products and the large GEMMs in half; set explicitly), and fusedrnn
with both turned off (FUSEDRNN_GPU_TENSOR_CORES=0 FUSEDRNN_GPU_HALF_GEMMS=0: the float32
products and GEMMs on the half data), and fusedrnn built without its 16-byte staging
loads (FUSEDRNN_GPU_WIDE_STAGING=0). Prints per round and peer the median of 5 blocks of 3
back-to-back calls (on CUDA each block ends with a synchronize), and the ratio of the
medians over rounds (torch's time / fusedrnn's: above 1, fusedrnn is faster).
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from ..config import CELLS
from .processes import alternate, seconds_per_call

SHAPE = dict(T=300, N=20, I=800, H=800)
# peer: (module package, dtype: None for the run's, environment)
PEERS = {
    "cpu": {"torch": ("torch.nn", None, {}), "fusedrnn": ("fusedrnn.torch", None, {}),
            "fusedrnn-f32": ("fusedrnn.torch", "float32", {}),
            "ceiling": (None, None, {})},
    "cuda": {"torch": ("torch.nn", None, {}),
             "fusedrnn": ("fusedrnn.torch", None, {"FUSEDRNN_GPU_TENSOR_CORES": "1",
                                                   "FUSEDRNN_GPU_HALF_GEMMS": "1"}),
             "fusedrnn-f32-products": ("fusedrnn.torch", None,
                                       {"FUSEDRNN_GPU_TENSOR_CORES": "0",
                                        "FUSEDRNN_GPU_HALF_GEMMS": "0"}),
             # the staging's 2-byte loads (persistent.cuh's stage_half_rows_wide untimed)
             "fusedrnn-scalar-staging": ("fusedrnn.torch", None,
                                         {"FUSEDRNN_GPU_WIDE_STAGING": "0"})},
}


def _flops(mode, train):
    T, N, I, H = SHAPE["T"], SHAPE["N"], SHAPE["I"], SHAPE["H"]
    return 2 * T * N * CELLS[mode].gates * H * (I + H) * (3 if train else 1)


def _ceiling(mode, train, dtype):
    """Seconds the call's FLOPs take at the GEMM ceiling in `dtype`: the grid's
    (worker.gemm_ceilings: the fastest 2048^3 GEMM on the CPU, usually oneDNN's)."""
    from .runner import Device
    from .worker import gemm_ceilings
    ceiling = gemm_ceilings(Device("cpu"), dtypes=(dtype,))[dtype]
    if ceiling["best"] is None:
        raise RuntimeError(f"no GEMM in {dtype} ran on this CPU: {ceiling['unavailable']}")
    return _flops(mode, train) / (ceiling["best"] * 1e9)


def _one(mode, peer, train, dtype, device):
    """Seconds per call of one peer (runs in its own process)."""
    module_name, own_dtype, environ = PEERS[device][peer]
    os.environ.update(environ)
    import torch
    torch.set_num_threads(2)
    if peer == "ceiling":
        return _ceiling(mode, train, dtype)
    torch.manual_seed(0)
    cell = CELLS[mode]
    import fusedrnn.torch as ft
    package = torch.nn if module_name == "torch.nn" else ft
    T, N, I, H = SHAPE["T"], SHAPE["N"], SHAPE["I"], SHAPE["H"]
    dtype = getattr(torch, own_dtype or dtype)
    module = cell.torch_module(package, input_size=I, hidden_size=H).to(device, dtype)
    x = torch.randn(T, N, I).to(device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else None

    def call():
        if train:
            xx = x.detach().requires_grad_(True)
            module(xx)[0].float().sum().backward()
        else:
            with torch.no_grad():
                module(x)
    return seconds_per_call(call, sync=sync)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default="lstm,gru,rnn_tanh")
    p.add_argument("--device", choices=tuple(PEERS), default="cpu")
    p.add_argument("--dtypes", default=None,
                   help="comma-separated (default: bfloat16 on cpu, float16,bfloat16 on cuda)")
    p.add_argument("--one", nargs=5, help=argparse.SUPPRESS)   # mode phase dtype device peer
    args = p.parse_args(argv)
    if args.one:
        mode, phase, dtype, device, peer = args.one
        print(_one(mode, peer, phase == "train", dtype, device))
        return
    dtypes = args.dtypes or ("bfloat16" if args.device == "cpu" else "float16,bfloat16")
    T, N, I, H = SHAPE["T"], SHAPE["N"], SHAPE["I"], SHAPE["H"]
    threads = ", 2 torch threads" if args.device == "cpu" else ""
    print(f"T={T} N={N} I={I} H={H}, {args.device}{threads}; ms per call (GFLOP/s)")
    for dtype in dtypes.split(","):
        for mode in args.modes.split(","):
            for phase in ("infer", "train"):
                peers = [p for p in PEERS[args.device] if p != "ceiling" or dtype == "bfloat16"]
                times = alternate("fusedrnn.benchmark.half", peers, args.rounds,
                                  mode, phase, dtype, args.device)
                work = _flops(mode, phase == "train")
                cells = [f"{peer} " + " ".join(f"{t * 1e3:.2f}" for t in ts) +
                         f" ({work / np.median(ts) / 1e9:.0f})" for peer, ts in times.items()]
                ratio = np.median(times["torch"]) / np.median(times["fusedrnn"])
                line = f"{dtype:8s} {mode:8s} {phase}: " + "; ".join(cells) + \
                    f"; torch/fusedrnn {ratio:.2f}"
                if "ceiling" in times:
                    line += "; of the ceiling: " + ", ".join(
                        f"{peer} {np.median(times['ceiling']) / np.median(ts):.2f}"
                        for peer, ts in times.items() if peer != "ceiling")
                print(line, flush=True)


if __name__ == "__main__":
    main()
