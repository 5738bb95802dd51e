"""Entry point under torchrun: `python -m torch.distributed.run ... -m workers.runtime --config C`.

`@record` writes an uncaught exception to this rank's TORCHELASTIC_ERROR_FILE (the launcher
reads those to find the first failing rank) and re-raises, so the process exits non-zero. A run that
ends (finished, or preempted with 83) exits without interpreter finalization, where torch's gloo
worker threads could abort a rank that did all its work (trainyard/sdk/procexit.py).
"""
from __future__ import annotations

import argparse
import logging
import os

from torch.distributed.elastic.multiprocessing.errors import record

from trainyard.sdk.procexit import main_then_exit
from trainyard.sdk.stacks import install_stack_dump

from .config import load_run_config
from .trainer import run


@record
def main(argv: list[str] | None = None) -> None:
    install_stack_dump()  # SIGUSR1 (the agent, before it stops a hung attempt): every thread's stack
    parser = argparse.ArgumentParser(prog="python -m workers.runtime")
    parser.add_argument("--config", required=True, help="<run_dir>/config.json written by the agent")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank {os.environ.get('RANK', '?')} %(name)s: %(message)s")
    run(load_run_config(args.config))


if __name__ == "__main__":
    main_then_exit(main)
