"""The knowledge base's writes: one `KnowledgeRecord` per ended attempt with enough warm steps
of telemetry (jobs/planning/policy/knowledge.py decides what it says).

Written where the attempt ends (services.attempts, whatever its outcome: a preempted or failed
attempt measured its steps as well as a succeeded one) and refreshed when the relay commits
samples of an attempt that has already ended (ingest: the last steps can reach the database
after the nodes' exit reports). Idempotent: one row per attempt, recomputed from all its
samples each time. A record is a by-product: failing to write one is logged and never fails
the attempt's end or the telemetry batch.

`knowledge_adaptation` records what one automatic adaptation taught (an `AdaptationOutcome` per
entry of `Job.adaptations`: an OOM at once, a bottleneck change once it was kept or reverted;
jobs/planning/policy/adaptations.py says what), under the same rule: logged, never raised.
"""
from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction

from jobs.models import AdaptationOutcome, Attempt, Job, KnowledgeRecord, MetricStep
from jobs.planning.policy import adaptations, knowledge

log = logging.getLogger(__name__)

# Steps of one attempt the median is taken over, the newest: a 100k-step attempt need not read
# every sample to know its steady step time. Peak memory over them too (on CUDA each sample
# already carries the peak so far; on CPU the resident size settles after the first steps).
WINDOW_STEPS = 1000


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


def device_memory_gb(attempt: Attempt | None, device: str) -> float | None:
    """The memory of one device the attempt ran on, as the planner counts it: a CPU slot's share
    (TRAINYARD_CPU_DEVICE_MEMORY_GB), or the smallest memory its nodes reported for the CUDA
    devices it was given (None when none reported one)."""
    if device != "cuda":
        return float(settings.TRAINYARD_CPU_DEVICE_MEMORY_GB)
    sizes = []
    for alloc in attempt.allocations.select_related("node") if attempt is not None else ():
        devs = [d for d in alloc.node.devices or [] if isinstance(d, dict) and d.get("kind") == "cuda"
                and isinstance(d.get("memory_bytes"), (int, float))]
        used = [d for d in devs if d.get("index") in set(alloc.slot_ids or ())] or devs
        sizes += [d["memory_bytes"] / 1e9 for d in used]
    return min(sizes) if sizes else None


def attempt_steps(attempt: Attempt) -> list[dict]:
    """Per step of the attempt's last WINDOW_STEPS, from its per-step rows (MetricStep: one row per
    step whatever the world size, kept for the job's life): the slowest rank's step_s (step_s_max),
    the ranks' tokens_per_s summed (mean x count) and their largest mem_bytes, in the shape
    jobs/planning/policy/knowledge.measure takes samples."""
    qs = MetricStep.objects.filter(attempt_id=attempt.pk)  # the unique (attempt, step) index
    if attempt.last_step > WINDOW_STEPS:
        qs = qs.filter(step__gt=attempt.last_step - WINDOW_STEPS)
    rows = qs.order_by("step").values_list("step", "step_s_max", "tokens_per_s_mean", "tokens_per_s_n",
                                           "mem_bytes_max")
    return [{"step": step, "step_s": slowest, "tokens_per_s": None if mean is None else mean * n,
             "mem_bytes": None if peak is None else int(peak)} for step, slowest, mean, n, peak in rows]


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
    described = next((p["model"] for p in (attempt.rank_plans or {}).values()
                      if isinstance(p, dict) and isinstance(p.get("model"), dict)), None)  # run.prepare's
    fields = knowledge.extract(spec, job.plan or {}, attempt_steps(attempt), described=described,
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


def knowledge_adaptation(job: Job, attempt: Attempt | None, entry) -> AdaptationOutcome | None:
    """Record one entry of `job.adaptations` (the attempt it adapted: its node count and device
    type are the configuration's), or None when the entry records nothing (policy.adaptations.
    outcome_fields). One row per entry (job, kind, attempt number and, for a bottleneck, its
    change): recording an entry again rewrites it (a change recorded kept, later reverted). Never raises: a failure is logged (the caller's adaptation goes on)."""
    try:
        with transaction.atomic():
            return _adaptation(job, attempt, entry)
    except Exception:  # a by-product must never fail the adaptation that reports it
        log.exception("adaptation outcome of job %s not recorded", getattr(job, "pk", None))
        return None


def _adaptation(job: Job, attempt: Attempt | None, entry) -> AdaptationOutcome | None:
    spec = job.spec or {}
    res = spec.get("resources") or {}
    device = res.get("device", "cpu")
    nodes = (attempt.allocations.count() if attempt is not None else 0) or int(res.get("nodes", 1))
    fields = adaptations.outcome_fields(
        spec, entry, nodes=nodes, procs_per_node=int(res.get("procs_per_node", 1)),
        device_name=device_name(attempt, device) if attempt is not None else "cpu" if device == "cpu" else "cuda",
        device_memory_gb=device_memory_gb(attempt, device))
    if fields is None:
        return None
    same = [] if fields["attempt_number"] is None else [
        r for r in AdaptationOutcome.objects.filter(job=job, kind=fields["kind"], attempt_number=fields["attempt_number"])
        if fields["kind"] == "oom" or r.change == fields["change"]]  # an attempt ends in one OOM
    if not same:
        return AdaptationOutcome.objects.create(job=job, **fields)
    AdaptationOutcome.objects.filter(pk=same[0].pk).update(**fields)
    same[0].refresh_from_db()
    return same[0]
