"""Reads of a job's telemetry: its per-step rows (MetricStep, kept for the job's life) and, for a
drill-down, its per-rank samples (MetricSample, kept for a recent window: retention) along its
lineage, whether it has any, its live log lines.
"""
from __future__ import annotations
from django.db.models import Q
from trainyard import keys
from jobs.models import Attempt, Job, MetricSample, MetricStep


def lineage_filter(job_id: int) -> Q:
    """The rows a job's charts show: each step once (per rank, for MetricSample). An attempt that resumed
    from step S (a restart from a checkpoint, or a rollback) replaces every earlier attempt's rows after
    S. On attempt_id and step: a filter of MetricSample and MetricStep alike."""
    attempts = list(Attempt.objects.filter(job_id=job_id).order_by("number").values_list("pk", "resumed_from_step"))
    q = Q()
    cutoff = None  # min resumed_from_step over the attempts after this one
    for pk, start in reversed(attempts):
        q |= Q(attempt_id=pk) if cutoff is None else Q(attempt_id=pk, step__lte=cutoff)
        cutoff = (start or 0) if cutoff is None else min(cutoff, start or 0)
    return q if attempts else Q(pk__in=[])


def job_metrics(job: Job, *, since_step: int | None = None, rank: int | None = None, limit: int = 1000,
                attempt: int | None = None, per_rank: bool = False):
    """A job's metrics as the charts show them (see lineage_filter), or one attempt's own rows.
    Default: the per-step rows (MetricStep: every rank reduced, kept for the job's life), in step
    order. `rank`: that rank's samples; `per_rank`: every rank's (MetricSample, kept for a recent
    window of steps and thinned before it), in (step, rank) order."""
    per_rank = per_rank or rank is not None
    qs = (MetricSample if per_rank else MetricStep).objects.filter(job=job)
    qs = qs.filter(attempt_id=attempt) if attempt is not None else qs.filter(lineage_filter(job.pk))
    if since_step is not None:
        qs = qs.filter(step__gt=since_step)
    if rank is not None:
        qs = qs.filter(rank=rank)
    order = ("step", "rank", "attempt_id") if per_rank else ("step", "attempt_id")
    return qs.order_by(*order)[:limit]


def job_has_telemetry(job_id: int) -> bool:
    """Whether the job has any metric at all (decided from data: a script without the SDK sends none).
    Its per-step rows, which outlive the per-rank ones."""
    return MetricStep.objects.filter(job_id=job_id).exists()


def has_telemetry_expr():
    """The same question as a subquery, for annotating a list of jobs in one query."""
    from django.db.models import Exists, OuterRef

    return Exists(MetricStep.objects.filter(job_id=OuterRef("pk")))


def job_log_lines(job_id: int, *, rank: int | None = None, limit: int = 500) -> list[dict]:
    """The newest captured log lines of a job (kept in a capped Redis list by the relay)."""
    import json

    import redis
    from django.conf import settings

    r = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        raw = r.lrange(keys.job_log_key(job_id), -5000, -1)
    except redis.RedisError:
        return []
    lines = [json.loads(x) for x in raw]
    if rank is not None:
        lines = [x for x in lines if x.get("rank") == rank]
    return lines[-limit:]
