"""The knowledge base's writes: one `KnowledgeRecord` per ended attempt with enough warm steps
of telemetry (jobs/policy/knowledge.py decides what it says).

Written where the attempt ends (services.attempts, whatever its outcome: a preempted or failed
attempt measured its steps as well as a succeeded one) and refreshed when the relay commits
samples of an attempt that has already ended (ingest: the last steps can reach the database
after the nodes' exit reports). Idempotent: one row per attempt, recomputed from all its
samples each time. A record is a by-product: failing to write one is logged and never fails
the attempt's end or the telemetry batch.
"""
from __future__ import annotations

import logging

from django.db import transaction
from django.db.models import Max, Min

from ..models import Attempt, KnowledgeRecord, MetricSample
from ..policy import knowledge

log = logging.getLogger(__name__)

# Steps of one attempt the median is taken over, newest first: a 100k-step attempt need not
# load every sample to know its steady step time. Peak memory is aggregated over all of them.
WINDOW_STEPS = 2000
SAMPLE_FIELDS = ("rank", "step", "step_s", "mem_bytes", "tokens_per_s")


def device_name(attempt: Attempt, device: str) -> str:
    """The device type the attempt ran on: "cpu", or the name its nodes reported for the CUDA
    devices it was given (the most common one; "cuda" when none reported a name)."""
    if device != "cuda":
        return "cpu"
    names: dict[str, int] = {}
    for alloc in attempt.allocations.select_related("node"):
        devs = [d for d in alloc.node.devices or [] if isinstance(d, dict) and d.get("kind") == "cuda" and d.get("name")]
        used = [d for d in devs if d.get("index") in set(alloc.slot_ids or ())] or devs
        for d in used:
            names[str(d["name"])] = names.get(str(d["name"]), 0) + 1
    return max(names, key=names.get) if names else "cuda"


def attempt_samples(attempt_id: int) -> list[dict]:
    """The attempt's samples for the record: its last WINDOW_STEPS steps, with the peak memory of
    all its steps folded into the first one."""
    qs = MetricSample.objects.filter(attempt_id=attempt_id)
    agg = qs.aggregate(lo=Min("step"), hi=Max("step"), peak=Max("mem_bytes"))
    if agg["hi"] is None:
        return []
    if agg["hi"] - agg["lo"] > WINDOW_STEPS:
        qs = qs.filter(step__gt=agg["hi"] - WINDOW_STEPS)
    rows = list(qs.order_by("step", "rank").values(*SAMPLE_FIELDS))
    if rows and agg["peak"] is not None:
        rows[0] = {**rows[0], "mem_bytes": max(agg["peak"], rows[0]["mem_bytes"] or 0)}
    return rows


def knowledge_record(attempt: Attempt) -> KnowledgeRecord | None:
    """Write (or rewrite) the attempt's record once it has ended; None when it has too few warm
    steps (or is still running). Never raises: a failure is logged."""
    try:
        with transaction.atomic():
            return _record(attempt)
    except Exception:  # a by-product must never fail the attempt's end or the relay's batch
        log.exception("knowledge record for attempt %s not written", attempt.pk)
        return None


def _record(attempt: Attempt) -> KnowledgeRecord | None:
    attempt = Attempt.objects.select_related("job").get(pk=attempt.pk)
    if attempt.status != Attempt.Status.ENDED:
        return None
    job = attempt.job
    spec = job.spec or {}
    fields = knowledge.extract(spec, job.plan or {}, attempt_samples(attempt.pk),
                               device_name=device_name(attempt, (spec.get("resources") or {}).get("device", "cpu")))
    if fields is None:
        return None
    record, _ = KnowledgeRecord.objects.update_or_create(attempt=attempt, defaults={"job": job, **fields})
    return record


def knowledge_refresh(attempt_ids) -> int:
    """Rewrite the records of these attempts that have already ended (the relay committed more of
    their samples after the end); returns how many were written."""
    ended = Attempt.objects.filter(pk__in=list(attempt_ids), status=Attempt.Status.ENDED)
    return sum(knowledge_record(a) is not None for a in ended)
