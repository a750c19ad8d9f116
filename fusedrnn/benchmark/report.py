"""The benchmark's outputs: a markdown table, a JSON file, a throughput-vs-batch plot."""
from __future__ import annotations

import json

from .runner import PEERS


def _value(case, seconds):
    """The reported figure: microseconds per call, or samples (sequences) per second."""
    return seconds * 1e6 if case.per_call else case.N / seconds


def _cell(case, s):
    lo, hi = sorted((_value(case, s["min"]), _value(case, s["max"])))
    return f"{_value(case, s['median']):.4g} ({lo:.4g}-{hi:.4g})"


def table(results, ceiling, peers):
    """Markdown: each peer's figure as median (min-max), fusedrnn's speed-up over each peer
    (peer time / fusedrnn time, > 1 means fusedrnn is faster), and fusedrnn's GFLOP/s with
    its share of the GEMM ceiling measured in the same run."""
    others = [p for p in peers if p != "fusedrnn"]
    head = (["case", "unit"] + list(peers) + [f"x vs {p}" for p in others]
            + ["GFLOP/s", "% of GEMM"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, times in results:
        if case.group == "cold":
            continue
        ours = times["fusedrnn"]["median"]
        row = [case.name, "us/call" if case.per_call else "samples/s"]
        row += [_cell(case, times[p]) if p in times else "n/a" for p in peers]
        row += [f"{times[p]['median'] / ours:.3g}" if p in times else "n/a" for p in others]
        gflops = case.flops / ours / 1e9
        # The ceiling is the run's --dtype sgemm/dgemm: not comparable for a case of its own dtype.
        share = "n/a" if case.dtype else f"{100 * gflops / ceiling:.2g}%"
        row += [f"{gflops:.3g}", share]
        lines.append("| " + " | ".join(row) + " |")
    cold = [(c, t) for c, t in results if c.group == "cold"]
    for case, times in cold:
        f, imp = times["fusedrnn"], times["import"]
        lines += ["", f"Cold start ({case.mode} T={case.T} N={case.N} I={case.I} H={case.H}, "
                      f"fresh process, kernel cache warm): import + first call "
                      f"{f['median']:.2f} s ({f['min']:.2f}-{f['max']:.2f}), of which import "
                      f"{imp['median']:.2f} s"]
    return "\n".join(lines)


def write_json(path, meta, results, ceiling):
    doc = dict(meta, gemm_ceiling_gflops=ceiling, cases=[
        dict(group=c.group, name=c.name, mode=c.mode, T=c.T, N=c.N, I=c.I, H=c.H, L=c.L,
             bidirectional=c.bidirectional, train=c.train, flops=c.flops, dtype=c.dtype,
             unit="us/call" if c.per_call else "samples/s", seconds=t)
        for c, t in results])
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def plot_batch(path, results, title):
    """Throughput vs batch size, one line per peer; returns a note when it cannot."""
    batch = [(c, t) for c, t in results if c.group == "batch"]
    if not batch:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot (pip install fusedrnn[bench])"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for peer in PEERS:
        points = [(c.N, c.N / t[peer]["median"]) for c, t in batch if peer in t]
        if points:
            ax.plot(*zip(*points), marker="o", label=peer)
    first = batch[0][0]
    ax.set(xscale="log", yscale="log", xlabel="batch size N", ylabel="samples / s",
           title=f"{title}\n{first.mode} T={first.T} I={first.I} H={first.H} inference")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
