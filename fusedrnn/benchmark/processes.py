"""What the side-by-side scripts (half.py, compiled.py) share: timing a call as blocks of
back-to-back calls, and running each variant in its own process, alternating."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

from .runner import _child_env


def seconds_per_call(call, warmup=2, blocks=5, per_block=3, sync=None):
    """Median over `blocks` blocks of `per_block` back-to-back calls, after `warmup`.
    sync (a device's synchronize) runs before each block's clock starts and before it
    stops, so a block counts its calls' device work."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        call()
    times = []
    for _ in range(blocks):
        sync()
        start = time.perf_counter()
        for _ in range(per_block):
            call()
        sync()
        times.append((time.perf_counter() - start) / per_block)
    return float(np.median(times))


def alternate(module, variants, rounds, *args):
    """{variant: [seconds, one per round]}: `python -m module --one *args variant` in a
    fresh process for each variant in turn, `rounds` times over (its last word printed is
    the seconds)."""
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            out = subprocess.run([sys.executable, "-m", module, "--one", *args, v], check=True,
                                 capture_output=True, text=True, env=_child_env()).stdout
            times[v].append(float(out.split()[-1]))
    return times
