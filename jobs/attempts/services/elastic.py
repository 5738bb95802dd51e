"""Elastic jobs (`resources.nodes: {min, max}`; jobs/scheduling/policy/elastic.py decides the counts):
the spec an attempt on k nodes runs, the node count over time and its `resized` events, and the
restart at once on the surviving nodes after a lost node.

- An attempt on k nodes runs `JobSpec.at_nodes(k)`: dp follows the count, the global batch is
  kept (the per-rank batch adjusts), and the checkpoint it resumes from reshards on load (DCP).
- `Job.node_history` gets one entry per attempt start: its node count and why (the placement's
  reason, or the end of the attempt before it); a start on another count than the attempt
  before (or a first start below the most) is a `resized` event with that reason.
- A lost node does not send an elastic job back to wait for a full gang: `elastic_after_loss`
  queues it to restart at once (`elastic_restart`) on the nodes that survive (the lost one
  avoided), from its latest checkpoint, without counting a restart; the scheduler grows it again
  when nodes free up.
"""
from __future__ import annotations

from django.utils import timezone

from jobs.attempts.services.checkpoints import checkpoints_reconcile, resume_checkpoint
from jobs.attempts.services.events import job_event, job_set_status
from jobs.models import Attempt, Job
from jobs.planning import autoplan
from trainyard.spec import JobSpec, SpecError, parse_job_spec

HISTORY_MAX = 200  # entries kept in Job.node_history (the oldest go first)


def is_elastic(spec: dict) -> bool:
    r = spec.get("resources") or {}
    return r.get("min_nodes") is not None and r["min_nodes"] < r.get("nodes", 0)


def fixed_at(spec: dict, nodes: int, parallel=None) -> JobSpec:
    """The spec as a fixed-size job of `nodes` nodes (with `parallel` instead of its own, if given)."""
    data = {**spec, "resources": {**spec["resources"], "nodes": nodes, "min_nodes": None}}
    if parallel is not None:
        data["parallel"] = parallel
    return parse_job_spec(data)


def spec_at(spec: dict, nodes: int, plan: dict | None = None) -> dict:
    """The stored spec an attempt on `nodes` nodes runs (the job's own when that is its size): a
    job the planner planned (`plan["auto"]`, parallel auto, not re-planned since by an adaptation or
    an applied recommendation) is planned again for that world, any other keeps its plan with dp
    following the count; the global batch is kept either way.
    SpecError when the count cannot run it (submit checks every count: `check_counts`)."""
    if not is_elastic(spec) or nodes == spec["resources"]["nodes"]:
        return spec
    if plan and plan.get("auto") and not plan.get("replanned"):
        try:
            return autoplan.resolve_auto(fixed_at(spec, nodes, "auto"))[0].to_json()
        except SpecError:  # submit found a plan at this count; should the planner's inputs have
            pass           # changed since, keep the job's own plan with dp following
    return parse_job_spec(spec).at_nodes(nodes).to_json()


def check_counts(spec: dict, plan: dict | None) -> None:
    """SpecError naming the first node count of an elastic job's range its attempt could not run on."""
    for k in range(spec["resources"]["min_nodes"], spec["resources"]["nodes"]):
        try:
            spec_at(spec, k, plan)
        except SpecError as exc:
            why = "; ".join(f"{f}: {m}" for f, ms in exc.errors.items() for m in ms)
            raise SpecError({"resources.nodes": [f"an elastic job must run on every count in its range; on {k} "
                                                 f"node(s): {why}"]}) from None


def _previous_count(attempt: Attempt) -> tuple[int | None, Attempt | None]:
    before = attempt.job.attempts.filter(number__lt=attempt.number).order_by("-number").first()
    if before is None:
        return None, None
    return before.allocations.count(), before


def _why(before: Attempt | None, reason: str) -> str:
    if reason and not reason.startswith("restarting at once"):
        return reason
    if before is None:
        return reason or "started"
    if before.stop_reason == "preempt" and before.preempt_reason:
        return before.preempt_reason
    failure = before.failure or {}
    if before.outcome == "lost" or before.stop_reason.startswith("node_lost:"):
        lost = failure.get("node") or before.stop_reason.partition(":")[2] or "?"
        return f"node {lost} was lost; restarted at once on the surviving nodes"
    if failure.get("exclude"):
        return f"attempt {before.number} failed blaming {', '.join(failure['exclude'])}; restarted without them"
    return reason or f"attempt {before.number} ended: {before.outcome}"


def elastic_started(job: Job, attempt: Attempt, nodes: int, reason: str) -> None:
    """Record an elastic job's attempt start on `nodes` nodes (history, and `resized` when the
    count changed), and clear its restart-at-once flag."""
    if not is_elastic(job.spec):
        return
    most = job.spec["resources"]["nodes"]
    count, before = _previous_count(attempt)
    why = _why(before, reason)
    history = list(job.node_history or [])[-(HISTORY_MAX - 1):]
    history.append({"at": timezone.now().isoformat(), "attempt": attempt.number, "nodes": nodes, "reason": why[:300]})
    Job.objects.filter(pk=job.pk).update(node_history=history, elastic_restart=False)
    job.node_history, job.elastic_restart = history, False
    if (count is None and nodes < most) or (count is not None and count != nodes):
        frm = f"from {count} " if count is not None else ""
        job_event(job, "resized", f"attempt {attempt.number} runs on {nodes} of up to {most} node(s) "
                  f"({frm}to {nodes}): {why}", attempt=attempt, nodes=nodes, previous=count, reason=why)


def elastic_after_loss(job: Job, attempt: Attempt, outcome: str, failure: dict) -> bool:
    """An elastic job whose attempt ended `lost`: queue it to restart at once on the surviving
    nodes (the lost one avoided) from its latest checkpoint, not counted against max_restarts.
    False (nothing done) for any other job or outcome."""
    if outcome != "lost" or not is_elastic(job.spec):
        return False
    lost = list(failure.get("exclude") or ([failure["node"]] if failure.get("node") else []))
    checkpoints_reconcile(job)
    point = resume_checkpoint(job)
    origin = f"from the checkpoint at step {point.step}" if point else "from step 0 (no checkpoint yet)"
    text = (f"node {', '.join(lost) or '?'} lost: restarting at once on the surviving nodes "
            f"(at least {job.spec['resources']['min_nodes']}), {origin}")
    if not job_set_status(job, Job.ACTIVE, Job.Status.QUEUED, text[:500], avoid_nodes=lost, elastic_restart=True):
        return True  # another writer moved it first (a cancel): nothing more to do here
    job_event(job, "shrinking", text, attempt=attempt, lost=lost, resume_step=point.step if point else 0,
              checkpoint=point.pk if point else None)
    return True
