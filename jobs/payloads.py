"""What the websockets send: a job's snapshot, its metric windows, events and checkpoints as
JSON, and the cluster state. The API's serializers make the rows, so a socket and REST agree.

The services publish jobs.rows' event and checkpoint rows after commit (rows the API and the page
share); jobs.consumers sends the snapshot and windows on connect and catch-up.
"""
from __future__ import annotations

import threading
import time

from django.db.models import Count, ExpressionWrapper, F, IntegerField, Max, Q, Window
from django.db.models.functions import DenseRank

from jobs import selectors
from jobs.models import Job, MetricSample, Node
from jobs.rows import checkpoint_row, event_row
from jobs.serializers import JobSerializer, NodeSerializer

METRIC_VALUES = MetricSample.FIELDS + ("attempt_id", "extra")


def _metric_dicts(qs) -> list[dict]:
    rows = list(qs.values(*METRIC_VALUES))
    for r in rows:
        r["attempt"] = r.pop("attempt_id")
        r["metrics"] = r.pop("extra")  # the user's own metrics, as the relay's live samples carry them
    return rows


def metric_window(job_id: int, *, from_step: int | None = None, max_points: int = 4000) -> tuple[list[dict], bool]:
    """Samples for a live chart: from `from_step` on (default: everything), at most max_points rows,
    and whether some steps were left out.

    Downsampled in the database (issue 15): one aggregate counts the rows and the distinct steps,
    then only every k-th step (by its rank among the distinct steps, so uneven reporting intervals
    and restarts thin out evenly; the same steps for every rank, so charts stay aligned) plus the
    newest step are fetched. Before, every connect read the whole history into Python to drop
    most of it: 200,000 samples cost 183 MB and ~9 s per connect; now Python holds at most
    ~max_points rows whatever the job's length, in 2 queries."""
    qs = MetricSample.objects.filter(job_id=job_id).filter(selectors.lineage_filter(job_id))
    if from_step is not None:
        qs = qs.filter(step__gte=from_step)
    agg = qs.aggregate(rows=Count("id"), steps=Count("step", distinct=True), last=Max("step"))
    if agg["rows"] <= max_points:
        return _metric_dicts(qs.order_by("step", "rank", "attempt_id")), False
    ranks = -(-agg["rows"] // max(1, agg["steps"]))  # rows per step (ceil)
    # every k-th step: steps / k kept steps of `ranks` rows each, plus the newest, stay within max_points
    stride = max(1, -(-agg["steps"] * ranks // max(1, max_points - ranks)))
    picked = (qs.annotate(step_index=Window(DenseRank(), order_by=F("step").asc()))
              .annotate(offset=ExpressionWrapper((F("step_index") - 1) % stride, output_field=IntegerField()))
              .filter(Q(offset=0) | Q(step=agg["last"])))
    return _metric_dicts(picked.order_by("step", "rank", "attempt_id")), True


def job_snapshot(job_id: int, *, max_points: int = 4000) -> dict:
    """What a job socket sends first: the job, its charts' window, logs, events, checkpoints."""
    job = Job.objects.prefetch_related("attempts__allocations__node").select_related("owner").get(pk=job_id)
    samples, downsampled = metric_window(job_id, max_points=max_points)
    return {
        "type": "snapshot", "job": JobSerializer(job).data, "samples": samples, "downsampled": downsampled,
        "logs": selectors.job_log_lines(job_id, limit=1000),
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
    return {"positions": selectors.queue_positions(),
            "nodes": list(NodeSerializer(Node.objects.order_by("name"), many=True).data)}


def _cluster_jobs(user, positions: dict) -> dict:
    visible = selectors.jobs_visible_to(user)
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
