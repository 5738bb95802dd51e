"""The distributed half of the harness, run by torchrun on every rank:

    python -m torch.distributed.run --standalone --nproc-per-node N -m workers.calibrate.worker \
        --out FILE [--quick] [--no-collectives]

gloo on CPU, NCCL on CUDA (local rank = device). Rank 0 writes {"collectives": [...], "runs":
[...]} to FILE; progress lines go to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from . import collectives, runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="workers.calibrate.worker")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-collectives", action="store_true")
    args = ap.parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    rank = dist.get_rank()

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)
    try:
        colls = [] if args.no_collectives or dist.get_world_size() < 2 else collectives.sweep(device, args.quick)
        log(f"collectives: {len(colls)} points")
        result = {"collectives": colls, "runs": runs.sweep(device, args.quick, log)}
        if rank == 0:
            tmp = args.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            tmp.replace(args.out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
