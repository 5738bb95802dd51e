"""What a JobSpec rule is and how a refused spec is reported (the table itself is `spec.RULES`).

Kept apart from trainyard/spec.py so the spec module holds only the fields and the rules; both
names are re-exported there (`from trainyard.spec import SpecError`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal


class SpecError(Exception):
    """A spec that cannot be accepted: `.errors` maps dotted field paths to messages (HTTP 400)."""

    def __init__(self, errors: dict[str, list[str]]):
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))
        self.errors = errors


@dataclass(frozen=True)
class Rule:
    """One rule relating several fields: when `broken(x)`, `message(x)` is reported at `field`.

    `on` says what `x` is and who evaluates the rule:
    - "model" / "data": that section, by its own validator (so the error sits at the section's
      path next to pydantic's per-field errors); the first broken one is reported.
    - "spec": the whole JobSpec, by its model validator; every JobSpec satisfies these (the
      runtime relies on them). The first broken one is reported alone: the later ones read the
      values it found inconsistent (dp, the batch split).
    - "submit": combinations that parse but this release cannot run, checked by
      `parse_job_spec` after the model, all reported together, so a job never fails on them at
      run time.
    """

    on: Literal["model", "data", "spec", "submit"]
    field: str
    broken: Callable[[Any], bool]
    message: Callable[[Any], str]
