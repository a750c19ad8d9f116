"""`python -m fusedrnn bench`: fusedrnn against what a user would pick instead, as ratios,
timed as users run it (blocks of back-to-back calls, each peer in its own process; see
runner.py), with the machine's GEMM ceiling measured in the same run. cases.py says what
runs, report.py what is printed."""
from __future__ import annotations

import os
import platform
import re
import sys
import time

from . import cases as case_lib
from . import report, runner
from .peers import HALF_DTYPES, OP_PEERS, STRICT

# Every figure of this package is of the fused kernels, from a warm-up call on (first use,
# the first tier included, is the cold group's to time: runner.cold_start).
os.environ["FUSEDRNN_FIRST_TIER"] = "0"


def add_arguments(parser):
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--quick", action="store_true",
                        help=f"groups {','.join(case_lib.QUICK_GROUPS)} at small sizes, "
                             "3 repeats: under 3 minutes on 2 cores")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated groups of {', '.join(case_lib.GROUPS)} "
                             f"(default: all; --quick: {','.join(case_lib.QUICK_GROUPS)})")
    parser.add_argument("--filter", default=None,
                        help="run only the cases whose name matches this regular expression")
    parser.add_argument("--peers", default=",".join(OP_PEERS),
                        help=f"comma-separated, of {', '.join(OP_PEERS)}")
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16"),
                        default="float32",
                        help="bfloat16: CPU, op cases only (fusedrnn on ml_dtypes arrays "
                             "against torch.nn in torch.bfloat16; no naive loops)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed blocks per peer and case (default 5, --quick 3)")
    parser.add_argument("--block-ms", type=float, default=1e3 * runner.BLOCK_S,
                        help="a timed block of back-to-back calls lasts at least this long")
    parser.add_argument("--json", default=None, help="default: fusedrnn-bench-DEVICE.json")
    parser.add_argument("--plot", default=None, help="default: fusedrnn-bench-DEVICE-batch.png")
    parser.add_argument("--heatmap", default=None,
                        help="default: fusedrnn-bench-DEVICE-grid.png")


def run(args):
    groups = [g.strip() for g in (args.cases or ",".join(
        case_lib.QUICK_GROUPS if args.quick else case_lib.GROUPS)).split(",") if g.strip()]
    wanted = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(groups) - set(case_lib.GROUPS)) + sorted(set(wanted) - set(OP_PEERS))
    if unknown or "fusedrnn" not in wanted:
        print(f"bench: unknown case groups or peers {unknown}, or fusedrnn missing from "
              f"--peers; groups: {case_lib.GROUPS}, peers: {OP_PEERS}", file=sys.stderr)
        return 2
    if args.dtype in HALF_DTYPES:
        refused = sorted(set(groups) & set(case_lib.FLOAT32_GROUPS))
        if args.device != "cpu" or refused:
            print(f"bench: --dtype {args.dtype} runs on the CPU, op cases only; got "
                  f"--device {args.device}, groups {refused} (their models and scripts "
                  f"are float32)", file=sys.stderr)
            return 2
    repeats = args.repeats or (3 if args.quick else 5)
    missing = runner.torch_available(args.device)
    # torch's strict peer differs from its default on CUDA alone: elsewhere it would time
    # the same math twice (peers.STRICT).
    peers = [p for p in wanted if not (p.startswith("torch") and missing)
             and not (p == STRICT and args.device != "gpu")]
    todo = case_lib.cases(groups, quick=args.quick, device=args.device)
    if args.filter:
        todo = [c for c in todo if re.search(args.filter, c.name)]
    meta = _machine(args, repeats)
    print(meta["description"])
    if missing:
        print(missing)
    pool = runner.Pool(args.device)
    results = []
    try:
        # (the dtypes a case is reported in: the run's, and a case's own)
        dtypes = sorted({args.dtype} | {c.dtype for c in todo if c.dtype})
        meta["ceilings"] = runner.ceilings(pool, "torch" if "torch" in peers else "fusedrnn",
                                           dtypes)
        for line in report.ceiling_lines(meta["ceilings"]):
            print(line)
        wall = meta["wall_s_per_group"] = {}
        for i, case in enumerate(todo, 1):
            _progress(i, len(todo), case)
            start = time.perf_counter()
            case_peers = [p for p in peers if p in case_lib.peers_of(case)]
            if case.group == "cold":
                times = runner.cold_start(case, args.device, case.dtype or args.dtype,
                                          repeats, case_peers)
            else:
                times = runner.run_case(pool, case, case.dtype or args.dtype, case_peers,
                                        repeats, block_s=args.block_ms / 1e3)
            results.append((case, {k: runner.summary(v) for k, v in times.items()}))
            wall[case.group] = wall.get(case.group, 0.0) + time.perf_counter() - start
    finally:
        pool.close()
    print(file=sys.stderr)
    sections = [
        ("Grid: fusedrnn vs torch.nn, per mode (ratio = torch time / fusedrnn time" + (
            "; float32 on CUDA: against cuDNN strict, torch-strict, TF32 off; torch's "
            "default, TF32 allowed, beside)" if STRICT in peers else ")"),
         report.grid_headline(results)),
        ("Training steps through the torch modules (each peer in its own process)",
         report.train_step_table(results)),
        ("Cases", report.table(results, meta["ceilings"], args.dtype, peers)),
        ("First use", report.cold_table(results)),
        ("Grid, every cell (x vs torch)", report.grid_cells(results)),
    ]
    for title, body in sections:
        if body:
            print(f"\n## {title}\n\n{body}")
    json_path = args.json or f"fusedrnn-bench-{args.device}.json"
    report.write_json(json_path, meta, results)
    title = f"fusedrnn bench, {args.device}, {args.dtype}, {meta['cpu']['name']}"
    notes = [f"JSON: {json_path}",
             report.plot_batch(args.plot or f"fusedrnn-bench-{args.device}-batch.png",
                               results, title, peers),
             report.plot_grid(args.heatmap or f"fusedrnn-bench-{args.device}-grid.png",
                              results, title)]
    print("\nWall time per group: " + ", ".join(f"{g} {s / 60:.1f} min" for g, s in wall.items()))
    print("\n".join(n for n in notes if n))
    return 0


def _progress(i, n, case):
    width = 24
    done = width * i // n
    print(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {case.name:60s}", end="",
          file=sys.stderr, flush=True)


_CPUINFO = {"vendor_id": "vendor", "cpu family": "family", "model": "model",
            "model name": "model_name"}


def cpu_info():
    """The CPU by name: vendor, family/model, the kernel's model name and LLVM's host name
    (znver4, znver5, ...), which is what the kernels are compiled for."""
    info = {"vendor": "", "family": "", "model": "", "model_name": platform.processor()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                name = _CPUINFO.get(key)
                if name and (not info[name] or name == "model_name"):
                    info[name] = value.strip()
                if key == "flags":  # the first processor's entry is enough
                    break
    except OSError:
        pass
    try:
        from llvmlite import binding
        info["llvm_host"] = binding.get_host_cpu_name()
    except Exception:  # noqa: BLE001  (a name only)
        info["llvm_host"] = "unknown"
    info["name"] = (f"{info['model_name'] or platform.machine()} ({info['vendor']} family "
                    f"{info['family']} model {info['model']}, LLVM {info['llvm_host']})")
    return info


def _machine(args, repeats):
    import numba
    import numpy as np
    info = {"python": platform.python_version(), "numpy": np.__version__,
            "numba": numba.__version__, "cpu_count": os.cpu_count(), "cpu": cpu_info(),
            "device": args.device, "dtype": args.dtype, "repeats": repeats,
            "quick": args.quick, "block_ms": args.block_ms, "warm_s": runner.WARM_S,
            "grid_axes": dict(zip("TNH", case_lib.grid_axes(args.quick, args.device), strict=True))}
    try:
        import torch
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
        if args.device == "gpu":
            info["gpu"] = torch.cuda.get_device_name()
            # the "torch" peer's cuDNN math as users get it (peers.STRICT)
            info["cudnn_allow_tf32_default"] = torch.backends.cudnn.allow_tf32
    except ImportError:
        pass
    where = info.get("gpu", info["cpu"]["name"])
    info["description"] = (
        f"fusedrnn bench: {args.device} on {where}, {info['cpu_count']} cores; {args.dtype}; "
        f"loop timing: blocks of back-to-back calls lasting >= {args.block_ms:g} ms, each "
        f"peer in its own process, turns interleaved, median of {repeats} blocks (min-max); "
        f"python {info['python']}, numpy {info['numpy']}, numba {info['numba']}" +
        (f", torch {info['torch']} ({info['torch_threads']} threads)" if "torch" in info
         else ""))
    return info
