"""The runtime's launch config: `<run_dir>/config.json`, written by the agent for one attempt.

It holds the launch-only fields (job and attempt ids, node, run directory, Redis URL and stream,
data and checkpoint roots, the checkpoint to resume from), declared here, and `spec`: the
JobSpec the control plane accepted and stored, every default filled in. The runtime validates
`spec` with the same model (`trainyard.spec.validate_job_spec`: types, bounds and the rules
every JobSpec satisfies; keys it does not know are ignored, as a newer control plane may send
them) and reads its sections; it never re-declares a JobSpec field, default or rule. The combinations refused at submit (trainyard.spec RULES, "submit") are not checked
again here. `parallel: "auto"` reaches the runtime unresolved (jobs/services.py stores it as
given) and reads as the default plan: data parallel over every process (dp None).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.spec import (CheckpointSpec, CommSpec, DataSpec, ModelSpec, ParallelSpec, ResourcesSpec,
                            SpecError, TrainSpec, validate_job_spec)


class ConfigError(ValueError):
    """The launch config asks for something the runtime cannot run; the message says what."""


@dataclass(frozen=True)
class ResumeConfig:
    """Top-level launch key `resume`: the complete checkpoint this attempt starts from."""

    path: Path
    step: int
    checkpoint_id: int | None = None


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


def _resume(raw: Any) -> ResumeConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or "path" not in raw or "step" not in raw:
        raise ConfigError(f"resume must be null or an object with path and step, got {raw!r}")
    try:
        resume = ResumeConfig(path=Path(raw["path"]), step=int(raw["step"]),
                              checkpoint_id=raw.get("checkpoint_id"))
    except (TypeError, ValueError):
        raise ConfigError(f"resume.path must be a string and resume.step an integer, got {raw!r}") from None
    if not resume.path.is_absolute():
        raise ConfigError(f"resume.path must be absolute, got {str(resume.path)!r}")
    if resume.step < 0:
        raise ConfigError(f"resume.step must be >= 0, got {resume.step}")
    return resume


def parse_run_config(raw: dict[str, Any]) -> RunConfig:
    """Parse the launch config dict; raises ConfigError naming the offending field."""
    try:
        spec = validate_job_spec(raw["spec"], unknown_keys="ignore")
        return RunConfig(
            job_id=int(raw["job_id"]),
            attempt_id=int(raw["attempt_id"]),
            node=str(raw["node"]),
            run_dir=Path(raw["run_dir"]),
            redis_url=str(raw["redis_url"]),
            stream=str(raw["stream"]),
            data_root=Path(raw["data_root"]),
            checkpoint_dir=Path(raw["checkpoint_dir"]),
            model=spec.model, data=spec.data, train=spec.train, resources=spec.resources,
            parallel=spec.plan, comm=spec.comm, checkpoint=spec.checkpoint,
            resume=_resume(raw.get("resume")),
        )
    except KeyError as e:
        raise ConfigError(f"launch config is missing key {e.args[0]!r}") from None
    except SpecError as e:
        raise ConfigError(f"launch config spec: {e}") from None


def load_run_config(path: str | Path) -> RunConfig:
    """The launch config at `path` (JSON), parsed by `parse_run_config`."""
    with open(path, encoding="utf-8") as f:
        return parse_run_config(json.load(f))
