"""`python -m fusedrnn bench`: fusedrnn against what a user would pick instead, side by
side in one process, as ratios. See cases.py for what runs and runner.py for how."""
from __future__ import annotations

import os
import platform
import sys

import numpy as np

from . import cases as case_lib
from . import report, runner


def add_arguments(parser):
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and 3 repeats: under a minute on 2 cores")
    parser.add_argument("--cases", default=",".join(case_lib.GROUPS),
                        help=f"comma-separated groups of {', '.join(case_lib.GROUPS)}")
    parser.add_argument("--peers", default=",".join(runner.PEERS),
                        help=f"comma-separated, of {', '.join(runner.PEERS)}")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per peer and case (default 5, --quick 3)")
    parser.add_argument("--json", default=None, help="default: fusedrnn-bench-DEVICE.json")
    parser.add_argument("--plot", default=None, help="default: fusedrnn-bench-DEVICE-batch.png")


def run(args):
    groups = [g.strip() for g in args.cases.split(",") if g.strip()]
    wanted = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(groups) - set(case_lib.GROUPS)) + sorted(set(wanted) - set(runner.PEERS))
    if unknown or "fusedrnn" not in wanted:
        print(f"bench: unknown case groups or peers {unknown}, or fusedrnn missing from "
              f"--peers; groups: {case_lib.GROUPS}, peers: {runner.PEERS}", file=sys.stderr)
        return 2
    repeats = args.repeats or (3 if args.quick else 5)
    device = runner.Device(args.device)
    dtype = np.dtype(args.dtype)
    peers, notes = runner.available_peers(device, wanted)
    meta = _machine(device, repeats, args)
    print(meta["description"])
    for note in notes:
        print(note)
    ceiling = runner.gemm_ceiling(device, dtype)
    print(f"GEMM ceiling ({args.dtype}, same run): {ceiling:.1f} GFLOP/s")
    todo = case_lib.cases(groups, quick=args.quick)
    results = []
    for i, case in enumerate(todo, 1):
        _progress(i, len(todo), case)
        if case.group == "cold":
            times = runner.cold_start(case, device, dtype, repeats)
        else:
            times = runner.run_case(case, device, np.dtype(case.dtype or dtype), peers, repeats)
        results.append((case, {k: runner.summary(v) for k, v in times.items()}))
    print(file=sys.stderr)
    print(report.table(results, ceiling, peers))
    json_path = args.json or f"fusedrnn-bench-{args.device}.json"
    report.write_json(json_path, meta, results, ceiling)
    plot_path = args.plot or f"fusedrnn-bench-{args.device}-batch.png"
    title = f"fusedrnn bench, {args.device}, {args.dtype}, median of {repeats}"
    note = report.plot_batch(plot_path, results, title)
    print(f"\nJSON: {json_path}" + (f"\n{note}" if note else
                                     f"\nplot: {plot_path}" if "batch" in groups else ""))
    return 0


def _progress(i, n, case):
    width = 24
    done = width * i // n
    print(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {case.name:60s}", end="",
          file=sys.stderr, flush=True)


def _machine(device, repeats, args):
    import numba

    from .. import cpu  # noqa: F401  (fixes Numba's threading layer before we query it)
    info = {"python": platform.python_version(), "numpy": np.__version__,
            "numba": numba.__version__, "cpu_count": os.cpu_count(),
            "numba_threads": numba.get_num_threads(), "machine": platform.processor() or
            platform.machine(), "device": args.device, "dtype": args.dtype,
            "repeats": repeats, "quick": args.quick}
    try:
        import torch
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    except ImportError:
        pass
    if device.name == "gpu":
        props = device.xp.cuda.runtime.getDeviceProperties(device.xp.cuda.Device().id)
        info["gpu"] = props["name"].decode()
    threads = f"numba threads {info['numba_threads']}" + (
        f", torch threads {info['torch_threads']}" if "torch_threads" in info else "")
    info["description"] = (
        f"fusedrnn bench: {args.device} ({info.get('gpu', info['machine'])}, "
        f"{info['cpu_count']} cores, {threads}), {args.dtype}, median of {repeats} "
        f"interleaved runs after a warm-up (min-max); python {info['python']}, numpy "
        f"{info['numpy']}, numba {info['numba']}" +
        (f", torch {info['torch']}" if "torch" in info else ""))
    return info
