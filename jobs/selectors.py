"""Non-trivial reads: snapshots for policy, visibility rules, metric and log reads. Never imports
the API, its serializers or the services (jobs/payloads.py builds the JSON the sockets send)."""
from __future__ import annotations

from django.db.models import Q, QuerySet

from trainyard import keys

from jobs.models import Allocation, Attempt, Job, MetricSample, Node
from jobs.policy import fairshare
from jobs.policy.scheduling import ClusterView, NodeState, QueuedJob, Quotas, RunningJob, eligibility


def jobs_visible_to(user) -> QuerySet[Job]:
    qs = Job.objects.select_related("owner")
    if user.is_staff:
        return qs
    # Users see their own jobs and their teams' jobs.
    return qs.filter(Q(owner=user) | Q(team__in=user.groups.all())).distinct()


def cluster_snapshot() -> list[NodeState]:
    """Every node as placement sees it: its slots (one per advertised GPU on a GPU node), which
    are in use, whether it takes work, and what it offers (device kind, GPUs, memory, labels)."""
    used: dict[int, set[int]] = {}
    for node_id, slot_ids in Allocation.objects.filter(active=True).values_list("node_id", "slot_ids"):
        used.setdefault(node_id, set()).update(slot_ids)
    return [
        NodeState(n.name, n.address, eligibility.node_slots(n.slots, n.device_kind, n.gpu_count),
                  frozenset(used.get(n.pk, ())),
                  n.status == Node.Status.READY and n.quarantined_at is None, (n.labels or {}).get("rack"),
                  n.device_kind, n.gpu_count, n.gpu_memory_bytes, _pairs(n.labels))
        for n in Node.objects.defer("devices")
    ]


def _pairs(labels) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in (labels or {}).items()))


def _queued(j: Job) -> QueuedJob:
    r = j.spec["resources"]
    return QueuedJob(j.pk, j.priority, r["nodes"], r["procs_per_node"], frozenset(j.avoid_nodes or ()),
                     j.team.name if j.team_id else None, j.owner.username, j.created_at.timestamp(),
                     j.predicted_s or 3600.0, **eligibility.job_requirement(r))


def queue_snapshot() -> list[QueuedJob]:
    return [_queued(j) for j in Job.objects.filter(status=Job.Status.QUEUED).select_related("team", "owner")
            .only("id", "priority", "spec", "avoid_nodes", "team__name", "owner__username", "created_at", "predicted_s")]


def running_snapshot(now: float) -> list[RunningJob]:
    """Jobs whose processes hold slots (active allocations), as the policy sees them."""
    shares: dict[int, list] = {}
    for attempt_id, node, slot_ids in Allocation.objects.filter(active=True).values_list(
            "attempt_id", "node__name", "slot_ids"):
        shares.setdefault(attempt_id, []).append((node, tuple(slot_ids)))
    out = []
    for a in Attempt.objects.filter(pk__in=shares).select_related("job__team", "job__owner"):
        job = a.job
        started = (a.started_at or a.created_at).timestamp()
        left = (job.predicted_s or 3600.0) * (1 - (a.last_step - (a.resumed_from_step or 0)) /
                                              max(1, job.total_steps - (a.resumed_from_step or 0)))
        out.append(RunningJob(job.pk, job.team.name if job.team_id else None, job.owner.username, job.slots,
                              job.priority, tuple(shares[a.pk]), started,
                              # progress-based: the remaining share of the prediction from now
                              now + max(0.0, left) if a.last_step else started + (job.predicted_s or 3600.0),
                              preemptible=not a.stop_reason, preempted_for=a.preempt_for))
    return out


def quotas_snapshot(now) -> Quotas:
    from datetime import timedelta

    from django.conf import settings

    from jobs.models import Quota

    team_slots, user_slots, budgets = {}, {}, []
    for q in Quota.objects.select_related("team", "user"):
        key = q.team.name if q.team_id else f"user:{q.user.username}"
        if q.team_id:
            team_slots[q.team.name] = q.max_slots
        else:
            user_slots[q.user.username] = q.max_slots
        if q.device_hours is not None:
            budgets.append((key, q.device_hours))
    over: set[str] = set()
    if budgets:
        teams, users = slot_seconds_by_owner(now - timedelta(seconds=settings.TRAINYARD_QUOTA_WINDOW_S), now)
        for key, hours in budgets:
            used = users.get(key[5:], 0.0) if key.startswith("user:") else teams.get(key, 0.0)
            if used >= hours * 3600:
                over.add(key)
    return Quotas(team_slots, user_slots, frozenset(over))


def fair_usage(now) -> dict:
    """Decayed slot-seconds per team over the last few half-lives (fairshare.py)."""
    from datetime import timedelta

    from django.conf import settings

    half = settings.TRAINYARD_FAIRSHARE_HALF_LIFE_S
    since = now - timedelta(seconds=half * fairshare.USAGE_LOOKBACK_HALF_LIVES)
    rows = (Attempt.objects.filter(started_at__isnull=False).filter(Q(ended_at__isnull=True) | Q(ended_at__gt=since))
            .values_list("job__team__name", "job__slots", "started_at", "ended_at"))
    return fairshare.decayed_usage(((t, s, a.timestamp(), e.timestamp() if e else None) for t, s, a, e in rows),
                                   now.timestamp(), half)


def cluster_view(now=None) -> ClusterView:
    """Everything the scheduling policy decides on, in one snapshot."""
    from django.conf import settings
    from django.utils import timezone

    now = now or timezone.now()
    return ClusterView(now.timestamp(), tuple(cluster_snapshot()), tuple(running_snapshot(now.timestamp())),
                       tuple(queue_snapshot()), quotas_snapshot(now), fair_usage(now),
                       half_life_s=settings.TRAINYARD_FAIRSHARE_HALF_LIFE_S,
                       reclaim_wait_s=settings.TRAINYARD_RECLAIM_WAIT_S)


def slots_used_by_node() -> dict[int, int]:
    used: dict[int, int] = {}
    for node_id, slot_ids in Allocation.objects.filter(active=True).values_list("node_id", "slot_ids"):
        used[node_id] = used.get(node_id, 0) + len(slot_ids)
    return used


def lineage_filter(job_id: int) -> Q:
    """The samples a job's charts show: each step once per rank. An attempt that resumed from step S
    (a restart from a checkpoint, or a rollback) replaces every earlier attempt's samples after S."""
    attempts = list(Attempt.objects.filter(job_id=job_id).order_by("number").values_list("pk", "resumed_from_step"))
    q = Q()
    cutoff = None  # min resumed_from_step over the attempts after this one
    for pk, start in reversed(attempts):
        q |= Q(attempt_id=pk) if cutoff is None else Q(attempt_id=pk, step__lte=cutoff)
        cutoff = (start or 0) if cutoff is None else min(cutoff, start or 0)
    return q if attempts else Q(pk__in=[])


def job_metrics(job: Job, *, since_step: int | None = None, rank: int | None = None, limit: int = 1000,
                attempt: int | None = None):
    """Metrics as the charts show them (see lineage_filter), or one attempt's own samples."""
    qs = MetricSample.objects.filter(job=job)
    qs = qs.filter(attempt_id=attempt) if attempt is not None else qs.filter(lineage_filter(job.pk))
    if since_step is not None:
        qs = qs.filter(step__gt=since_step)
    if rank is not None:
        qs = qs.filter(rank=rank)
    return qs.order_by("step", "rank", "attempt_id")[:limit]


def job_has_telemetry(job_id: int) -> bool:
    """Whether the job has any metric sample at all (decided from data: a script without the SDK sends none)."""
    return MetricSample.objects.filter(job_id=job_id).exists()


def has_telemetry_expr():
    """The same question as a subquery, for annotating a list of jobs in one query."""
    from django.db.models import Exists, OuterRef

    return Exists(MetricSample.objects.filter(job_id=OuterRef("pk")))


def queue_positions() -> dict[int, int]:
    from jobs.policy.scheduling import queue_order

    return {j.id: i + 1 for i, j in enumerate(queue_order(cluster_view()))}


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




def relay_alive() -> bool:
    """The relay refreshes this key (10 s expiry) every second while it runs."""
    import redis
    from django.conf import settings

    try:
        return bool(redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
                    .exists(keys.RELAY_ALIVE_KEY))
    except redis.RedisError:
        return False


STRAGGLER_WINDOW_STEPS = 20


def attempt_recent_samples(attempt_id: int, last_step: int) -> list[dict]:
    """The attempt's samples of its last STRAGGLER_WINDOW_STEPS steps, every rank (the window
    of the hang, straggler and profiling checks)."""
    return list(MetricSample.objects.filter(attempt_id=attempt_id, step__gt=last_step - STRAGGLER_WINDOW_STEPS)
                .values("rank", "step", "step_s", "data_s", "compute_s", "comm_s", "optim_s"))


def attempt_rank_rows(attempt) -> list[dict]:
    """Every rank of an attempt (allocations prefetched with their nodes): rank, node, pid and,
    once the runtime reported it, its place in the parallel plan (coords, role, bytes held)."""
    plans = attempt.rank_plans or {}
    out = []
    for alloc in attempt.allocations.all():
        for r in alloc.ranks:
            row = {"rank": r["rank"], "node": alloc.node.name, "pid": r.get("pid")}
            row.update(plans.get(str(r["rank"]), {}))
            out.append(row)
    return sorted(out, key=lambda r: r["rank"])


def attempt_rank_nodes(attempt_id: int) -> dict[int, str]:
    return {r["rank"]: a.node.name for a in Allocation.objects.filter(attempt_id=attempt_id).select_related("node")
            for r in a.ranks}


# ---------------------------------------------------------------- quotas and usage

def slot_seconds_by_owner(since, now) -> tuple[dict[str, float], dict[str, float]]:
    """Slot-seconds used since `since` per team name and per username (attempts that ran)."""
    teams: dict[str, float] = {}
    users: dict[str, float] = {}
    qs = (Attempt.objects.filter(started_at__isnull=False).filter(Q(ended_at__isnull=True) | Q(ended_at__gt=since))
          .select_related("job__team", "job__owner").only("started_at", "ended_at", "job__slots", "job__team__name",
                                                          "job__owner__username"))
    for a in qs:
        start, end = max(a.started_at, since), a.ended_at or now
        used = max(0.0, (end - start).total_seconds()) * a.job.slots
        if a.job.team is not None:
            teams[a.job.team.name] = teams.get(a.job.team.name, 0.0) + used
        users[a.job.owner.username] = users.get(a.job.owner.username, 0.0) + used
    return teams, users


def quota_table() -> list[dict]:
    """Per team (and per user with a quota): the quota, slots in use, borrowed, queued demand and
    device-hours used in the rolling window: the quota page and GET /api/v1/quotas/."""
    from datetime import timedelta

    from django.conf import settings
    from django.contrib.auth.models import Group
    from django.utils import timezone

    from jobs.models import Quota

    now = timezone.now()
    window = timedelta(seconds=settings.TRAINYARD_QUOTA_WINDOW_S)
    team_s, user_s = slot_seconds_by_owner(now - window, now)
    rows: dict[tuple[str, str], dict] = {}

    def row(kind: str, name: str) -> dict:
        return rows.setdefault((kind, name), {
            "team": name if kind == "team" else None, "user": name if kind == "user" else None,
            "max_slots": None, "device_hours": None, "in_use": 0, "borrowed": 0, "queued": 0,
            "device_hours_used": round((team_s if kind == "team" else user_s).get(name, 0.0) / 3600, 3)})

    for q in Quota.objects.select_related("team", "user"):
        r = row("team", q.team.name) if q.team else row("user", q.user.username)
        r["max_slots"], r["device_hours"] = q.max_slots, q.device_hours
    for name in Group.objects.values_list("name", flat=True):
        row("team", name)
    jobs = Job.objects.filter(status__in=(*Job.ACTIVE, Job.Status.QUEUED), team__isnull=False).values_list(
        "team__name", "status", "slots", "borrowing")
    for team, status, slots, borrowing in jobs:
        r = row("team", team)
        if status == Job.Status.QUEUED:
            r["queued"] += slots
        else:
            r["in_use"] += slots
            r["borrowed"] += slots if borrowing else 0
    return sorted(rows.values(), key=lambda r: (r["team"] is None, r["team"] or r["user"]))


PAST_RUNS = 500


def past_runs() -> list:
    """The predictor's history: attempts that ran to the end, newest PAST_RUNS."""
    from jobs.policy.predictor import PastRun, shape_from_spec

    out = []
    for a in (Attempt.objects.filter(outcome="succeeded", started_at__isnull=False, ended_at__isnull=False)
              .select_related("job__team", "job__owner").order_by("-ended_at")[:PAST_RUNS]):
        job = a.job
        # An entrypoint job's steps are the ones it reported (none without the SDK), not train.steps.
        steps = (a.last_step if job.spec.get("entrypoint") else job.total_steps) - (a.resumed_from_step or 0)
        out.append(PastRun(shape_from_spec(job.spec, job.owner.username, job.team.name if job.team_id else None),
                           (a.ended_at - a.started_at).total_seconds(), max(0, steps), a.ended_at.timestamp()))
    return out
