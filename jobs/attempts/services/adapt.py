"""Re-planning a job whose attempt ran out of memory (`adapt: auto`; jobs/attempts/policy/adapt.py
decides): the planner costs every plan the runtime runs on the job's devices, the policy picks
the next one that needs less memory, and the job goes back to the queue with it, resuming from
its latest checkpoint. Called by services.attempts when an attempt ends `failed:oom`; True when
it moved the job on (re-planned, or failed with the closest plan and its shortfall), False to let
today's path (fail with a suggestion) handle it.

Each adaptation is an entry of `Job.adaptations` and an "adapted" timeline event: the evidence
(the OOM text), the plan before and after, the changed spec fields, and the planner's predicted
memory and step time of both plans, and the step time the failed attempt measured (if it got that
far). The first OOM of a plan does not count against max_restarts.
"""
from __future__ import annotations

import logging

from django.utils import timezone

from jobs.attempts.policy import adapt as policy
from jobs.attempts.services.checkpoints import checkpoints_reconcile, resume_checkpoint
from jobs.attempts.services.events import job_event, job_set_status
from jobs.models import Attempt, Job
from jobs.planning import autoplan
from jobs.planning.services.knowledge import knowledge_adaptation
from jobs.planning.policy.knowledge import plan_fields
from trainyard.plan.inputs import PlanInputError
from trainyard.plan.job import spec_parallel
from trainyard.spec import JobSpec, SpecError, parse_job_spec

log = logging.getLogger(__name__)

SPEC_FIELDS = ("parallel.tp", "parallel.dp", "parallel.fsdp", "parallel.shard_optimizer", "parallel.recompute",
               "parallel.microbatches", "train.grad_accum")


def current_plan(spec: dict) -> dict:
    """The plan a stored spec runs, in the planner's terms (policy.PLAN_KEYS)."""
    return {k: v for k, v in plan_fields(spec, {}).items() if k in policy.PLAN_KEYS}


def planner_options(spec) -> tuple[list[policy.PlanOption], float]:
    """Every plan the planner costed for a validated spec's devices (those within the device's
    memory with their step time, the nearest misses with their memory) and the device's memory."""
    doc = autoplan.plan_spec(spec)
    rows = [(r, r.get("step_time_s")) for r in doc["plans"]] + [(r, None) for r in doc["rejected"]]
    options = [policy.PlanOption(dp=r["dp"], tp=r["tp"], pp=r["pp"], micro_batch=r["micro_batch"], fsdp=r["fsdp"],
                                 shard_optimizer=r["shard_optimizer"], recompute=r["recompute"],
                                 memory_gb=r["memory_gb_per_device"], step_time_s=t, schedule=r.get("schedule"))
               for r, t in rows]
    return options, float(doc["device"]["memory_gb"])


def _dotted(spec: dict, path: str):
    for part in path.split("."):
        if not isinstance(spec, dict) or part not in spec:
            return None
        spec = spec[part]
    return spec


def _attempt_world(parsed: JobSpec, attempt: Attempt) -> JobSpec:
    """The spec the attempt ran, as a fixed-size job the planner can cost: an elastic job's on the
    node count it had (where it ran out)."""
    if not parsed.resources.elastic:
        return parsed
    data = parsed.to_json()
    nodes = attempt.allocations.count() or parsed.resources.nodes
    return parse_job_spec({**data, "resources": {**data["resources"], "nodes": nodes, "min_nodes": None}})


def _replanned_spec(parsed: JobSpec, choice: policy.PlanOption) -> dict:
    """The job's stored spec running `choice` (its micro-batch at the world it was planned for):
    a fixed job's dp is written down; an elastic job's stays unset and follows the count, with
    the same accumulation. SpecError when the spec rules refuse it."""
    par, accum = spec_parallel(choice.fields(), parsed.train.global_batch)
    if parsed.resources.elastic:
        par["dp"] = None
    new = parsed.with_parallel(par, accum)  # the planner kept only what the spec rules run
    new_spec = new.to_json()
    new_spec["parallel"]["dp"] = None if parsed.resources.elastic else new.dp
    return new_spec


def adapt_after_oom(job: Job, attempt: Attempt, failure: dict) -> bool:
    """Re-plan `job` after `attempt` ended `failed:oom` (inside the attempt's end transaction)."""
    spec = job.spec
    if failure.get("class") != "oom" or spec.get("adapt") != "auto" or spec.get("entrypoint"):
        return False
    history = list(job.adaptations or [])
    ok, why = policy.may_adapt(spec["adapt"], int(spec.get("adapt_max", 3)), history)
    if not ok:
        job_event(job, "adapt_skipped", f"not re-planned after the OOM: {why}", attempt=attempt, reason=why)
        return False
    try:
        parsed = parse_job_spec(spec)
        world = _attempt_world(parsed, attempt)
        options, device_gb = planner_options(world)
    except (SpecError, PlanInputError) as exc:
        log.warning("job %s: no re-plan after OOM: %s", job.pk, exc)
        return False
    current = current_plan(world.to_json())
    memory = {o.key: o for o in options}
    oomed = [a["plan_before"] for a in history if a.get("kind") == "oom"] + [current]
    tried = [p for a in history for p in (a.get("plan_before"), a.get("plan_after")) if p]
    decision = policy.oom_replan(current, options, tried=tried, device_memory_gb=device_gb,
                                 oomed_memory_gb=[memory[policy.plan_key(p)].memory_gb for p in oomed
                                                  if policy.plan_key(p) in memory])
    evidence = (failure.get("message") or "")[:2000]
    if decision.choice is None:
        why = f"ran out of memory ({evidence[:200]}); {decision.message}"
        job_set_status(job, Job.ACTIVE, Job.Status.FAILED, why[:500])
        job_event(job, "failed", why, attempt=attempt, failure_class="oom", evidence=evidence,
                  closest=decision.closest.fields() if decision.closest else None,
                  closest_memory_gb=decision.closest.memory_gb if decision.closest else None,
                  shortfall_gb=decision.shortfall_gb, limit_gb=decision.limit_gb)
        return True
    counted = policy.oom_counts_as_restart(current, history)
    if counted and job.restarts >= int(spec.get("max_restarts", 0)):
        return False  # this plan ran out before and no restarts are left: today's failure
    choice = decision.choice
    try:
        new_spec = _replanned_spec(parsed, choice)
    except SpecError as exc:  # an elastic job's range refuses it (a tp that does not split every count)
        log.warning("job %s: no re-plan after OOM: %s", job.pk, exc)
        return False
    new = parse_job_spec(new_spec)
    before_opt = memory.get(policy.plan_key(current))
    checkpoints_reconcile(job)
    point = resume_checkpoint(job)
    entry = {
        "kind": "oom", "attempt_number": attempt.number, "at": timezone.now().isoformat(), "rung": decision.rung,
        "evidence": evidence, "plan_before": current, "plan_after": choice.fields(),
        "before": {k: _dotted(spec, k) for k in SPEC_FIELDS if _dotted(spec, k) != _dotted(new_spec, k)},
        "after": {k: _dotted(new_spec, k) for k in SPEC_FIELDS if _dotted(spec, k) != _dotted(new_spec, k)},
        "predicted": {"memory_gb_before": before_opt.memory_gb if before_opt else None,
                      "memory_gb_after": choice.memory_gb,
                      "step_time_s_before": before_opt.step_time_s if before_opt else None,
                      "step_time_s_after": choice.step_time_s, "limit_gb": decision.limit_gb},
        "step_s_before": (attempt.profile.get("window") or {}).get("step_s") if attempt.profile else None,
        "counted": counted, "resume_step": point.step if point else 0}
    origin = f"from the checkpoint at step {point.step}" if point else "from step 0 (no checkpoint yet)"
    text = (f"ran out of memory with {policy.describe_plan(current)}: re-planned to {decision.message}; "
            f"restarting {origin}" + ("" if not counted else
                                      f" (restart {job.restarts + 1} of {spec.get('max_restarts')}: "
                                      "this plan ran out of memory before)"))
    Job.objects.filter(pk=job.pk).update(spec=new_spec, plan=autoplan.replanned(job.plan, new),
                                         adaptations=[*history, entry])
    knowledge_adaptation(job, attempt, entry)  # the next job of this configuration keeps off the plan
    job_set_status(job, Job.ACTIVE, Job.Status.QUEUED, text[:500], avoid_nodes=[],
                   restarts=job.restarts + (1 if counted else 0))
    job_event(job, "adapted", text, attempt=attempt, cause="oom", **{k: v for k, v in entry.items() if k != "kind"})
    return True
