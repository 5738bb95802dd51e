"""A plain PyTorch DDP script that knows nothing of Trainyard: torchrun's environment, gloo (or
NCCL on GPUs), a small MLP on generated data, one line of output per step.

Trainyard runs it as it is (`python -m torch.distributed.run ... train.py --steps 40`): its output
becomes the job's logs, a traceback or exit code the attempt's diagnosis, and a failure a restart
from scratch; there is no live telemetry (the job page says so) and no checkpoint to resume from.

Runs on a laptop too: `python -m torch.distributed.run --nproc-per-node 2 train.py --steps 20`.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def batch(step: int, rank: int, size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch per (step, rank): y is a fixed linear function of x plus noise."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, dim, generator=g)
    w = torch.linspace(-1.0, 1.0, dim)
    y = (x @ w).unsqueeze(1) + 0.01 * torch.randn(size, 1, generator=g)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step, to make a demo watchable")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    print(f"plain: rank {rank}/{world} on {device}, {args.steps} steps", flush=True)
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in batch(step, rank, args.batch, args.dim))
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"plain: step {step} rank {rank} loss {loss.item():.4f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    print(f"plain: rank {rank} done", flush=True)
    # Drop DDP before the group: a DDP that outlives destroy_process_group destroys a gloo group
    # in its own teardown while holding the GIL, which can hang the exit (pytorch#56297).
    del ddp, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
