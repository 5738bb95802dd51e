"""A plain PyTorch DDP script made Trainyard-aware by the SDK lines (marked `# trainyard`).

Its own small model (an MLP regressor) and its own data (generated from the step number, so a
resumed run sees exactly the batches it would have seen): nothing to download. Under Trainyard
(`trainyard submit examples/sdk_ddp/job.yaml --code examples/sdk_ddp --watch`) it gets live
per-rank telemetry, checkpoints, exact resume after a failure, cooperative preemption and
rollback. On a laptop, `python train.py` (or torchrun) runs it standalone: rank 0 of 1, no
telemetry, checkpoints under ./checkpoints.

Settings come from the JobSpec's `config` (run.config); the defaults below fill what is missing.
The number of steps is the JobSpec's `train.steps` (run.steps; standalone: DEFAULTS["steps"]).
"""
from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainyard  # trainyard

DEFAULTS = {"steps": 200, "batch": 32, "dim": 32, "hidden": 128, "lr": 3e-3, "seed": 0, "step_sleep_s": 0.0}


def make_batch(step: int, rank: int, size: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch per (step, rank): y is a fixed nonlinear function of x plus noise."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, dim, generator=g)
    w = torch.linspace(-1.0, 1.0, dim)
    y = torch.sin(x @ w / dim ** 0.5).unsqueeze(1) + 0.01 * torch.randn(size, 1, generator=g)
    return x.to(device), y.to(device)


def main() -> None:
    run = trainyard.init()  # trainyard: torch.distributed, the job's config, device and ids
    cfg = {**DEFAULTS, **run.config}
    steps = run.steps or int(cfg["steps"])  # train.steps: also the job page's progress denominator
    torch.manual_seed(int(cfg["seed"]))
    net = nn.Sequential(nn.Linear(cfg["dim"], cfg["hidden"]), nn.GELU(),
                        nn.Linear(cfg["hidden"], cfg["hidden"]), nn.GELU(),
                        nn.Linear(cfg["hidden"], 1)).to(run.device)
    model = DDP(net, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg["lr"]))
    loss_fn = nn.MSELoss()

    start = run.restore({"model": net, "optim": opt})  # trainyard: the last completed step, 0 if none
    print(f"sdk_ddp: rank {run.rank}/{run.world_size} on {run.device}, steps {start + 1}..{steps}",
          flush=True)
    for step in range(start + 1, steps + 1):
        with run.phase("data"):  # trainyard: optional timing phases
            x, y = make_batch(step, run.rank, int(cfg["batch"]), int(cfg["dim"]), run.device)
        with run.phase("compute"):
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP's all-reduce overlaps the backward pass
        with run.phase("optim"):
            opt.step()
        if cfg["step_sleep_s"]:
            time.sleep(float(cfg["step_sleep_s"]))  # a heavier model's step time, for demos and tests
        run.log(step, loss=loss.item(), samples=len(x), lr=opt.param_groups[0]["lr"])  # trainyard
        if step % 20 == 0:
            print(f"sdk_ddp: step {step} rank {run.rank} loss {loss.item():.4f}", flush=True)
        if run.should_checkpoint(step):  # trainyard: every_steps, the last step, preemption
            run.checkpoint(step, {"model": net, "optim": opt})
        if run.should_stop():  # trainyard: preemption or drain asked for a stop
            break
    run.finish()  # trainyard
    print(f"sdk_ddp: rank {run.rank} finished", flush=True)


if __name__ == "__main__":
    main()
