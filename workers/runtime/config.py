"""The built-in trainer's view of the launch config `<run_dir>/config.json` (written by the agent
for one attempt; read and validated by `trainyard.sdk.config`, which declares the launch-only
fields: job and attempt ids, node, run directory, Redis URL and stream, data and checkpoint
roots, the checkpoint to resume from). `spec` is the JobSpec the control plane accepted and
stored, every default filled in, validated with the same model (`trainyard.spec.validate_job_spec`:
types, bounds and the rules every JobSpec satisfies; keys it does not know are ignored, as a newer
control plane may send them); the trainer reads its sections and never re-declares a JobSpec
field, default or rule. The combinations refused at submit (trainyard.spec RULES, "submit") are not checked
again here. A built-in GPT's `parallel: "auto"` never reaches the runtime: the control plane
resolves it at submit (jobs/planning/autoplan.py) and stores the chosen plan; an MLP's or a
script's `auto` is stored as given and reads as the default plan, data parallel over every
process (dp None).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.sdk.config import ConfigError, LaunchConfig, ResumeConfig, load_launch_config, parse_launch_config
from trainyard.spec import CheckpointSpec, DataSpec, JobSpec, ModelSpec, ResourcesSpec, TrainSpec
from trainyard.spec_parallel import CommSpec, ParallelSpec

__all__ = ["ConfigError", "ResumeConfig", "RunConfig", "load_run_config", "parse_run_config"]


@dataclass(frozen=True)
class RunConfig:
    """One attempt's launch config: the launch-only fields (`launch`, as trainyard.sdk parsed
    them, which the SDK's Run is built from) and the validated JobSpec's sections."""

    launch: LaunchConfig  # the launch-only fields (ids, node, run dir, Redis, roots, resume)
    spec: JobSpec         # validated once, by run_config; the sections below read it

    @property
    def model(self) -> ModelSpec:
        return self.spec.model

    @property
    def data(self) -> DataSpec:
        return self.spec.data

    @property
    def train(self) -> TrainSpec:
        return self.spec.train

    @property
    def resources(self) -> ResourcesSpec:
        return self.spec.resources

    @property
    def parallel(self) -> ParallelSpec:
        """`parallel: "auto"` reads as ParallelSpec() (dp None: data parallel over the world)."""
        return self.spec.plan

    @property
    def comm(self) -> CommSpec:
        return self.spec.comm

    @property
    def checkpoint(self) -> CheckpointSpec:
        return self.spec.checkpoint

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
    return RunConfig(launch=launch, spec=spec)


def load_run_config(path: str | Path) -> RunConfig:
    """The launch config at `path` (JSON), parsed by `parse_run_config`."""
    return run_config(load_launch_config(path))
