"""The Trainyard SDK: give any PyTorch training script live telemetry, checkpoints, exact resume,
cooperative preemption and rollback on Trainyard. Dependencies: torch and redis (the Redis
client); numpy only if installed (its RNG state is checkpointed then). No Django.

    import trainyard
    run = trainyard.init()
    start = run.restore({"model": model, "optim": opt})
    for step in range(start + 1, steps + 1):
        with run.phase("compute"):
            ...
        run.log(step, loss=loss.item(), samples=len(x))
        if run.should_checkpoint(step):
            run.checkpoint(step, {"model": model, "optim": opt})
        if run.should_stop():
            break
    run.finish()

Public names:
- `init()`: this rank's `Run` (run.py), from $TRAINYARD_RUN_CONFIG or standalone.
- `Run`: rank, local_rank, world_size, device, config, job_id, attempt_id, steps, grad_accum;
  prepare, loader, micro_batches, init_device, restore, phase, log, should_checkpoint,
  checkpoint, should_stop, finish.
- `Preempted`, `PREEMPTED_EXIT_CODE`: what `Run.finish` raises (SystemExit 83) after an agreed stop.
- `PHASES`, `STANDARD_FIELDS`: the phase names and the sample fields with columns of their own.
- `ConfigError`, `RUN_CONFIG_ENV`: a bad launch config; the variable that names it.

Modules: config (the launch config, torch-free), reporter (telemetry to the job's Redis Stream),
preempt (the preemption contract), stopvote (the ranks' agreement on the stop step), layout
(checkpoint directories and manifests, torch-free), checkpoint (async DCP saves and loads), run
(Run and init), groups (the run's process groups and their collective timeout; torch inside its
functions), stacks (every thread's stack on SIGUSR1, torch-free). The data plane, shared with the
built-in trainer (workers/runtime): prepare (`run.prepare`, `run.micro_batches`), loader
(`run.loader`), comm (gradient compression hooks), sync (local and hierarchical SGD), autoratio
(top-k's `ratio: auto`), optim (ZeRO-1). torch is imported when a name of run.py is first used, so the torch-free modules
(config, layout, preempt, reporter, stacks) import without it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import RUN_CONFIG_ENV, ConfigError
from .preempt import PREEMPTED_EXIT_CODE

if TYPE_CHECKING:
    from .run import PHASES, STANDARD_FIELDS, DistEnv, Preempted, Run, init

_RUN_NAMES = {"PHASES", "STANDARD_FIELDS", "DistEnv", "Preempted", "Run", "init"}


def __getattr__(name: str) -> Any:
    if name in _RUN_NAMES:
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module 'trainyard.sdk' has no attribute {name!r}")

__all__ = ["PHASES", "PREEMPTED_EXIT_CODE", "RUN_CONFIG_ENV", "STANDARD_FIELDS", "ConfigError", "DistEnv",
           "Preempted", "Run", "init"]
