"""A stand-in for `workers.runtime` that honours the launcher's contract and nothing more.

Contract mimicked (see workers/launcher.py): write `<run_dir>/ranks/<local_rank>.json`
atomically at start-up, join the gloo group torchrun set up, print to stdout/stderr, and let
`@record` write TORCHELASTIC_ERROR_FILE on an exception. Behaviour comes from config.json:

  {"fail_rank": 1, "fail_mode": "raise" | "sigkill" | "exit", "steps": 3, "step_s": 0.05,
   "hang_rank": 1}   # that rank ignores SIGTERM and sleeps after the barrier: a hung rank

`fail_rank` is the GLOBAL rank (c10d may give node_rank 1 global rank 0).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def write_rank_file(run_dir: str, rank: int, local_rank: int) -> None:
    ranks_dir = os.path.join(run_dir, "ranks")
    os.makedirs(ranks_dir, exist_ok=True)
    tmp = os.path.join(ranks_dir, f".{local_rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "local_rank": local_rank, "pid": os.getpid(),
                   "node": os.environ.get("TRAINYARD_NODE", "")}, f)
    os.replace(tmp, os.path.join(ranks_dir, f"{local_rank}.json"))


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    write_rank_file(os.path.dirname(os.path.abspath(args.config)), rank, local_rank)
    if rank == cfg.get("hang_rank"):  # like a rank stuck in a CUDA kernel: SIGTERM is not enough
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    dist.init_process_group("gloo")
    print(f"hello from rank {rank} pid={os.getpid()} omp={os.environ.get('OMP_NUM_THREADS')} "
          f"node={os.environ.get('TRAINYARD_NODE')} extra={os.environ.get('FAKE_EXTRA', '')}",
          flush=True)
    print(f"stderr line from rank {rank}", file=sys.stderr, flush=True)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"rank {rank} allreduce {t.item():g}", flush=True)
    dist.barrier()

    if rank == cfg.get("fail_rank"):
        mode = cfg.get("fail_mode", "raise")
        # Last words, without a newline: only the launcher's final pass (after the exit,
        # before on_exit) can deliver them; the running tail waits for complete lines.
        print(f"rank {rank} about to fail ({mode})", end="", flush=True)
        if mode == "raise":
            raise ValueError("bad shape")
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit":
            os._exit(3)

    if rank == cfg.get("hang_rank"):
        while True:
            time.sleep(1)

    # Every rank runs the same number of steps so the collectives stay matched; a long
    # run is many steps. A survivor of a peer's failure fails here ("connection closed").
    steps = int(cfg.get("steps", 3))
    for _ in range(steps):
        dist.all_reduce(torch.ones(1))
        time.sleep(float(cfg.get("step_s", 0.05)))
    print(f"rank {rank} done after {steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
