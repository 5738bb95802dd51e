"""The cluster snapshot the scheduling policy decides over (nodes, the queue, running jobs, quotas, fair-share usage), queue positions, and the quota table.
"""
from __future__ import annotations
from django.db.models import Q
from jobs.models import Allocation, Attempt, Job, Node
from jobs.scheduling.policy import fairshare
from jobs.scheduling.policy import ClusterView, NodeState, QueuedJob, Quotas, RunningJob, eligibility


def cluster_snapshot() -> list[NodeState]:
    """Every node as placement sees it: its slots (one per advertised GPU on a GPU node), which
    are in use, whether it takes work, and what it offers (device kind, GPUs, memory, labels)."""
    used: dict[int, set[int]] = {}
    # .order_by(): Allocation's default order goes through Attempt's and Job's, a join over every job
    # (bench/joblist.py: 10-15 ms of a 10,000-job database, on every tick and queue_positions call)
    for node_id, slot_ids in Allocation.objects.filter(active=True).order_by().values_list("node_id", "slot_ids"):
        used.setdefault(node_id, set()).update(slot_ids)
    return [
        NodeState(n.name, n.address, eligibility.node_slots(n.slots, n.device_kind, n.gpu_count),
                  frozenset(used.get(n.pk, ())),
                  # a pool's seat takes work only while no Slurm job holds it (released after its attempt)
                  n.status == Node.Status.READY and n.quarantined_at is None and n.holder_id is None,
                  (n.labels or {}).get("rack"), n.device_kind, n.gpu_count, n.gpu_memory_bytes, _pairs(n.labels),
                  pool=n.pool.name if n.pool_id else "")
        for n in Node.objects.defer("devices").select_related("pool")
    ]


def _pairs(labels) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in (labels or {}).items()))


def _queued(j: Job) -> QueuedJob:
    r = j.spec["resources"]
    least = r.get("min_nodes")
    elastic = least is not None and least < r["nodes"]
    # an elastic job restarts at once on what is free after a resize, or after a failure that
    # blamed nodes (it avoids them: the surviving nodes)
    return QueuedJob(j.pk, j.priority, r["nodes"], r["procs_per_node"], frozenset(j.avoid_nodes or ()),
                     j.team.name if j.team_id else None, j.owner.username, j.created_at.timestamp(),
                     j.predicted_s or 3600.0, **eligibility.job_requirement(r),
                     min_nodes=least if elastic else None,
                     restart_now=elastic and (j.elastic_restart or bool(j.avoid_nodes)))


def queue_snapshot() -> list[QueuedJob]:
    return [_queued(j) for j in Job.objects.filter(status=Job.Status.QUEUED).select_related("team", "owner")
            .only("id", "priority", "spec", "avoid_nodes", "team__name", "owner__username", "created_at", "predicted_s",
                  "elastic_restart")]


def running_snapshot(now: float) -> list[RunningJob]:
    """Jobs whose processes hold slots (active allocations), as the policy sees them."""
    shares: dict[int, list] = {}
    for attempt_id, node, slot_ids in Allocation.objects.filter(active=True).order_by("attempt_id", "node_rank").values_list(
            "attempt_id", "node__name", "slot_ids"):  # node_rank order without the default order's joins
        shares.setdefault(attempt_id, []).append((node, tuple(slot_ids)))
    out = []
    for a in Attempt.objects.filter(pk__in=shares).select_related("job__team", "job__owner"):
        job = a.job
        started = (a.started_at or a.created_at).timestamp()
        left = (job.predicted_s or 3600.0) * (1 - (a.last_step - (a.resumed_from_step or 0)) /
                                              max(1, job.total_steps - (a.resumed_from_step or 0)))
        held = tuple(shares[a.pk])
        shape = _queued(job)
        scale = shape.nodes / len(held) if shape.elastic else 1.0  # its prediction is on its most nodes
        out.append(RunningJob(job.pk, job.team.name if job.team_id else None, job.owner.username,
                              sum(len(ids) for _, ids in held), job.priority, held, started,
                              # progress-based: the remaining share of the prediction from now
                              now + max(0.0, left) * scale if a.last_step else
                              started + (job.predicted_s or 3600.0) * scale,
                              preemptible=not a.stop_reason, preempted_for=a.preempt_for,
                              elastic=shape if shape.elastic else None))
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
                       reclaim_wait_s=settings.TRAINYARD_RECLAIM_WAIT_S,
                       grow_min_left_s=settings.TRAINYARD_ELASTIC_GROW_MIN_S)


def queue_positions() -> dict[int, int]:
    from jobs.scheduling.policy import queue_order

    return {j.id: i + 1 for i, j in enumerate(queue_order(cluster_view()))}


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
