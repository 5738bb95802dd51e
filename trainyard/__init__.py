"""Trainyard's public Python library: the contracts both the control plane and the data plane
import (pydantic and the standard library only; no Django, no torch), and the SDK for training
scripts (`trainyard.sdk`, the only part that imports torch, and only when used). docs/architecture.md
draws the layers; each module's docstring says what it holds.

- `trainyard.init()`: the SDK's entry point (`trainyard.sdk.init`; imports torch on call).
- `trainyard.spec`: the JobSpec, its defaults and every cross-field rule.
- `trainyard.mesh`: rank coordinates, the pipeline stage split, what each mesh dimension means,
  parameter and FLOP counts of the built-in models.
- `trainyard.keys`: every Redis key, stream and queue name, and the on-disk layouts.
- `trainyard.launch`: the typed messages that cross the Celery bus, the task names, the shared
  Celery settings.
- `trainyard.sdk`: `Run` and `init` for training scripts (telemetry, checkpoints, preemption).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from trainyard.sdk.run import Run


def init(config_path: str | Path | None = None) -> Run:
    """This rank's `trainyard.sdk.Run`: see `trainyard.sdk.run.init` (imports torch on call)."""
    from trainyard.sdk import init as _init

    return _init(config_path)
