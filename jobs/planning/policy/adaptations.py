"""The knowledge base's adaptation outcomes, pure: what one entry of a job's `adaptations` records
(`outcome_fields`), which of the planner's plans ran out of memory before in the same
configuration (`keep_off_oomed`), and which recorded change a new `adapt: auto` job starts with
(`starting_changes`). Dicts and frozen dataclasses in and out; jobs/planning/services/knowledge.py
writes `AdaptationOutcome` rows, jobs/planning/selectors.py reads them.

A configuration is the model shape (SHAPE_FIELDS), the global batch, the world (nodes x
procs_per_node: an elastic job's node count where it ran) and the device type. An outcome speaks
only for its own configuration: a plan that ran out of memory on 2 x 1 CPU processes says nothing
about 4 x 1, nor a compression that paid on one model about another.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jobs.planning.policy.knowledge import SHAPE_FIELDS

OUTCOMES = ("kept", "reverted")
# A plan's identity in an OOM outcome (the pipeline schedule only counts under pp > 1).
PLAN_KEY_FIELDS = ("dp", "tp", "pp", "micro_batch", "fsdp", "shard_optimizer", "recompute")


def config_fields(spec: Mapping, *, nodes: int, procs_per_node: int, device_name: str) -> dict:
    """The configuration columns of an outcome of a job with this stored spec (the shape is null
    for user code: no outcome of such a job is ever matched)."""
    model = spec.get("model") if not spec.get("entrypoint") else None
    model = model if isinstance(model, Mapping) else {}
    shape = {("model_kind" if k == "kind" else k): model.get(k) for k in SHAPE_FIELDS}
    gb = (spec.get("train") or {}).get("global_batch")
    return {**shape, "global_batch": int(gb) if isinstance(gb, int) else None, "nodes": int(nodes),
            "procs_per_node": int(procs_per_node), "device_name": str(device_name)}


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _plan(p) -> dict | None:
    if not isinstance(p, Mapping) or any(not isinstance(p.get(k), int) or isinstance(p.get(k), bool) or p[k] < 1
                                         for k in ("dp", "tp", "pp", "micro_batch")):
        return None
    return {"dp": p["dp"], "tp": p["tp"], "pp": p["pp"], "micro_batch": p["micro_batch"], "fsdp": bool(p.get("fsdp")),
            "shard_optimizer": bool(p.get("shard_optimizer")), "recompute": str(p.get("recompute") or "none"),
            "schedule": str(p["schedule"]) if p["pp"] > 1 and p.get("schedule") else None}


def outcome_fields(spec: Mapping, entry, *, nodes: int, procs_per_node: int, device_name: str,
                   device_memory_gb: float | None = None) -> dict | None:
    """The AdaptationOutcome fields of one `Job.adaptations` entry, or None when it records
    nothing: an OOM entry without a plan that ran out, a bottleneck entry not yet kept or reverted
    (or without a change), any other kind or shape of entry. `device_memory_gb`: the memory of a
    device the attempt ran on (kept with an OOM)."""
    if not isinstance(entry, Mapping):
        return None
    number = entry.get("attempt_number")
    base = {"attempt_number": number if isinstance(number, int) and number >= 0 else None,
            **config_fields(spec, nodes=nodes, procs_per_node=procs_per_node, device_name=device_name)}
    if entry.get("kind") == "oom":
        plan = _plan(entry.get("plan_before"))
        if plan is None:
            return None
        predicted = entry.get("predicted") if isinstance(entry.get("predicted"), Mapping) else {}
        return {**base, "kind": "oom", **plan, "limit_gb": _number(predicted.get("limit_gb")),
                "device_memory_gb": _number(device_memory_gb)}
    if entry.get("kind") == "bottleneck":
        change, before = entry.get("change"), entry.get("before")
        if entry.get("outcome") not in OUTCOMES or not isinstance(change, Mapping) or not change:
            return None
        if not all(isinstance(k, str) for k in change):
            return None
        predicted = entry.get("predicted") if isinstance(entry.get("predicted"), Mapping) else {}
        return {**base, "kind": "bottleneck", "bottleneck_class": str(entry.get("class") or "")[:16],
                "change": dict(change), "before": dict(before) if isinstance(before, Mapping) else {},
                "outcome": entry["outcome"], "measured_gain": _number(entry.get("measured_gain")),
                "predicted_gain": _number(predicted.get("gain")),
                "step_s_before": _number(entry.get("step_s_before")), "step_s_after": _number(entry.get("step_s_after"))}
    return None


# ---------------------------------------------------------------- OOM: plans known to run out

@dataclass(frozen=True)
class OomedPlan:
    """A plan that ran out of memory in this configuration (selectors build these from rows)."""

    job_id: int | None
    attempt_number: int | None
    plan: dict
    limit_gb: float | None
    device_memory_gb: float | None  # the device it ran out on (None: unknown)


def plan_key(plan: Mapping) -> tuple:
    pp = int(plan.get("pp") or 1)
    return (*(plan.get(k) if k != "recompute" else (plan.get(k) or "none") for k in PLAN_KEY_FIELDS),
            (plan.get("schedule") or "1f1b") if pp > 1 else None)


def keep_off_oomed(plans: Sequence[dict], oomed: Sequence[OomedPlan], memory_gb: float) -> tuple[list[dict], list[dict]]:
    """(the plans left, the plans moved out): a planner plan that ran out of memory in this very
    configuration, on a device with no less memory than this one's `memory_gb` (a device with more
    memory now may hold it; unknown: kept off), is moved out with a `reason` naming the job it ran
    out in and `ran_out` (job, attempt, limit_gb, device_memory_gb). The rows are the planner's
    (trainyard/plan), left otherwise as they are."""
    known: dict[tuple, OomedPlan] = {}
    for o in oomed:
        if o.device_memory_gb is None or memory_gb <= o.device_memory_gb * (1 + 1e-6):
            known.setdefault(plan_key(o.plan), o)  # the newest first: name the latest job it ran out in
    kept, moved = [], []
    for p in plans:
        o = known.get(plan_key(p))
        if o is None:
            kept.append(p)
            continue
        where = f"job {o.job_id}" if o.job_id is not None else "a deleted job"
        if o.attempt_number is not None:
            where += f" (attempt {o.attempt_number})"
        limit = f" on a {o.device_memory_gb:.3g} GB device" if o.device_memory_gb is not None else ""
        moved.append({**p, "reason": f"ran out of memory in {where}{limit}, with this model shape, batch and world "
                                     "on this device type: the knowledge base keeps new jobs off it",
                      "ran_out": {"job": o.job_id, "attempt": o.attempt_number, "limit_gb": o.limit_gb,
                                  "device_memory_gb": o.device_memory_gb}})
    return kept, moved


# ---------------------------------------------------------------- bottleneck: changes that paid

_MISSING = object()


def _dotted(spec: Mapping, path: str):
    node = spec
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def change_key(change: Mapping) -> str:
    return json.dumps(change, sort_keys=True, default=str)


def starting_changes(spec: Mapping, outcomes: Sequence[Mapping]) -> list[Mapping]:
    """The recorded bottleneck changes a new job with this stored `spec` may start with, best
    first. `outcomes` are this configuration's (adaptation_outcomes: newest first, dicts with
    change, before, outcome, measured_gain). The newest outcome of each change decides: a change
    whose latest outcome was reverted is never offered. A kept change is offered when the spec
    still has every value it replaced (`before`, which must name each changed path) and does not
    already run it; the newest first."""
    seen: set[str] = set()
    out = []
    for o in outcomes:
        change, before = o.get("change"), o.get("before")
        if not isinstance(change, Mapping) or not change:
            continue
        key = change_key(change)
        if key in seen:
            continue
        seen.add(key)
        if o.get("outcome") != "kept" or not isinstance(before, Mapping) or not set(change) <= set(before):
            continue  # reverted, or not known what it replaced
        if any(_dotted(spec, path) != value for path, value in before.items()):
            continue
        if all(_dotted(spec, path) == value for path, value in change.items()):
            continue
        out.append(o)
    return out
