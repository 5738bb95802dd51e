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
        errors = bounded_errors(errors)
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))
        self.errors = errors


# An error report is sent back to whoever sent the input: its size must not grow with the input
# (a message quoting a hostile value, one error per item of a million-item list).
MAX_ERROR_FIELDS = 50
MAX_MESSAGES_PER_FIELD = 10
MAX_MESSAGE_CHARS = 500


def bounded_errors(errors: dict[str, list[str]]) -> dict[str, list[str]]:
    """`errors` (field path -> messages) cut to at most MAX_ERROR_FIELDS paths, MAX_MESSAGES_PER_FIELD
    messages each and MAX_MESSAGE_CHARS characters per path and message."""
    def cut(text: Any) -> str:
        text = str(text)
        return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."

    out: dict[str, list[str]] = {}
    for path, msgs in list(errors.items())[:MAX_ERROR_FIELDS]:
        msgs = [msgs] if isinstance(msgs, str) else list(msgs)
        out[cut(path)] = [cut(m) for m in msgs[:MAX_MESSAGES_PER_FIELD]]
    if len(errors) > MAX_ERROR_FIELDS:
        out["spec"] = [*out.get("spec", []), f"... and {len(errors) - MAX_ERROR_FIELDS} more fields with errors"]
    return out


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
