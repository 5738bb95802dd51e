"""The built-in trainer's view of the launch config `<run_dir>/config.json` (written by the agent
for one attempt; read and validated by `trainyard.sdk.config`, which declares the launch-only
fields: job and attempt ids, node, run directory, Redis URL and stream, data and checkpoint
roots, the checkpoint to resume from). `spec` is the JobSpec the control plane accepted and
stored, every default filled in, validated with the same model (`trainyard.spec.validate_job_spec`:
types, bounds and the rules every JobSpec satisfies; keys it does not know are ignored, as a newer
control plane may send them); the trainer reads its sections and never re-declares a JobSpec
field, default or rule. The combinations refused at submit (trainyard.spec RULES, "submit") are not checked
again here. `parallel: "auto"` reaches the runtime unresolved (jobs/services.py stores it as
given) and reads as the default plan: data parallel over every process (dp None).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.sdk.config import ConfigError, LaunchConfig, ResumeConfig, load_launch_config, parse_launch_config
from trainyard.spec import CheckpointSpec, CommSpec, DataSpec, ModelSpec, ParallelSpec, ResourcesSpec, TrainSpec

__all__ = ["ConfigError", "ResumeConfig", "RunConfig", "load_run_config", "parse_run_config"]


@dataclass(frozen=True)
class RunConfig:
    """One attempt's launch config: the launch-only fields, then the validated JobSpec's sections."""

    job_id: int
    attempt_id: int
    node: str
    run_dir: Path
    redis_url: str
    stream: str
    data_root: Path
    checkpoint_dir: Path
    model: ModelSpec
    data: DataSpec
    train: TrainSpec
    resources: ResourcesSpec
    parallel: ParallelSpec  # "auto" in the spec reads as ParallelSpec() (dp None: the whole world)
    comm: CommSpec
    checkpoint: CheckpointSpec = CheckpointSpec()
    resume: ResumeConfig | None = None
    launch: LaunchConfig | None = None  # what the SDK's Run is built from (trainer.py)

    def per_rank_batch(self, world_size: int) -> int:
        """Samples one rank consumes per optimizer step (all its micro-batches together)."""
        if self.train.global_batch % world_size:
            raise ConfigError(
                f"train.global_batch={self.train.global_batch} is not divisible by the "
                f"world size {world_size}")
        return self.train.global_batch // world_size

    def micro_batch(self, world_size: int) -> int:
        """Samples per forward/backward: global_batch / (world size x train.grad_accum)."""
        per_rank, k = self.per_rank_batch(world_size), self.train.grad_accum
        if per_rank % k:
            raise ConfigError(
                f"train.global_batch={self.train.global_batch} is not divisible by world size x "
                f"train.grad_accum = {world_size} x {k}")
        return per_rank // k


def parse_run_config(raw: dict[str, Any]) -> RunConfig:
    """Parse the launch config dict; raises ConfigError naming the offending field."""
    return run_config(parse_launch_config(raw))


def run_config(launch: LaunchConfig) -> RunConfig:
    """The built-in trainer's view of a parsed launch config: its fields and the JobSpec's sections."""
    spec = launch.job_spec()
    if spec.model is None or spec.data is None:
        raise ConfigError("the built-in trainer needs the spec's model and data (this job has an entrypoint)")
    return RunConfig(
        job_id=launch.job_id, attempt_id=launch.attempt_id, node=launch.node, run_dir=launch.run_dir,
        redis_url=launch.redis_url, stream=launch.stream, data_root=launch.data_root,
        checkpoint_dir=launch.checkpoint_dir,
        model=spec.model, data=spec.data, train=spec.train, resources=spec.resources,
        parallel=spec.plan, comm=spec.comm, checkpoint=spec.checkpoint,
        resume=launch.resume, launch=launch,
    )


def load_run_config(path: str | Path) -> RunConfig:
    """The launch config at `path` (JSON), parsed by `parse_run_config`."""
    return run_config(load_launch_config(path))
