"""A user script that knows nothing of Trainyard (no SDK, no @record, no ranks file): what the
launcher must still label, supervise and diagnose. `--fail-rank R` raises ValueError on global rank R."""
import argparse
import os
import time

import torch
import torch.distributed as dist

import helper

ap = argparse.ArgumentParser()
ap.add_argument("--fail-rank", type=int, default=-1)
ap.add_argument("--steps", type=int, default=3)
args = ap.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"user rank {rank} pid={os.getpid()} cwd={os.getcwd()} config={os.environ.get('TRAINYARD_RUN_CONFIG')} "
      f"{helper.GREETING} extra={os.environ.get('USER_EXTRA')}", flush=True)
for step in range(args.steps):
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.05)
    if rank == args.fail_rank and step == 1:
        raise ValueError(f"user code refused step {step}")
print(f"user rank {rank} done sum={int(t.item())}", flush=True)
dist.destroy_process_group()
