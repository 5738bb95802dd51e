"""The bottom of the services: a job's events, its compare-and-set status, and what they publish.

Every transition in the package goes through job_set_status (`filter(status__in=old).update(...)`,
so two writers can never both move a job) and writes a JobEvent with job_event; the websocket
messages they cause are sent only after the transaction commits. The events of a job's life
(LIFECYCLE: submitted, running, finished, failed, cancelled, preempted, restarted) are also logged,
once committed, on the `trainyard.lifecycle` logger: the lines `make run` keeps on its terminal.
"""
from __future__ import annotations

import logging
import re
from functools import partial
from typing import TYPE_CHECKING

from django.db import transaction
from django.utils import timezone

from jobs.core import dispatch
from jobs.models import Attempt, Job, JobEvent
from jobs.attempts.rows import event_row

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser

lifecycle = logging.getLogger("trainyard.lifecycle")
LIFECYCLE = frozenset({"submitted", "running", "succeeded", "failed", "cancelled", "preempted", "restart", "rollback"})
NOTIFIED = {"succeeded": "job.ended", "failed": "job.ended", "cancelled": "job.ended",
            "hang_detected": "job.hung", "restart": "job.restarted"}
"""The kinds that are notification events (jobs/notify/): handed over after commit, by name."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def _one_line(text: str, limit: int) -> str:
    """A message (user code's failure text, a job's name) as one line of a log: no newlines or
    terminal escapes of its own, at most `limit` characters."""
    text = _CONTROL.sub(" ", text).strip()
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def job_event(job: Job, kind: str, message: str = "", *, attempt: Attempt | None = None,
              actor: AbstractUser | None = None, **data) -> JobEvent:
    """Record one entry of the job's timeline (data: its evidence) and publish it after commit."""
    event = JobEvent.objects.create(job=job, attempt=attempt, kind=kind, message=message, data=data, actor=actor)
    payload = {"type": "job.event", "event": event_row(event)}
    transaction.on_commit(partial(dispatch.publish, f"job.{job.pk}", payload))
    if kind in LIFECYCLE:
        transaction.on_commit(partial(lifecycle.info, "job %s %r %s: %s", job.pk, _one_line(job.name, 80), kind,
                                      _one_line(message, 300)))
    if kind in NOTIFIED:
        transaction.on_commit(partial(dispatch.send_notify, NOTIFIED[kind], job=job.pk, kind=kind,
                                      message=message[:1000], failure_class=data.get("failure_class")))
    return event


def job_publish_status(job: Job) -> None:
    """Tell the job's page and the cluster page the job's status, after commit."""
    attempt_id = job.attempts.order_by("-number").values_list("pk", flat=True).first()
    payload = {"type": "job.status", "status": job.status, "status_reason": job.status_reason,
               "attempt": attempt_id, "step": job.step}
    transaction.on_commit(partial(dispatch.publish, f"job.{job.pk}", payload))
    transaction.on_commit(partial(dispatch.publish_cluster_changed, "jobs"))


def job_set_status(job: Job, old: tuple | str, new: str, reason: str = "", **fields) -> bool:
    """Move the job from `old` (one status or several) to `new`, with `fields` written in the same
    UPDATE; False (and nothing written) when another writer moved it first."""
    olds = (old,) if isinstance(old, str) else old
    now = timezone.now()
    if new in Job.TERMINAL:
        fields.setdefault("finished_at", now)
    if new == Job.Status.RUNNING:
        fields.setdefault("started_at", job.started_at or now)
    n = Job.objects.filter(pk=job.pk, status__in=olds).update(status=new, status_reason=reason, **fields)
    if n:
        job.refresh_from_db()
        job_publish_status(job)
    return bool(n)
