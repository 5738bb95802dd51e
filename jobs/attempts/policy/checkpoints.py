"""Which checkpoints to keep and which one a new attempt resumes from (pure)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointState:
    id: int
    step: int
    created: float  # epoch seconds: registration order
    superseded: bool = False
    pinned: bool = False
    deleted: bool = False


def resume_point(checkpoints: list[CheckpointState]) -> CheckpointState | None:
    """The latest complete checkpoint of the job's current line: the highest step that is neither
    superseded (by a rollback) nor deleted."""
    live = [c for c in checkpoints if not c.superseded and not c.deleted]
    return max(live, key=lambda c: (c.step, c.created, c.id), default=None)


def retention(checkpoints: list[CheckpointState], keep: int) -> list[int]:
    """Ids whose files to delete: everything but the newest `keep` live checkpoints, anything
    pinned, and the resume point. A superseded checkpoint (a rollback skipped it) survives while
    it is among the `keep` most recently registered, so an admin can still undo a rollback."""
    keep = max(1, keep)
    present = [c for c in checkpoints if not c.deleted]
    live = sorted((c for c in present if not c.superseded), key=lambda c: (c.step, c.created, c.id), reverse=True)
    kept = {c.id for c in live[:keep]}
    recent = sorted(present, key=lambda c: (c.created, c.id), reverse=True)[:keep]
    kept |= {c.id for c in recent if c.superseded}
    point = resume_point(checkpoints)
    if point is not None:
        kept.add(point.id)
    return sorted(c.id for c in present if c.id not in kept and not c.pinned)


def rollback_supersedes(checkpoints: list[CheckpointState], target: CheckpointState) -> list[int]:
    """Checkpoints a rollback to `target` supersedes: every other one at the same or a later step
    (they belong to the future the rollback discards)."""
    return sorted(c.id for c in checkpoints if c.id != target.id and c.step >= target.step and not c.superseded)
