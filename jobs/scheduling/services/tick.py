"""The scheduling tick and the queue's predicted start times: jobs/scheduling/policy/ decides over a snapshot (jobs.scheduling.selectors.cluster_view); this module applies the decision in one transaction (placements start attempts: jobs.attempts.services.launch).
"""
from __future__ import annotations
import math
import time
from datetime import datetime
from datetime import timezone as dt_timezone
from django.db import transaction
from jobs.attempts.services.launch import attempt_start
from jobs.fleet.services.slurm import gang_start
from jobs.scheduling import selectors
from jobs.models import Attempt, Job, SchedulerLock
from jobs.scheduling import policy as scheduling
from jobs.attempts.services.attempts import attempt_preempt
from jobs.attempts.services.events import job_event
from jobs.core import dispatch


def schedule_tick() -> list[int]:
    """Place queued jobs, start reclaim preemptions and re-mark borrowing jobs (jobs/policy/
    scheduling/ decides). Serialized: the lock row is taken first in the transaction (FOR UPDATE
    on PostgreSQL; BEGIN IMMEDIATE already holds SQLite's write lock), so two ticks can never both
    see the same free slots. Its wall time, lock wait included, and whether it raised go to Redis
    for /metrics (dispatch.scheduler_tick_record) after the transaction has ended."""
    t0 = time.perf_counter()
    ok = False
    try:
        started = _tick()
        ok = True
        return started
    finally:
        dispatch.scheduler_tick_record(time.perf_counter() - t0, ok)


def _tick() -> list[int]:
    started: list[int] = []
    with transaction.atomic():
        lock, _ = SchedulerLock.objects.select_for_update().get_or_create(pk=1)
        SchedulerLock.objects.filter(pk=1).update(ticks=lock.ticks + 1)
        view = selectors.cluster_view()
        decision = scheduling.schedule(view)
        seats = {n.name for n in view.nodes if n.pool}
        for placement in decision.placements:
            if attempt_start(placement):
                started.append(placement.job_id)
                if any(s.node in seats for s in placement.shares):  # a Slurm pool's seats: sbatch after commit
                    gang_start(Attempt.objects.filter(job_id=placement.job_id).order_by("-number").first())
        for p in decision.preemptions:
            attempt = Attempt.objects.filter(job_id=p.job_id, status__in=(
                Attempt.Status.STARTING, Attempt.Status.RUNNING)).order_by("-number").first()
            if attempt is not None and attempt_preempt(attempt, reason=p.reason, for_job=p.for_job) and p.resize_to:
                # an elastic job's resize: it checkpoints, stops and starts again at once on p.resize_to
                Job.objects.filter(pk=p.job_id).update(elastic_restart=True)
                job_event(attempt.job, "resize_requested", f"resize to {p.resize_to} node(s): {p.reason}",
                          attempt=attempt, nodes=p.resize_to, reason=p.reason)
        running = {r.id for r in view.running}
        Job.objects.filter(pk__in=running & decision.borrowing, borrowing=False).update(borrowing=True)
        Job.objects.filter(pk__in=running - decision.borrowing, borrowing=True).update(borrowing=False)
        for job_id, reason in decision.waiting.items():
            Job.objects.filter(pk=job_id, status=Job.Status.QUEUED).exclude(status_reason=reason).update(
                status_reason=reason[:500])
    return started


def eta_refresh() -> int:
    """Predicted start times of queued jobs (the policy run forward over predicted run times);
    beat runs it every 5 s. Writes only what the policy's `eta_changes` reports (appeared, gone,
    or moved by more than `scheduling.ETA_TOLERANCE_S`, 5 s); returns that count."""
    view = selectors.cluster_view()
    etas = scheduling.predict_starts(view)
    with transaction.atomic():
        queued = dict(Job.objects.filter(status=Job.Status.QUEUED).values_list("pk", "predicted_start_at"))
        old = {pk: at.timestamp() for pk, at in queued.items() if at is not None}
        new = {pk: ts for pk, ts in etas.items() if pk in queued and math.isfinite(ts)}
        changes = scheduling.eta_changes(old, new)
        for job_id, ts in changes.items():
            Job.objects.filter(pk=job_id).update(
                predicted_start_at=None if ts is None else datetime.fromtimestamp(ts, tz=dt_timezone.utc))
    return len(changes)
