"""Data-parallel training of a fusedrnn LSTM sequence classifier with torch.distributed.

    python examples/ddp_train.py                      # 2 processes, gloo, on the CPU
    python examples/ddp_train.py --device cuda        # NCCL, one GPU per process
    python examples/ddp_train.py --check              # also train in one process on the
                                                      # full batch and compare parameters

fusedrnn.torch.LSTM is an ordinary nn.Module with one flat parameter, so DDP (which
averages gradients across processes) needs nothing special: each rank trains on its
share of the batch, and every rank ends with the parameters one process would reach
on the whole batch.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fusedrnn.torch as ft  # noqa: E402


class Classifier(torch.nn.Module):
    def __init__(self, inputs=3, hidden=16, classes=2):
        super().__init__()
        self.rnn = ft.LSTM(inputs, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(2 * hidden, classes)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def make_data(batch, steps=12, inputs=3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, steps, inputs, generator=g, dtype=torch.float64)
    return x, (x[:, :, 0].sum(dim=1) > 0).long()


def train(model, x, y, steps, lr=0.3):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def worker(rank, args, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=args.world_size)
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    torch.manual_seed(0)
    model = Classifier().double().to(device)
    ddp = DistributedDataParallel(model, device_ids=[rank] if args.device == "cuda" else None)
    x, y = make_data(args.batch)
    local = slice(rank * args.batch // args.world_size, (rank + 1) * args.batch // args.world_size)
    losses = train(ddp, x[local].to(device), y[local].to(device), args.steps)
    torch.save({k: v.cpu() for k, v in model.state_dict().items()},
               os.path.join(out_dir, f"rank{rank}.pt"))
    if rank == 0:
        print(f"rank 0 local loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(args, port, out_dir), nprocs=args.world_size, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(args.world_size)]
    if not args.check:
        return 0
    torch.manual_seed(0)
    single = Classifier().double()
    x, y = make_data(args.batch)
    train(single, x, y, args.steps)
    worst_rank = max((ranks[0][k] - r[k]).abs().max().item() for r in ranks[1:] for k in r)
    worst_single = max((ranks[0][k] - v).abs().max().item() for k, v in single.state_dict().items())
    print(f"max |rank0 - other ranks| = {worst_rank:.1e}; "
          f"max |DDP - one process on the full batch| = {worst_single:.1e}")
    return 0 if worst_rank == 0 and worst_single <= 1e-10 else 1


if __name__ == "__main__":
    sys.exit(main())
