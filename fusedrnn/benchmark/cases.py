"""What the benchmark measures: one Case per configuration, grouped as the CLI's --cases.

Groups (full / --quick sizes):
  grid        every mode x T x N x H (= I), inference and training (forward + backward),
              float32: the headline is the geometric mean and the worst ratio against
              torch.nn per mode. The full grid is T in {1, 20, 100, 300}, N in {1, 8, 32,
              128, 512}, H in {64, 128, 256, 512, 1024}, on the GPU also N=1024 and H=2048.
              A 2-core CPU cannot run all of it in 20 minutes, so the CPU takes the subset
              GRID_CPU (T in {1, 20, 100}, N in {1, 8, 32, 128}, H in {64, 128, 256, 512}).
              --quick: T in {1, 20}, N in {1, 32}, H in {64, 256}, both devices.
  train-step  a real training step through the torch modules (zero_grad, forward, a linear
              head and its loss, backward, optimizer step) for four models, fusedrnn.torch
              against torch.nn, each peer in its own process; beside each step a torch
              Linear + loss of its own (the neighbour), timed apart, to show what the RNN's
              threads cost the program's other ops. --quick: the tagger only.
  design-doc  the MXNet RNN design-doc table: T=300 N=20 I=H=800, each mode, inference and
              training, 1 layer unidirectional and 5 layers bidirectional (quick: T=50,
              I=H=256, 2 layers bidirectional), in samples (sequences) per second
  batch       LSTM inference, N = 1, 2, 4, ..., 1024 at T=50 I=H=512 (quick: N=1,16,128 at
              T=20 I=H=128): the throughput-vs-batch plot
  hidden      LSTM inference, H = 256, 512, 1024, 2048 at T=50 N=64 (quick: H=128,256 at T=20)
  float64     the design-doc single-layer case of each mode in float64, inference and
              training (quick: T=20, I=H=128), whatever --dtype says
  seq2seq     the decoder step T=1 N=64 I=H=512 (GRU and LSTM, microseconds per call), the
              per-call floor T=1 N=1 I=H=8 (LSTM inference and training) and the encoder
              T=50 N=64 I=256 H=512 2-layer GRU (quick: T=20)
  cold        first use: import, the first inference call and the first training step in
              a fresh process, with an empty kernel cache and with a warm one (quick: warm
              only), seconds

Every timed figure is loop timing: blocks of back-to-back calls, see runner.py.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..config import CELLS

GROUPS = ("grid", "train-step", "design-doc", "float64", "batch", "hidden", "seq2seq", "cold")
# Groups whose models (train-step) and fresh-process scripts (cold) run in float32 whatever
# --dtype says: a half-precision run refuses them rather than mislabel their figures.
FLOAT32_GROUPS = ("train-step", "cold")
QUICK_GROUPS = ("grid", "train-step", "seq2seq", "cold")

# (T, N, H) axes of the size grid.
GRID_FULL = ((1, 20, 100, 300), (1, 8, 32, 128, 512), (64, 128, 256, 512, 1024))
GRID_GPU = ((1, 20, 100, 300), (1, 8, 32, 128, 512, 1024), (64, 128, 256, 512, 1024, 2048))
GRID_CPU = ((1, 20, 100), (1, 8, 32, 128), (64, 128, 256, 512))
GRID_QUICK = ((1, 20), (1, 32), (64, 256))


@dataclass(frozen=True)
class Case:
    group: str
    mode: str
    T: int
    N: int
    I: int
    H: int
    L: int = 1
    bidirectional: bool = False
    train: bool = False
    per_call: bool = False   # report microseconds per call instead of samples per second
    dtype: str | None = None  # None: the run's --dtype
    model: str | None = None  # train-step: the model's name (the step adds a head and loss)
    cache: str | None = None  # cold: "empty" or "warm", the kernel cache the process starts with

    @property
    def D(self):
        return 2 if self.bidirectional else 1

    @property
    def name(self):
        shape = f"T={self.T} N={self.N} I={self.I} H={self.H}"
        layers = f" L={self.L}{' bi' if self.bidirectional else ''}" if (
            self.L > 1 or self.bidirectional) else ""
        precision = f" {self.dtype}" if self.dtype else ""
        if self.model:
            return f"{self.model}: {self.mode} {shape}{layers} step"
        if self.cache:
            return f"first use, {self.cache} cache: {self.mode} {shape} infer, then train"
        return f"{self.mode} {shape}{layers}{precision} {'train' if self.train else 'infer'}"

    @property
    def flops(self):
        """GEMM FLOPs of the RNN in one call: 2*T*N*G*H*(In + H) per layer and direction;
        training adds backward's two products of the same size (data and weight
        gradients)."""
        G = CELLS[self.mode].gates
        total = 0
        for layer in range(self.L):
            n_in = self.I if layer == 0 else self.D * self.H
            total += self.D * 2 * self.T * self.N * G * self.H * (n_in + self.H)
        return total * (3 if self.train else 1)


def cases(groups, quick=False, device="cpu"):
    """The cases of the chosen groups, in the order they are run."""
    out = []
    for group in groups:
        out += _GROUP[group](quick, device)
    return out


def peers_of(case):
    """Who runs a case: everyone, except that the grid's headline is against torch.nn alone
    (both of its cuDNN settings on the GPU; the naive loops would double the grid's time)
    and the train steps and first use are torch.nn's modules as users run them."""
    if case.group == "grid":
        return ("fusedrnn", "torch", "torch-strict")
    if case.group in ("train-step", "cold"):
        return ("fusedrnn", "torch")
    return ("fusedrnn", "torch", "torch-strict", "naive", "naive-hoisted")


def grid_axes(quick, device):
    return GRID_QUICK if quick else GRID_GPU if device == "gpu" else GRID_CPU


def _grid(quick, device):
    Ts, Ns, Hs = grid_axes(quick, device)
    return [Case("grid", mode, T, N, H, H, train=train)
            for mode in CELLS for train in (False, True)
            for T, N, H in itertools.product(Ts, Ns, Hs)]


# The models of the train-step group: (name, mode, B, T, I, H, layers, bidirectional); the
# decoder trains one step (T=1), as a step-by-step decoder's module is called.
TRAIN_MODELS = (("tagger", "lstm", 32, 50, 32, 64, 2, True),
                ("encoder", "gru", 64, 100, 128, 256, 1, False),
                ("acoustic", "lstm", 16, 200, 80, 512, 3, False),
                ("decoder", "gru", 32, 1, 128, 128, 1, False))


def _train_step(quick, device):
    models = TRAIN_MODELS[:1] if quick else TRAIN_MODELS
    return [Case("train-step", mode, T, B, I, H, L=L, bidirectional=bi, train=True, model=name,
                 per_call=True)
            for name, mode, B, T, I, H, L, bi in models]


def _design_doc(quick, device):
    T, I, H, deep = (50, 256, 256, 2) if quick else (300, 800, 800, 5)
    out = []
    for mode in CELLS:
        for train in (False, True):
            out.append(Case("design-doc", mode, T, 20, I, H, train=train))
            out.append(Case("design-doc", mode, T, 20, I, H, L=deep, bidirectional=True,
                            train=train))
    return out


def _float64(quick, device):
    T, I, H = (20, 128, 128) if quick else (300, 800, 800)
    return [Case("float64", mode, T, 20, I, H, train=train, dtype="float64")
            for mode in CELLS for train in (False, True)]


def _batch(quick, device):
    sizes, T, H = ((1, 16, 128), 20, 128) if quick else ([2 ** k for k in range(11)], 50, 512)
    return [Case("batch", "lstm", T, n, H, H) for n in sizes]


def _hidden(quick, device):
    sizes, T = ((128, 256), 20) if quick else ((256, 512, 1024, 2048), 50)
    return [Case("hidden", "lstm", T, 64, h, h) for h in sizes]


def _seq2seq(quick, device):
    return [Case("seq2seq", mode, 1, 64, 512, 512, per_call=True) for mode in ("gru", "lstm")] + [
        Case("seq2seq", "lstm", 1, 1, 8, 8, train=train, per_call=True) for train in (False, True)
    ] + [Case("seq2seq", "gru", 20 if quick else 50, 64, 256, 512, L=2)]


def _cold(quick, device):
    states = ("warm",) if quick else ("empty", "warm")
    return [Case("cold", "lstm", 50, 20, 256, 256, per_call=True, cache=s) for s in states]


_GROUP = {"grid": _grid, "train-step": _train_step, "design-doc": _design_doc,
          "float64": _float64, "batch": _batch, "hidden": _hidden, "seq2seq": _seq2seq,
          "cold": _cold}
