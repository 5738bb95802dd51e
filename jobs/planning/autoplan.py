"""Planning a JobSpec on this cluster: `parallel: auto` at submit, and the submit page's live
preview (POST /api/v1/plan/ with {"spec": ...}), which plan alike so the preview is what a submit
gets.

The request is the spec's built-in GPT on its resources (trainyard/plan/job.py), with the device
facts of this cluster: a CUDA job gets the name and memory the nodes' agents report for their
GPUs; a CPU job a slot's share of a node's memory (TRAINYARD_CPU_DEVICE_MEMORY_GB) and the peak the
newest calibration measured. The constants are the newest calibration of that device type, else
the defaults (jobs/planning/constants.py constants_for). The search is restricted to what the runtime runs.

At submit, the best plan is written into the stored spec (its `parallel` section and, for pp = 1,
`train.grad_accum`; for pp > 1 `parallel.microbatches`) so that restarts, rollbacks and the runtime
see a concrete plan, and the job's `plan.auto` keeps what the page shows: the chosen plan with its
predicted step time, memory and TFLOP/s, and the runners-up with why each lost. An MLP is not
searched (the cost model is a transformer's): it runs data parallel over every process, as before.
"""
from __future__ import annotations

import statistics

from django.conf import settings

from trainyard.spec import JobSpec, SpecError

from jobs.planning import selectors as planning_selectors
from jobs.models import Node
from jobs.planning.policy import adaptations, knowledge, planner
from jobs.planning.constants import constants_for, peak_for
from trainyard.plan.inputs import PlanInputError
from trainyard.plan.choice import nothing_fits, runners_up
from trainyard.plan.job import KIND_DEFAULTS, plan_for_job, spec_parallel

# The knowledge base's correction of the model: the median of measured / predicted over the nearest
# records that had a prediction, bounded (a handful of odd runs must not turn the model upside down).
KNOWLEDGE_RECORDS = 5
SCALE_BOUNDS = (0.2, 5.0)


def device_facts(kind: str) -> dict:
    """What the planner needs to know of one device of `kind` on this cluster that the spec does
    not say: {name, memory_gb[, peak_tflops]}."""
    facts = {"name": "cuda", "memory_gb": float(KIND_DEFAULTS["cuda"]["memory_gb"])} if kind == "cuda" else {
        "name": "cpu", "memory_gb": float(settings.TRAINYARD_CPU_DEVICE_MEMORY_GB)}
    if kind == "cuda":
        for devices in Node.objects.exclude(status=Node.Status.LOST).values_list("devices", flat=True):
            gpu = next((d for d in devices or () if d.get("kind") == "cuda" and d.get("memory_bytes")), None)
            if gpu:
                facts = {"name": str(gpu.get("name") or "cuda"), "memory_gb": gpu["memory_bytes"] / 1e9}
                break
    peak = peak_for(facts["name"])  # the calibrated efficiencies are relative to the calibrated peak
    if peak:
        facts["peak_tflops"] = peak
    return facts


def user_model_inputs(spec: JobSpec) -> dict:
    """What run.prepare plans a user's own model with under `parallel: auto` (trainyard/sdk/
    autoplan.py), carried to the ranks in each Launch: this cluster's device facts for the job's
    device and the newest calibration's constants (the defaults when there is none)."""
    facts = device_facts(spec.resources.device)
    constants = constants_for(facts["name"])
    return {"device": {**KIND_DEFAULTS.get(spec.resources.device, KIND_DEFAULTS["cuda"]), **facts},
            "constants": constants.to_dict()}


def plan_spec(spec: JobSpec) -> dict:
    """The planner's document for a validated spec (built-in GPT): its plans and rejected count,
    the runners-up, the constants' source, and when nothing fits the smallest shortfall. With an
    explicit `parallel` section, `spec_plan` is the planner's view of that very plan."""
    stored = spec.to_json()
    facts = device_facts(spec.resources.device)
    constants = constants_for(facts["name"])
    doc = plan_for_job(spec, constants, device=facts)
    learned = prefer_measured(doc["plans"], stored, facts["name"])
    memory_gb = facts["memory_gb"]
    plans, ran_out = keep_off_oomed(doc["plans"], stored, facts)
    learned["ran_out"] = len(ran_out)
    rejected = ran_out + doc["rejected"]
    out = {"plans": plans, "rejected": rejected[:20], "rejected_count": len(rejected),
           "constants_source": constants.source, "device": facts, "runners_up": [], "shortfall": None,
           "knowledge": learned}
    if plans:
        out["runners_up"] = runners_up(plans, doc["rejected"], memory_gb)
    else:
        out["shortfall"] = _shortfall(doc["rejected"], ran_out, memory_gb)
    if spec.parallel != "auto":
        out["spec_plan"] = _spec_plan(stored, {**stored["parallel"], "dp": spec.dp}, plans)
    return out


def _shortfall(rejected: list[dict], ran_out: list[dict], memory_gb: float) -> str:
    if not ran_out:
        return nothing_fits(rejected, memory_gb)
    why = f"{len(ran_out)} plan(s) the model fits ran out of memory here before (the latest: {ran_out[0]['reason']})"
    return f"{nothing_fits(rejected, memory_gb)}; {why}" if rejected else f"no plan is left to try: {why}"


def _spec_plan(stored: dict, par: dict, plans: list[dict]) -> dict | None:
    """The plan among `plans` that is the spec's own parallel section, if the planner found it."""
    gb, accum = stored["train"]["global_batch"], stored["train"].get("grad_accum", 1)
    res = stored["resources"]
    dp = par.get("dp") or res["nodes"] * res["procs_per_node"] // (par.get("tp", 1) * par.get("pp", 1))
    m = par.get("microbatches", 1) if par.get("pp", 1) > 1 else accum
    want = {"dp": dp, "tp": par.get("tp", 1), "pp": par.get("pp", 1), "fsdp": bool(par.get("fsdp")),
            "shard_optimizer": bool(par.get("shard_optimizer")), "recompute": par.get("recompute", "none"),
            "micro_batch": gb // dp // max(1, m)}
    if want["pp"] > 1:
        want["schedule"] = par.get("schedule", "1f1b")
    return next((p for p in plans if all(p.get(k) == v for k, v in want.items())), None)


def resolve_auto(spec: JobSpec) -> tuple[JobSpec, dict]:
    """(a new JobSpec running the best plan, the `auto` section of the job's plan) for a spec with
    `parallel: auto`. SpecError naming the smallest shortfall when no plan fits."""
    try:
        doc = plan_spec(spec)
    except PlanInputError as exc:  # a shape the planner cannot split (the spec's rules allowed it)
        raise SpecError({f"model.{k.split('.', 1)[-1]}" if k.startswith("model") else "parallel": v
                         for k, v in exc.errors.items()}) from exc
    if not doc["plans"]:
        raise SpecError({"parallel": [doc["shortfall"]]})
    best = doc["plans"][0]
    par, accum = spec_parallel(best, spec.train.global_batch)
    # The planner's plan must be a valid spec like any other (its rules are the runtime's).
    resolved = spec.with_parallel(par, accum)
    flops = best["tflops_per_device"] * 1e12 * best["step_time_s"] * spec.resources.world_size
    auto = {"chosen": best, "runners_up": doc["runners_up"], "candidates": len(doc["plans"]),
            "searched": len(doc["plans"]) + doc["rejected_count"], "constants_source": doc["constants_source"],
            "device": doc["device"], "flops_per_step": flops, "knowledge": doc["knowledge"]}
    return resolved, auto


PREDICTED = ("step_time_s", "memory_gb_per_device", "tflops_per_device", "bubble_fraction")


def predicted(p: dict, constants_source: str) -> dict:
    """The figures of plan row `p` a job keeps as plan["planner"]."""
    return {**{k: p[k] for k in PREDICTED}, "constants_source": constants_source}


def predict_spec(spec: JobSpec) -> dict | None:
    """The planner's figures for the plan a concrete GPT spec runs (the job's plan["planner"];
    the knowledge base compares them with what the attempt measured), None when the planner does
    not find that plan among the runtime's (a shape it cannot split, or one that does not fit)."""
    try:
        doc = plan_spec(spec)
    except PlanInputError:
        return None
    mine = doc.get("spec_plan")
    if not mine:
        return None
    return predicted(mine, doc["constants_source"])


def replanned(plan: dict, spec: JobSpec) -> dict:
    """The job's stored plan once it runs `spec` instead (an applied recommendation, an automatic
    adaptation): the plan described anew and, for a built-in GPT, the planner's prediction of it.
    `replanned` marks that the plan is no longer the planner's pick: an elastic job keeps it on
    every node count instead of being planned again for each (jobs/attempts/services/elastic.py)."""
    stored = spec.to_json()
    if spec.parallel != "auto" and not spec.resources.elastic:
        stored["parallel"]["dp"] = spec.dp
    out = {**plan, **planner.describe(stored), "replanned": True}
    if spec.model is not None and spec.model.kind == "gpt":
        out["planner"] = predict_spec(spec)
    return out


def keep_off_oomed(plans: list[dict], stored: dict, facts: dict) -> tuple[list[dict], list[dict]]:
    """(plans, plans moved out): the knowledge base's OOM outcomes (issue 24) move out each plan
    that ran out of memory on this device type for this very shape, batch and world
    (jobs/planning/policy/adaptations.py keep_off_oomed), so a new auto job does not start on it."""
    m, res = stored["model"], stored["resources"]
    shape = {**{k: m.get(k) for k in knowledge.SHAPE_FIELDS}, "global_batch": stored["train"]["global_batch"]}
    cluster = {"nodes": res["nodes"], "procs_per_node": res["procs_per_node"], "device": {"name": facts["name"]}}
    return adaptations.keep_off_oomed(plans, planning_selectors.oomed_plans(shape, cluster), facts["memory_gb"])


def _same_plan(record, p: dict) -> bool:
    keys = [k for k in knowledge.PLAN_FIELDS if k != "schedule" or p["pp"] > 1]
    return all(getattr(record, k) == p.get(k) for k in keys)


def prefer_measured(plans: list[dict], stored: dict, device_name: str) -> dict:
    """The knowledge base over the model (issue 13 section 4), in place: a plan this cluster ran
    for this very shape, batch and world takes the median step time it measured; every other plan
    is the model's prediction scaled by how the model erred on the nearest measured runs. Plans
    are re-sorted; each keeps `model_step_time_s` and says its `step_time_source`."""
    m, res = stored["model"], stored["resources"]
    shape = {**{k: m[k] for k in knowledge.SHAPE_FIELDS if k in m}, "global_batch": stored["train"]["global_batch"]}
    cluster = {"nodes": res["nodes"], "procs_per_node": res["procs_per_node"], "device": {"name": device_name}}
    near = planning_selectors.knowledge_nearest(shape, cluster, limit=50)
    ratios = [r.step_time_s / r.predicted_step_time_s for r in near[:KNOWLEDGE_RECORDS]
              if r.predicted_step_time_s and r.step_time_s]
    scale = min(max(statistics.median(ratios), SCALE_BOUNDS[0]), SCALE_BOUNDS[1]) if ratios else 1.0
    exact = [r for r in near if r.distance == 0 and r.heads == m.get("heads") and r.vocab == m.get("vocab")]
    measured_plans = 0
    for p in plans:
        runs = [r.step_time_s for r in exact if _same_plan(r, p)]
        model_s = p["step_time_s"]
        p["model_step_time_s"] = model_s
        if runs:
            p["step_time_s"], p["step_time_source"], p["measured_runs"] = statistics.median(runs), "measured", len(runs)
            p["explain"] += (f" Measured on this cluster: {p['step_time_s']:.4g} s a step over {len(runs)} "
                             f"run{'s' if len(runs) > 1 else ''} (the model said {model_s:.4g} s).")
            measured_plans += 1
        else:
            p["step_time_s"] = model_s * scale
            p["step_time_source"] = "model" if scale == 1.0 else f"model x {scale:.2f} (nearest measured runs)"
        p["tflops_per_device"] = round(p["tflops_per_device"] * model_s / p["step_time_s"], 4)
    plans.sort(key=lambda p: p["step_time_s"])
    return {"records": len(near), "scale": round(scale, 4), "scale_from": len(ratios),
            "measured_plans": measured_plans}
