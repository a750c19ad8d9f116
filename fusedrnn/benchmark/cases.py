"""What the benchmark measures: one Case per configuration, grouped as the CLI's --cases.

Groups (full / --quick sizes):
  design-doc  the MXNet RNN design-doc table: T=300 N=20 I=H=800, each mode, inference and
              training, 1 layer unidirectional and 5 layers bidirectional (quick: T=50,
              I=H=256, 2 layers bidirectional), in samples (sequences) per second
  batch       LSTM inference, N = 1, 2, 4, ..., 1024 at T=50 I=H=512 (quick: N=1,16,128 at
              T=20 I=H=128): the throughput-vs-batch plot
  hidden      LSTM inference, H = 256, 512, 1024, 2048 at T=50 N=64 (quick: H=128,256 at T=20)
  float64     the design-doc single-layer case of each mode in float64, inference and
              training (quick: T=20, I=H=128), whatever --dtype says
  seq2seq     the decoder step T=1 N=64 I=H=512 (GRU and LSTM, microseconds per call, over
              16 calls back to back, as a decoder makes them) and the encoder T=50 N=64
              I=256 H=512 2-layer GRU (quick: T=20)
  cold        the first call in a fresh process (imports, kernel load, allocation), seconds
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import CELLS

GROUPS = ("design-doc", "float64", "batch", "hidden", "seq2seq", "cold")


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
    # Calls per timed sample, back to back, the time divided by it: a decoder steps one
    # token after another, so its case times a run of calls, not one call after a pause.
    burst: int = 1
    dtype: str | None = None  # None: the run's --dtype

    @property
    def D(self):
        return 2 if self.bidirectional else 1

    @property
    def name(self):
        shape = f"T={self.T} N={self.N} I={self.I} H={self.H}"
        layers = f" L={self.L}{' bi' if self.bidirectional else ''}" if (
            self.L > 1 or self.bidirectional) else ""
        precision = f" {self.dtype}" if self.dtype else ""
        return f"{self.mode} {shape}{layers}{precision} {'train' if self.train else 'infer'}"

    @property
    def flops(self):
        """GEMM FLOPs of one call: 2*T*N*G*H*(In + H) per layer and direction; training
        adds backward's two products of the same size (data and weight gradients)."""
        G = CELLS[self.mode].gates
        total = 0
        for layer in range(self.L):
            n_in = self.I if layer == 0 else self.D * self.H
            total += self.D * 2 * self.T * self.N * G * self.H * (n_in + self.H)
        return total * (3 if self.train else 1)


def cases(groups, quick=False):
    """The cases of the chosen groups, in the order they are run."""
    out = []
    for group in groups:
        out += _GROUP[group](quick)
    return out


def _design_doc(quick):
    T, I, H, deep = (50, 256, 256, 2) if quick else (300, 800, 800, 5)
    out = []
    for mode in CELLS:
        for train in (False, True):
            out.append(Case("design-doc", mode, T, 20, I, H, train=train))
            out.append(Case("design-doc", mode, T, 20, I, H, L=deep, bidirectional=True,
                            train=train))
    return out


def _float64(quick):
    T, I, H = (20, 128, 128) if quick else (300, 800, 800)
    return [Case("float64", mode, T, 20, I, H, train=train, dtype="float64")
            for mode in CELLS for train in (False, True)]


def _batch(quick):
    sizes, T, H = ((1, 16, 128), 20, 128) if quick else ([2 ** k for k in range(11)], 50, 512)
    return [Case("batch", "lstm", T, n, H, H) for n in sizes]


def _hidden(quick):
    sizes, T = ((128, 256), 20) if quick else ((256, 512, 1024, 2048), 50)
    return [Case("hidden", "lstm", T, 64, h, h) for h in sizes]


def _seq2seq(quick):
    return [Case("seq2seq", mode, 1, 64, 512, 512, per_call=True, burst=16)
            for mode in ("gru", "lstm")] + [
        Case("seq2seq", "gru", 20 if quick else 50, 64, 256, 512, L=2)]


def _cold(quick):
    return [Case("cold", "lstm", 50, 20, 256, 256, per_call=True)]


_GROUP = {"design-doc": _design_doc, "float64": _float64, "batch": _batch, "hidden": _hidden,
          "seq2seq": _seq2seq, "cold": _cold}
