"""Reads about attempts: their recent samples (hang, straggler and profile checks), their ranks, and whether the relay is alive.
"""
from __future__ import annotations
from trainyard import keys
from jobs.models import Allocation, MetricSample, MetricStep


def relay_alive() -> float | None:
    """The epoch second the running relay started (keys.RELAY_STARTED_KEY, which it refreshes
    with a 10 s expiry every second while it runs); None when no relay runs (or Redis is away)."""
    import redis
    from django.conf import settings

    try:
        value = (redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
                 .get(keys.RELAY_STARTED_KEY))
    except redis.RedisError:
        return None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


STRAGGLER_WINDOW_STEPS = 20


def attempt_recent_samples(attempt_id: int, last_step: int) -> list[dict]:
    """The attempt's samples of its last STRAGGLER_WINDOW_STEPS steps, every rank (the window
    of the hang, straggler and profiling checks).

    Per-rank rows (MetricSample), not the per-step ones: the checks compare the ranks (a straggler
    is one rank's own work against its peers' median, which MetricStep's min/max/mean and the rank
    of the extreme cannot give: a rank can be the slowest at every step and still within 20% of
    the median). The window is far inside the per-rank rows retention keeps at full resolution (the
    last 2,000 steps by default). Read rank by rank on the unique (attempt, rank, step) index: with
    the attempt's ranks named, each is one index range of ~STRAGGLER_WINDOW_STEPS entries, instead
    of a scan of every per-rank row the attempt still has (1,024 ranks x the retained steps)."""
    qs = MetricSample.objects.filter(attempt_id=attempt_id, step__gt=last_step - STRAGGLER_WINDOW_STEPS)
    ranks = _attempt_ranks(attempt_id)
    if ranks:
        qs = qs.filter(rank__in=ranks)
    return list(qs.values("rank", "step", "step_s", "data_s", "compute_s", "comm_s", "optim_s"))


def attempt_recent_step_s(attempt_id: int, last_step: int) -> list[float]:
    """The mean step time across ranks of each of the attempt's last STRAGGLER_WINDOW_STEPS steps
    (MetricStep: one row a step, whatever the world): what the hang timeout is a multiple of, for
    the detector and for the job page alike. The ranks of a step wait for one another in its
    collectives, so their mean is the step's time; read from 20 rows instead of every rank's 20."""
    return [v for v in MetricStep.objects.filter(attempt_id=attempt_id, step__gt=last_step - STRAGGLER_WINDOW_STEPS)
            .values_list("step_s_mean", flat=True) if v is not None]


def _attempt_ranks(attempt_id: int) -> list[int]:
    """The attempt's ranks: 0 .. world - 1 (world: its processes, one per slot of its allocations),
    and any other rank its nodes reported; empty for an attempt without allocations."""
    world, reported = 0, set()
    for slot_ids, ranks in Allocation.objects.filter(attempt_id=attempt_id).values_list("slot_ids", "ranks"):
        world += len(slot_ids or ())
        reported |= {r["rank"] for r in ranks or () if isinstance(r, dict) and isinstance(r.get("rank"), int)}
    return sorted(reported.union(range(world)))


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


def attempt_slurm_row(attempt) -> dict | None:
    """An attempt's Slurm job as the API and job page show it (issue 27), or None off Slurm."""
    from jobs.models import SlurmJob

    try:
        sj = attempt.slurm
    except SlurmJob.DoesNotExist:
        return None
    return {"pool": sj.pool.name, "job_id": sj.slurm_id or None, "state": sj.state, "reason": sj.reason,
            "category": sj.category, "eta": sj.eta.isoformat() if sj.eta else None, "nodes": list(sj.slurm_nodes),
            "seats": list(sj.seats), "submitted_at": sj.submitted_at.isoformat() if sj.submitted_at else None,
            "launched_at": sj.launched_at.isoformat() if sj.launched_at else None, "error": sj.error}
