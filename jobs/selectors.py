"""Non-trivial reads: snapshots for policy, visibility rules, telemetry windows."""
from __future__ import annotations

from django.db.models import Q, QuerySet

from .models import Allocation, Job, MetricSample, Node
from .policy.scheduler import NodeState, QueuedJob


def jobs_visible_to(user) -> QuerySet[Job]:
    qs = Job.objects.select_related("owner")
    if user.is_staff:
        return qs
    # Users see their own jobs and their teams' jobs.
    return qs.filter(Q(owner=user) | Q(team__in=user.groups.all())).distinct()


def cluster_snapshot() -> list[NodeState]:
    used: dict[int, set[int]] = {}
    for node_id, slot_ids in Allocation.objects.filter(active=True).values_list("node_id", "slot_ids"):
        used.setdefault(node_id, set()).update(slot_ids)
    return [
        NodeState(n.name, n.address, n.slots, frozenset(used.get(n.pk, ())), n.status == Node.Status.READY)
        for n in Node.objects.all()
    ]


def queue_snapshot() -> list[QueuedJob]:
    return [
        QueuedJob(j.pk, j.priority, j.spec["resources"]["nodes"], j.spec["resources"]["procs_per_node"])
        for j in Job.objects.filter(status=Job.Status.QUEUED).only("id", "priority", "spec")
    ]


def slots_used_by_node() -> dict[int, int]:
    used: dict[int, int] = {}
    for node_id, slot_ids in Allocation.objects.filter(active=True).values_list("node_id", "slot_ids"):
        used[node_id] = used.get(node_id, 0) + len(slot_ids)
    return used


def job_metrics(job: Job, *, since_step: int | None = None, rank: int | None = None, limit: int = 1000):
    qs = MetricSample.objects.filter(job=job)
    if since_step is not None:
        qs = qs.filter(step__gt=since_step)
    if rank is not None:
        qs = qs.filter(rank=rank)
    return qs.order_by("step", "rank", "attempt_id")[:limit]


def queue_positions() -> dict[int, int]:
    from .policy.scheduler import queue_order

    return {j.id: i + 1 for i, j in enumerate(queue_order(queue_snapshot()))}


def job_log_lines(job_id: int, *, rank: int | None = None, limit: int = 500) -> list[dict]:
    """The newest captured log lines of a job (kept in a capped Redis list by the relay)."""
    import json

    import redis
    from django.conf import settings

    from .telemetry import log_key

    r = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        raw = r.lrange(log_key(job_id), -5000, -1)
    except redis.RedisError:
        return []
    lines = [json.loads(x) for x in raw]
    if rank is not None:
        lines = [x for x in lines if x.get("rank") == rank]
    return lines[-limit:]
