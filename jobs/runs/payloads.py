"""What the websockets send: a job's snapshot and the cluster state. The API's serializers make the rows, so a socket and REST agree.
"""
from __future__ import annotations
import threading
import time
from jobs.telemetry.payloads import SNAPSHOT_POINTS, chart_telemetry
from jobs.access import selectors as access_selectors
from jobs.scheduling import selectors as scheduling_selectors
from jobs.telemetry import selectors as telemetry_selectors
from jobs.models import Job, Node
from jobs.attempts.rows import checkpoint_row, event_row
from jobs.runs.serializers import JobSerializer
from jobs.fleet.serializers import NodeSerializer


def job_snapshot(job_id: int, *, max_points: int = SNAPSHOT_POINTS) -> dict:
    """What a job socket sends first: the job, its charts (reduced steps bucketed to at most max_points,
    the named ranks and their recent samples: jobs/telemetry/payloads.py chart_telemetry), logs, events,
    checkpoints."""
    job = (Job.objects.prefetch_related("attempts__allocations__node", "attempts__slurm__pool")
           .select_related("owner").get(pk=job_id))
    charts = chart_telemetry(job_id, max_points=max_points)
    return {
        "type": "snapshot", "job": JobSerializer(job).data, "steps": charts["steps"],
        "bucketed": charts["bucketed"], "total_steps": charts["total_steps"], "named": charts["named"],
        # downsampled: the samples are not the whole history (buckets, or only the recent steps' samples)
        "samples": charts["samples"], "downsampled": charts["downsampled"],
        "logs": telemetry_selectors.job_log_lines(job_id, limit=1000),
        "events": [event_row(e) for e in job.events.order_by("-id")[:200]][::-1],
        "checkpoints": [checkpoint_row(c) for c in job.checkpoints.order_by("-step", "-id")[:200]],
    }


def cluster_state(user, fresh_after: float = 0.0) -> dict:
    """The cluster page's live state as `user` may see it: nodes, the queue, running jobs.

    Every open cluster socket asks for this on every change (node heartbeats, queue moves), so
    with N sockets open one change cost N computations, all on Channels' single database thread
    (bench/load.py: 150 cluster sockets stalled daphne's HTTP too). A computation is now shared by
    every socket of this process that may see the same jobs (staff alike; other users by their id
    and teams), as long as it started after `fresh_after` (time.monotonic() when the asking socket
    heard of the change): a socket never gets a state older than the change it was told about."""
    if user.is_staff:
        key: tuple = ("staff",)
    else:
        key = ("user", user.pk, tuple(sorted(user.groups.values_list("pk", flat=True))))
    shared = _MEMO.get(("shared",), fresh_after, _cluster_shared)
    jobs = _MEMO.get(key, fresh_after, lambda: _cluster_jobs(user, shared["positions"]))
    return {"nodes": shared["nodes"], **jobs}


def _cluster_shared() -> dict:
    return {"positions": scheduling_selectors.queue_positions(),
            "nodes": list(NodeSerializer(Node.objects.order_by("name"), many=True).data)}


def _cluster_jobs(user, positions: dict) -> dict:
    visible = access_selectors.jobs_visible_to(user)
    queue = [{"id": j.pk, "name": j.name, "owner": j.owner.username, "status": j.status, "slots": j.slots,
              "queue_position": positions.get(j.pk), "status_reason": j.status_reason}
             for j in visible.filter(status=Job.Status.QUEUED).order_by("-priority", "id")[:200]]
    running = [{"id": j.pk, "name": j.name, "owner": j.owner.username, "status": j.status, "step": j.step,
                "total_steps": j.total_steps} for j in visible.filter(status__in=Job.ACTIVE).order_by("-id")[:200]]
    return {"queue": queue, "running": running}


class _Memo:
    """key -> (monotonic time its computation started, value); entries older than MAX_AGE_S are
    dropped whenever one is stored, so the memo holds only what the last changes produced."""

    MAX_AGE_S = 60.0

    def __init__(self):
        self._lock = threading.Lock()
        self._items: dict[tuple, tuple[float, dict]] = {}

    def get(self, key: tuple, fresh_after: float, compute) -> dict:
        with self._lock:
            hit = self._items.get(key)
        if hit is not None and hit[0] >= fresh_after:
            return hit[1]
        started = time.monotonic()
        value = compute()
        with self._lock:
            if key not in self._items or self._items[key][0] < started:
                self._items[key] = (started, value)
            cutoff = started - self.MAX_AGE_S
            for k in [k for k, (t, _) in self._items.items() if t < cutoff]:
                del self._items[k]
        return value


_MEMO = _Memo()
