"""Trainyard's public Python library: the contracts both the control plane and the data plane
import (pydantic and the standard library only; no Django, no torch).

- `trainyard.spec`: the JobSpec, its defaults and every cross-field rule.
- `trainyard.mesh`: rank coordinates, the pipeline stage split, what each mesh dimension means,
  parameter and FLOP counts of the built-in models.
"""
