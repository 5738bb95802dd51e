"""The job socket as it was before issue 26, for bench/ws_snapshot.py only: daphne serves
`bench.ws_snapshot_old:application`, controlplane.asgi with the snapshot's charts made by
jobs/telemetry/payloads.py metric_window (every rank at each chosen step, 4,000 rows) instead of the
reduced steps. Never imported by the control plane."""
from __future__ import annotations

from controlplane.asgi import application  # noqa: F401  (django.setup() first)

from jobs.attempts.rows import checkpoint_row, event_row
from jobs.models import Job
from jobs.runs import payloads as runs_payloads
from jobs.runs.serializers import JobSerializer
from jobs.telemetry import selectors as telemetry_selectors
from jobs.telemetry.payloads import metric_window


def old_job_snapshot(job_id: int, *, max_points: int = 4000) -> dict:
    job = Job.objects.prefetch_related("attempts__allocations__node").select_related("owner").get(pk=job_id)
    samples, downsampled = metric_window(job_id, max_points=4000)
    return {
        "type": "snapshot", "job": JobSerializer(job).data, "samples": samples, "downsampled": downsampled,
        "logs": telemetry_selectors.job_log_lines(job_id, limit=1000),
        "events": [event_row(e) for e in job.events.order_by("-id")[:200]][::-1],
        "checkpoints": [checkpoint_row(c) for c in job.checkpoints.order_by("-step", "-id")[:200]],
    }


runs_payloads.job_snapshot = old_job_snapshot
