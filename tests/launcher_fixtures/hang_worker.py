"""A rank that hangs in a collective, for the stack-dump and collective-timeout tests.

Config (config.json): {"sleep_rank": 1, "collective_timeout_s": 3}. Every rank registers the
SDK's stack dump and initialises torch.distributed through the SDK (with the launch config's
collective timeout, applied at once as after a first step); then all ranks but `sleep_rank`
all-reduce on a group made by the SDK's new_group while `sleep_rank` sleeps in
`sleeping_rank_frame` and never joins.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from tests.launcher_fixtures.fake_worker import write_rank_file
from trainyard.sdk.groups import apply_collective_timeout, new_group
from trainyard.sdk.run import DistEnv, init_process_group
from trainyard.sdk.stacks import install_stack_dump


def sleeping_rank_frame(seconds: float) -> None:
    time.sleep(seconds)


@record
def main() -> None:
    install_stack_dump()
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    env = DistEnv.from_environ()
    init_process_group(env, torch.device("cpu"), cfg.get("collective_timeout_s"))
    group = new_group(backend="gloo")
    apply_collective_timeout()  # as Run.log does after the first step
    write_rank_file(os.path.dirname(os.path.abspath(args.config)), env.rank, env.local_rank)
    if env.rank == cfg.get("sleep_rank", 1):
        print(f"rank {env.rank} sleeping", file=sys.stderr, flush=True)
        sleeping_rank_frame(120)
        return
    print(f"rank {env.rank} entering all_reduce", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        torch.distributed.all_reduce(torch.ones(1), group=group)
    finally:
        print(f"rank {env.rank} all_reduce returned after {time.monotonic() - started:.1f} s",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
