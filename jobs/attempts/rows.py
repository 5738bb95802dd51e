"""The rows a job's timeline and checkpoint table show, as plain dicts (no DRF): what the API
returns, what the job page renders and what the services publish to the job's socket after a write.
Defined once here, below the services, so a write never imports presentation."""
from __future__ import annotations

from datetime import datetime

from django.utils import timezone

from jobs.models import Checkpoint, JobEvent


def iso(value: datetime | None) -> str | None:
    """A timestamp as the REST API writes it (DRF's ISO 8601: UTC, `Z` for +00:00)."""
    if value is None:
        return None
    text = timezone.localtime(value).isoformat() if timezone.is_aware(value) else value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def event_row(e: JobEvent) -> dict:
    """A JobEvent as the timeline shows it (socket, API and page)."""
    return {"id": e.pk, "kind": e.kind, "message": e.message, "created_at": e.created_at.isoformat(),
            "attempt": e.attempt_id, "data": e.data}


def checkpoint_row(c: Checkpoint) -> dict:
    """A registered checkpoint: where, how big, how long it took, and its retention state (the
    API's row, jobs.runs.serializers.CheckpointSerializer, and the job page's checkpoint table)."""
    return {"id": c.pk, "step": c.step, "attempt": c.attempt_id, "created_at": iso(c.created_at),
            "size_bytes": c.size_bytes, "blocking_s": c.blocking_s, "save_s": c.save_s,
            "superseded": c.superseded, "pinned": c.pinned, "deleted": c.deleted_at is not None,
            "deleted_at": iso(c.deleted_at), "path": c.path}
