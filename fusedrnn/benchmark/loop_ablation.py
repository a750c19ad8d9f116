"""Where the fused CPU loop's time goes: the loop alone, with parts of it removed.

    python -m fusedrnn.benchmark.loop_ablation MODE [--dtype float32] [--shape T,N,I,H]
        [--rounds 9] [--block 3] [--variants base,no_cell,...] [--backward]

Builds variants of fusedrnn/cpu/fused.py's kernels from its source with one part cut
out, compiles each in this process (no disk cache), and times FusedLayer.forward (or
.backward, with --backward) through the op, the variants interleaved round by round.
Loop timing, as in fusedrnn/benchmark/runner.py: each turn makes one untimed warm-in
call (the previous variant's threads wind down on its time), then --block calls back to
back, and reports their mean. Only the loop is timed, not the projection or the GEMMs
around it (from N=8 the bfloat16 layer multiplies W_x x_t inside its loop:
FusedLayer.fuses_input; there the loop's products are both, and no_gemm cuts both). A
variant's results are wrong by design: compare times only. Variants:
    base       the kernel as it is
    no_cell    the cell loop runs zero times (the row moves and the GEMMs stay)
    no_gemm    the recurrent product W_h h is skipped (bfloat16: its products also bring the
               biases, so this cuts their adds too; earlier figures do not compare:
               bench/results/cpu-kernel-notes.md#bf16-products-that-start-from-the-biases)
    gemm_only  the per-sample part (row moves and cell) is skipped
    no_gemm_no_cell   both of the first two (forward only)
With --backward: base, no_cell, no_gemm (the product dh_rec = dg @ W_h skipped) and
gemm_only. --dtype bfloat16 times the vdpbf16ps layer (FusedLayer(bf16=True)) on
bfloat16 data.
Prints the median and minimum milliseconds per call of each, and the median over rounds
of its time over the first variant's in the same round. The variants are compiled
in this process, so they run Numba's first-optimised prange body, where a process that
loads the kernel from the disk cache runs the twice-optimised copy (fused.py's note above
_make_layer_backward): time the op from the cache too (a second process) before a
variant's gain is taken as a user's. This is how the figures
of bench/results/cpu-kernel-notes.md#fused-vectorising-the-cell-loops were measured
(e.g. `python -m fusedrnn.benchmark.loop_ablation gru --shape 50,64,512,512 --variants base,no_cell`).
"""
from __future__ import annotations

import argparse
import statistics
import time
import types

import numpy as np

import fusedrnn
from fusedrnn.cpu import fused

# Source text each cut replaces, per kernel: (pattern, replacement). A pattern that no
# longer occurs raises, so the script cannot quietly time the uncut kernel.
_CELL_FORWARD = ("                            for u in range(lanes):      # the cell, on the tile alone\n"
                 "                                h, c, s0")
_CELL_BACKWARD = ("                            for u in range(lanes):      # the cell, on the tile alone\n"
                  "                                dx0, dx1")
_GEMM = ("                    elif not single_step:\n"
         "                        if pair == 2")
_GEMM_BF16 = "                    if bf16:   # vdpbf16ps's products (FusedLayer.bf16), each starting\n"
_GEMM_BACKWARD = ("                    if step > 0 and bf16:   # the same product from bfloat16 pairs\n",
                  "                    elif step > 0:\n")
_SAMPLES_BACKWARD = ("                        for n in range(N):\n"
                     "                            # Addresses of this sample's rows (all arrays C-contiguous).\n"
                     "                            trow = tile.ctypes.data + n * row * itemsize\n"
                     "                            dh_rec_n")
_SAMPLES = ("                        for n in range(N):\n"
            "                            # Addresses of this sample's rows (all arrays C-contiguous).\n"
            "                            trow = tile.ctypes.data + n * row * itemsize\n"
            "                            h_prev = h_rows")
CUTS = {
    "forward": {
        "base": [],
        "no_cell": [(_CELL_FORWARD, _CELL_FORWARD.replace("range(lanes)", "range(0)"))],
        "no_gemm": [(_GEMM, _GEMM.replace("elif not single_step:", "elif False:")),
                    (_GEMM_BF16, _GEMM_BF16.replace("if bf16:", "if False:"))],
        "gemm_only": [(_SAMPLES, _SAMPLES.replace("range(N)", "range(0)"))],
    },
    "backward": {
        "base": [],
        "no_cell": [(_CELL_BACKWARD, _CELL_BACKWARD.replace("range(lanes)", "range(0)"))],
        "no_gemm": [(_GEMM_BACKWARD[0], _GEMM_BACKWARD[0].replace("step > 0 and bf16", "False")),
                    (_GEMM_BACKWARD[1], _GEMM_BACKWARD[1].replace("step > 0", "False"))],
        "gemm_only": [(_SAMPLES_BACKWARD, _SAMPLES_BACKWARD.replace("range(N)", "range(0)"))],
    },
}
CUTS["forward"]["no_gemm_no_cell"] = CUTS["forward"]["no_gemm"] + CUTS["forward"]["no_cell"]


def variant_source(source, cuts):
    """fused.py's source with the cuts applied and Numba's disk cache off."""
    for pattern, replacement in cuts:
        if source.count(pattern) != 1:
            raise RuntimeError(f"loop_ablation: fused.py no longer has exactly one {pattern!r}")
        source = source.replace(pattern, replacement)
    return source.replace("cache=True", "cache=False")


def variant_layer(name, cuts, mode, dtype, bf16=False):
    """A FusedLayer built from the cut source, as a module of its own."""
    module = types.ModuleType(f"fusedrnn.cpu._ablation_{name}")
    module.__package__, module.__file__ = "fusedrnn.cpu", fused.__file__
    with open(fused.__file__) as f:
        exec(compile(variant_source(f.read(), cuts), f"fused.py ({name})", "exec"),
             module.__dict__)
    # the kernels take their options from threads.py, not from the source: their cache
    # off too, as a variant compiled from a string has no file for the cache to sit beside
    module.KERNEL_OPTIONS = {**module.KERNEL_OPTIONS, "cache": False}
    return module.FusedLayer(mode, dtype, bf16)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=fusedrnn.MODES)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"],
                   help="bfloat16: the data's; the layer is float32's with vdpbf16ps products")
    p.add_argument("--shape", default="300,20,800,800", help="T,N,I,H")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--block", type=int, default=3, help="timed calls per turn, back to back")
    p.add_argument("--variants", default=None, help="comma-separated; default: all")
    p.add_argument("--backward", action="store_true", help="time the backward loop")
    args = p.parse_args()
    direction = "backward" if args.backward else "forward"
    names = args.variants.split(",") if args.variants else list(CUTS[direction])
    bf16 = args.dtype == "bfloat16"
    if bf16:
        import ml_dtypes
        dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        dtype = np.dtype(args.dtype)
    T, N, I, H = (int(v) for v in args.shape.split(","))
    layers = {name: variant_layer(name, CUTS[direction][name], args.mode,
                                  np.float32 if bf16 else dtype, bf16)
              for name in names}

    rng = np.random.default_rng(0)
    layout = fusedrnn.param_layout(mode=args.mode, input_size=I, state_size=H, num_layers=1)
    data = rng.standard_normal((T, N, I)).astype(dtype)
    params = rng.uniform(-H ** -0.5, H ** -0.5, layout.size).astype(dtype)
    dout = rng.standard_normal((T, N, H)).astype(dtype)
    kw = dict(state_size=H, num_layers=1, mode=args.mode)

    # The op calls FusedLayer.<direction>; route it to the variant under test, timed.
    current, spent = {}, [0.0]

    def timed(self, *a, **k):
        start = time.perf_counter()
        getattr(current["layer"], direction)(*a, **k)
        spent[0] += time.perf_counter() - start
    setattr(fused.FusedLayer, direction, timed)

    def call():
        if args.backward:
            fusedrnn.rnn_backward(fusedrnn.RNN(data, params, **kw, train=True)[1], dout)
        else:
            fusedrnn.RNN(data, params, **kw)

    times = {name: [] for name in names}
    for round_ in range(args.rounds + 1):      # round 0: compile and warm up, untimed
        for name, layer in layers.items():
            current["layer"] = layer
            call()  # warm-in, untimed
            spent[0] = 0.0
            for _ in range(args.block):
                call()
            if round_:
                times[name].append(spent[0] * 1e3 / args.block)
    print(f"{args.mode} {dtype} T,N,I,H={args.shape} {direction} loop alone, "
          f"{args.rounds} interleaved rounds:")
    first = times[names[0]]
    for name, t in times.items():
        # Paired: each round's time over the first variant's in the same round, so that the
        # machine's drift between rounds (seconds apart) cancels; the median of those.
        paired = statistics.median(v / f for v, f in zip(t, first, strict=True))
        print(f"  {name:16s} median {statistics.median(t):7.1f} ms   min {min(t):7.1f} ms"
              f"   x {names[0]} {paired:.3f}")


if __name__ == "__main__":
    main()
