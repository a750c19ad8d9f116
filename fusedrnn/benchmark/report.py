"""The benchmark's outputs: markdown tables (the grid's headline first), a JSON file, a
throughput-vs-batch plot and the grid's heat map. A ratio is always the peer's time over
fusedrnn's: above 1, fusedrnn is faster. "x torch" is against torch.nn in the same math:
where the strict peer ran (float32 on CUDA, peers.STRICT) that is cuDNN with TF32 off,
and torch's default (TF32 allowed) is printed beside it."""
from __future__ import annotations

import itertools
import json
import math

from ..config import CELLS
from .peers import STRICT


def _value(case, seconds):
    """The reported figure: microseconds per call, or samples (sequences) per second."""
    return seconds * 1e6 if case.per_call else case.N / seconds


def _cell(case, s):
    lo, hi = sorted((_value(case, s["min"]), _value(case, s["max"])))
    return f"{_value(case, s['median']):.4g} ({lo:.4g}-{hi:.4g})"


def anchor(times):
    """The torch.nn peer a case's ratio is against: the strict one where it ran."""
    return STRICT if STRICT in times else "torch"


def ratio(times, peer=None):
    """peer's (default: the anchor's) median time over fusedrnn's, or None where the peer
    did not run."""
    peer = peer or anchor(times)
    if peer not in times:
        return None
    return times[peer]["median"] / times["fusedrnn"]["median"]


def default_ratio(times):
    """The ratio against torch's default where the anchor is the strict peer, else None."""
    return ratio(times, "torch") if STRICT in times else None


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _ceiling_for(case, run_dtype, ceilings):
    return ceilings.get(case.dtype or run_dtype, {}).get("best")


def _gflops(case, times, peer, ceiling):
    if peer not in times:
        return "n/a", "n/a"
    gflops = case.flops / times[peer]["median"] / 1e9
    if not ceiling:
        return f"{gflops:.3g}", "n/a"
    share = 100 * gflops / ceiling  # whole percents, but a small share keeps two digits
    return f"{gflops:.3g}", f"{share:.0f}%" if share >= 10 else f"{share:.2g}%"


def ceiling_lines(ceilings):
    lines = []
    for dtype, by_lib in ceilings.items():
        others = ", ".join([f"{k} {v:.0f}" for k, v in by_lib.items()
                            if k not in ("best", "by", "unavailable")]
                           + [f"{k} unavailable" for k in by_lib.get("unavailable", ())])
        if by_lib["best"] is None:
            lines.append(f"GEMM ceiling {dtype} (same run): none ({others})")
            continue
        lines.append(f"GEMM ceiling {dtype} (same run): {by_lib['best']:.0f} GFLOP/s "
                     f"({by_lib['by']}; {others})")
    return lines


def grid_headline(results):
    """Markdown: per mode and kind, the grid's cells, geometric mean, worst and best ratio
    against torch.nn (the anchor), and how many cells' ratio is below 0.8; where the strict
    peer ran, the geometric mean and worst against torch's default beside."""
    strict = any(STRICT in t for c, t in results if c.group == "grid")
    extra = " geomean x torch default | worst x default |" if strict else ""
    rows = ["| mode | kind | cells | geomean x torch | worst (case) | best | cells < 0.8x |" +
            extra, "|---|---|---|---|---|---|---|" + "---|" * (2 if strict else 0)]
    everything, defaults = [], []

    def beside(values):
        if not strict:
            return ""
        return f" {geomean(values):.2f} | {min(values):.2f} |" if values else " n/a | n/a |"

    for mode in CELLS:
        for train in (False, True):
            cells = [(c, ratio(t), default_ratio(t)) for c, t in results
                     if c.group == "grid" and c.mode == mode and c.train == train
                     and ratio(t) is not None]
            if not cells:
                continue
            values = [r for _, r, _ in cells]
            default = [d for _, _, d in cells if d is not None]
            everything += values
            defaults += default
            worst = min(cells, key=lambda cr: cr[1])
            rows.append(f"| {mode} | {'train' if train else 'infer'} | {len(cells)} | "
                        f"{geomean(values):.2f} | {worst[1]:.2f} (T={worst[0].T} "
                        f"N={worst[0].N} H={worst[0].H}) | {max(values):.2f} | "
                        f"{sum(v < 0.8 for v in values)} |" + beside(default))
    if not everything:
        return None
    rows.append(f"| all | both | {len(everything)} | {geomean(everything):.2f} | "
                f"{min(everything):.2f} | {max(everything):.2f} | "
                f"{sum(v < 0.8 for v in everything)} |" + beside(defaults))
    return "\n".join(rows)


def grid_cells(results):
    """Markdown: every grid cell's ratio against torch.nn, a row per (kind, mode, T, N),
    a column per H."""
    grid = [(c, t) for c, t in results if c.group == "grid"]
    if not grid:
        return None
    Hs = sorted({c.H for c, _ in grid})
    by_key = {(c.train, c.mode, c.T, c.N, c.H): ratio(t) for c, t in grid}
    rows = ["| kind | mode | T | N | " + " | ".join(f"H={h}" for h in Hs) + " |",
            "|---|---|---|---|" + "---|" * len(Hs)]
    for train, mode, T, N in sorted({k[:4] for k in by_key},
                                    key=lambda k: (k[0], list(CELLS).index(k[1]), k[2], k[3])):
        values = [by_key.get((train, mode, T, N, h)) for h in Hs]
        rows.append(f"| {'train' if train else 'infer'} | {mode} | {T} | {N} | " + " | ".join(
            "n/a" if v is None else f"{v:.2f}" for v in values) + " |")
    return "\n".join(rows)


def table(results, ceilings, run_dtype, peers):
    """Markdown for the per-case groups: each peer's figure as median (min-max),
    fusedrnn's speed-up over each peer, and fusedrnn's and torch's GFLOP/s with their
    share of the ceiling measured in the same run (the case's dtype)."""
    others = [p for p in peers if p != "fusedrnn"]
    head = (["case", "unit"] + list(peers) + [f"x vs {p}" for p in others]
            + ["GFLOP/s", "% of ceiling", "torch GFLOP/s", "torch %"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, times in results:
        if case.group in ("grid", "cold", "train-step"):
            continue
        row = [case.name, "us/call" if case.per_call else "samples/s"]
        row += [_cell(case, times[p]) if p in times else "n/a" for p in peers]
        row += [f"{ratio(times, p):.3g}" if p in times else "n/a" for p in others]
        ceiling = _ceiling_for(case, run_dtype, ceilings)
        row += [*_gflops(case, times, "fusedrnn", ceiling), *_gflops(case, times, "torch",
                                                                        ceiling)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) if len(lines) > 2 else None


def train_step_table(results):
    """Markdown: ms per training step, fusedrnn.torch against torch.nn, and the neighbour
    (a torch Linear + loss run after each step) in each peer's process."""
    steps = [(c, t) for c, t in results if c.group == "train-step"]
    if not steps:
        return None
    lines = ["| model | fusedrnn.torch ms/step | torch.nn ms/step | x vs torch | "
             "neighbour ms beside fusedrnn | beside torch.nn | neighbour slowdown |",
             "|---|---|---|---|---|---|---|"]
    for case, t in steps:
        ms = {k: f"{1e3 * v['median']:.3g} ({1e3 * v['min']:.3g}-{1e3 * v['max']:.3g})"
              for k, v in t.items()}
        slow = (t["fusedrnn neighbour"]["median"] / t["torch neighbour"]["median"]
                if "torch neighbour" in t else None)
        lines.append(f"| {case.name} | {ms['fusedrnn']} | {ms.get('torch', 'n/a')} | "
                     f"{_fmt(ratio(t))} | {ms['fusedrnn neighbour']} | "
                     f"{ms.get('torch neighbour', 'n/a')} | {_fmt(slow)} |")
    return "\n".join(lines)


def cold_table(results):
    cold = [(c, t) for c, t in results if c.group == "cold"]
    if not cold:
        return None
    lines = ["| first use (fresh process) | peer | total s | import s | first inference s | "
             "first training step s |", "|---|---|---|---|---|---|"]
    for case, t in cold:
        for peer in ("fusedrnn", "torch"):
            if peer not in t:
                continue
            parts = [t[peer]] + [t[f"{peer} {p}"] for p in ("import", "infer", "train")]
            lines.append(f"| {case.name} | {peer} | " + " | ".join(
                f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})" for s in parts) + " |")
    return "\n".join(lines)


def _fmt(value):
    return "n/a" if value is None else f"{value:.2f}"


def write_json(path, meta, results):
    """Every case with its times, its ratio against torch.nn and, for op calls, each
    peer's GFLOP/s and share of the ceiling of the case's dtype (the grid's cells too)."""
    def rates(c, t):
        if c.group in ("cold", "train-step"):  # a step's time is more than the RNN's GEMMs
            return {}
        ceiling = _ceiling_for(c, meta["dtype"], meta.get("ceilings", {}))
        gflops = {p: c.flops / s["median"] / 1e9 for p, s in t.items()}
        return dict(gflops=gflops, percent_of_ceiling={
            p: 100 * g / ceiling for p, g in gflops.items()} if ceiling else None)

    doc = dict(meta, cases=[
        dict(group=c.group, name=c.name, mode=c.mode, T=c.T, N=c.N, I=c.I, H=c.H, L=c.L,
             bidirectional=c.bidirectional, train=c.train, flops=c.flops, dtype=c.dtype,
             model=c.model, cache=c.cache, ratio_vs_torch=ratio(t) if "fusedrnn" in t else None,
             anchor=anchor(t), ratio_vs_torch_default=(default_ratio(t) if "fusedrnn" in t
                                                      else None),
             unit="us/call" if c.per_call else "samples/s", seconds=t, **rates(c, t))
        for c, t in results])
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def plot_batch(path, results, title, peers):
    """Throughput vs batch size, one line per peer; returns a note when it cannot."""
    batch = [(c, t) for c, t in results if c.group == "batch"]
    if not batch:
        return None
    plt = _pyplot()
    if plt is None:
        return "matplotlib not installed: no plot (pip install fusedrnn[bench])"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for peer in peers:
        points = [(c.N, c.N / t[peer]["median"]) for c, t in batch if peer in t]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=peer)
    first = batch[0][0]
    ax.set(xscale="log", yscale="log", xlabel="batch size N", ylabel="samples / s",
           title=f"{title}\n{first.mode} T={first.T} I={first.I} H={first.H} inference")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def plot_grid(path, results, title):
    """The grid's heat map: a panel per mode (columns) and per kind and T (rows), N down,
    H across, each cell the ratio against torch.nn on a log colour scale centred on 1."""
    grid = [(c, ratio(t)) for c, t in results if c.group == "grid" and ratio(t) is not None]
    if not grid:
        return None
    plt = _pyplot()
    if plt is None:
        return "matplotlib not installed: no heat map (pip install fusedrnn[bench])"
    from matplotlib.colors import LogNorm
    modes = [m for m in CELLS if any(c.mode == m for c, _ in grid)]
    rows = sorted({(c.train, c.T) for c, _ in grid})
    Ns, Hs = sorted({c.N for c, _ in grid}), sorted({c.H for c, _ in grid})
    value = {(c.mode, c.train, c.T, c.N, c.H): r for c, r in grid}
    fig, axes = plt.subplots(len(rows), len(modes), squeeze=False, layout="constrained",
                             figsize=(2.9 * len(modes), 2.3 * len(rows) + 0.8))
    norm = LogNorm(vmin=0.25, vmax=4)
    image = None
    for (i, (train, T)), (j, mode) in itertools.product(enumerate(rows), enumerate(modes)):
        ax = axes[i][j]
        data = [[value.get((mode, train, T, n, h), math.nan) for h in Hs] for n in Ns]
        image = ax.imshow(data, cmap="RdYlGn", norm=norm, aspect="auto")
        for (a, _n), (b, _h) in itertools.product(enumerate(Ns), enumerate(Hs)):
            v = data[a][b]
            if not math.isnan(v):
                ax.text(b, a, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(Hs)), [str(h) for h in Hs], fontsize=7)
        ax.set_yticks(range(len(Ns)), [str(n) for n in Ns], fontsize=7)
        ax.set_title(f"{mode} {'train' if train else 'infer'} T={T}", fontsize=8)
        if j == 0:
            ax.set_ylabel("N", fontsize=8)
        if i == len(rows) - 1:
            ax.set_xlabel("H (= I)", fontsize=8)
    fig.suptitle(f"{title}\nfusedrnn speed-up over torch.nn (torch time / fusedrnn time)",
                 fontsize=10)
    bar = fig.colorbar(image, ax=axes, shrink=0.6, label="x vs torch (log scale)")
    ticks = [0.25, 0.5, 0.8, 1, 1.2, 2, 4]
    bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    bar.minorticks_off()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"heat map: {path}"
