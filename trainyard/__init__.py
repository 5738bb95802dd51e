"""Trainyard's public Python library: the contracts both the control plane and the data plane
import (pydantic and the standard library only; no Django, no torch). docs/architecture.md
draws the layers; each module's docstring says what it holds.

- `trainyard.spec`: the JobSpec, its defaults and every cross-field rule.
- `trainyard.mesh`: rank coordinates, the pipeline stage split, what each mesh dimension means,
  parameter and FLOP counts of the built-in models.
- `trainyard.keys`: every Redis key, stream and queue name, and the on-disk layouts.
- `trainyard.launch`: the typed messages that cross the Celery bus, the task names, the shared
  Celery settings.
"""
