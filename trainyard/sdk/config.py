"""The launch config: `<run_dir>/config.json`, written by the node agent for one attempt and read
by every rank (torch-free: pydantic and the standard library).

Every rank finds it through `TRAINYARD_RUN_CONFIG` (RUN_CONFIG_ENV; the built-in trainer also
takes it as `--config`). It holds the launch-only fields, declared here in `LaunchConfig` (job and
attempt ids, node, run directory, Redis URL and stream, data and checkpoint directories, the
checkpoint to resume from), and `spec`: the JobSpec the control plane accepted and stored, every
default filled in, kept as the raw mapping here and validated by its reader
(`LaunchConfig.job_spec()`, `trainyard.spec.validate_job_spec` ignoring keys it does not know, as
a newer control plane may send them). Keys of the launch config itself that this version does not
know are ignored for the same reason.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainyard.spec import JobSpec, SpecError, validate_job_spec

RUN_CONFIG_ENV = "TRAINYARD_RUN_CONFIG"


class ConfigError(ValueError):
    """The launch config asks for something the runtime cannot run; the message says what."""


class ResumeConfig(BaseModel):
    """Top-level launch key `resume`: the complete checkpoint this attempt starts from (the
    latest, or the rollback target: the control plane chose it)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    path: Path
    step: int
    checkpoint_id: int | None = None


class LaunchConfig(BaseModel):
    """One attempt's launch config, as the agent writes it (workers/agent.py)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    job_id: int
    attempt_id: int
    node: str
    run_dir: Path
    redis_url: str
    stream: str
    data_root: Path
    checkpoint_dir: Path
    spec: dict[str, Any]
    resume: ResumeConfig | None = None
    # Every process group's timeout (the control plane's, under its hang detector); None: torch's.
    collective_timeout_s: float | None = Field(None, gt=0)
    # The attempt's key for its checkpoint manifests' proof (trainyard.attemptauth); None: none.
    proof_key: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    # parallel auto for a user's own model: the device facts and constants run.prepare plans with.
    planner: dict[str, Any] | None = None
    # A cpu rank's device memory, enforced by the built-in trainer (workers/runtime/memcap.py); None: none.
    memory_limit_gb: float | None = Field(None, gt=0)

    @field_validator("resume", mode="before")
    @classmethod
    def _resume(cls, raw: Any) -> ResumeConfig | None:
        return parse_resume(raw)

    def job_spec(self) -> JobSpec:
        """`spec` validated by the JobSpec model; ConfigError naming the field otherwise."""
        try:
            return validate_job_spec(self.spec, unknown_keys="ignore")
        except SpecError as e:
            raise ConfigError(f"launch config spec: {e}") from None


def resume_inside(path: Path, checkpoint_dir: Path) -> Path:
    """`path`, resolved, when it is a checkpoint directory right inside the job's `checkpoint_dir`
    (symlinks resolved, no `..`); ConfigError otherwise: a rank loads only its own job's files."""
    raw = Path(path)
    resolved, home = raw.resolve(), Path(checkpoint_dir).resolve()
    if ".." in raw.parts or resolved.parent != home or raw.is_symlink():
        raise ConfigError(f"resume.path {raw} is not a checkpoint directory inside {home}")
    return resolved


def parse_resume(raw: Any) -> ResumeConfig | None:
    """The `resume` key: null, or a complete checkpoint's absolute path and step."""
    if raw is None or isinstance(raw, ResumeConfig):
        return raw
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


def parse_launch_config(raw: Any) -> LaunchConfig:
    """The launch config mapping as a LaunchConfig; ConfigError naming the offending key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"the launch config must be a JSON object, got {type(raw).__name__}")
    for key in ("spec", "job_id", "attempt_id", "node", "run_dir", "redis_url", "stream",
                "data_root", "checkpoint_dir"):
        if key not in raw:
            raise ConfigError(f"launch config is missing key {key!r}")
    resume = parse_resume(raw.get("resume"))  # its own messages, before pydantic wraps them
    try:
        cfg = LaunchConfig.model_validate({**raw, "resume": resume})
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"launch config {where}: {err['msg']}") from None
    if cfg.resume is not None:
        resume_inside(cfg.resume.path, cfg.checkpoint_dir)
    return cfg


def load_launch_config(path: str | Path | None = None) -> LaunchConfig:
    """The launch config at `path` (default: $TRAINYARD_RUN_CONFIG), parsed."""
    path = path or os.environ.get(RUN_CONFIG_ENV)
    if not path:
        raise ConfigError(f"no launch config: {RUN_CONFIG_ENV} is not set")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read the launch config {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"the launch config {path} is not JSON: {e}") from None
    return parse_launch_config(raw)
