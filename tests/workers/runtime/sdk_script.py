"""A small DDP training script made Trainyard-aware with the SDK, for tests/workers/runtime/test_sdk.py
(run under torchrun with TRAINYARD_RUN_CONFIG, or standalone). Deterministic: the initial weights
come from seed 0 and the batch of (step, rank) from its own generator, so a resumed run
reproduces an uninterrupted one's losses exactly. run.config: sleep_s (a pause per step).

Prints one line per step: `sdk rank <r> step <s> loss <repr(float)>`.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainyard
from trainyard.sdk.procexit import main_then_exit


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(1, keepdim=True)


def main() -> None:
    run = trainyard.init()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sleep_s = float(run.config.get("sleep_s", 0.0))
    start = run.restore({"model": model, "optim": opt})
    for step in range(start + 1, run.steps + 1):
        with run.phase("data"):
            x, y = batch(step, run.rank)
        with run.phase("compute"):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        with run.phase("optim"):
            opt.step()
            opt.zero_grad()
        time.sleep(sleep_s)
        run.log(step, loss=loss.item(), samples=len(x), lr=0.01)
        sys.stdout.write(f"sdk rank {run.rank} step {step} loss {loss.item()!r}\n")  # one write:
        sys.stdout.flush()  # ranks sharing the pipe do not interleave mid-line
        if run.should_checkpoint(step):
            run.checkpoint(step, {"model": model, "optim": opt})
        if run.should_stop():
            break
    run.finish()


if __name__ == "__main__":
    main_then_exit(main)  # not through finalization: torch's gloo workers can abort it (trainyard/sdk/procexit.py)
