"""Closed-loop adaptation (`adapt: auto`), pure: which plan an attempt that ran out of memory
restarts with, whether a restart counts against max_restarts, and whether a job may adapt again.

OOM re-plan. The planner costs every plan the runtime runs on the job's devices (memory for all,
step time for those within the device's memory); the job's adaptation history says which plans
it ran and which of them ran out of memory. The next plan must need less memory than every plan
that ran out (the planner predicted those fit, and they did not: whatever the model missed, the
real limit lies below them) and than the device has, and it is a memory-reducing move from the
plan that failed, ranked by the issue's ladder (in order of what each usually costs):

    0 recompute     activation recompute (the step's forward runs twice; numerics unchanged)
    1 micro-batch   a smaller micro-batch with more accumulation (the global batch unchanged)
    2 zero1         ZeRO-1: the optimizer state sharded over dp
    3 fsdp          FSDP: parameters, gradients and optimizer state sharded
    4 tp            more tensor parallelism (fewer data-parallel replicas)

A candidate's rung is the highest rung of the knobs it changes (recompute with a smaller
micro-batch is rung 1); within a rung the planner's predicted step time decides, then memory. A
move never undoes one already made (recompute stays on, fsdp stays on, tp never shrinks, the
micro-batch never grows); pp is not a memory move here. No candidate left: the closest plan (the
least memory among the untried moves, else among all) and its shortfall against the limit.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

RUNGS = ("recompute", "micro-batch", "zero1", "fsdp", "tp")
PLAN_KEYS = ("dp", "tp", "pp", "micro_batch", "fsdp", "shard_optimizer", "recompute")


@dataclass(frozen=True)
class PlanOption:
    """One plan the planner costed for the job's devices (trainyard/plan row fields)."""

    dp: int
    tp: int
    pp: int
    micro_batch: int
    fsdp: bool
    shard_optimizer: bool
    recompute: str
    memory_gb: float
    step_time_s: float | None = None  # None: over the device's memory, so the planner costed only memory
    schedule: str | None = None

    @property
    def key(self) -> tuple:
        return plan_key(asdict(self))

    def fields(self) -> dict:
        return {k: getattr(self, k) for k in PLAN_KEYS} | ({"schedule": self.schedule} if self.pp > 1 else {})


def plan_key(plan: Mapping) -> tuple:
    """The identity of a plan over PLAN_KEYS (recompute "none" when absent)."""
    return (int(plan["dp"]), int(plan["tp"]), int(plan["pp"]), int(plan["micro_batch"]), bool(plan["fsdp"]),
            bool(plan.get("shard_optimizer", False)), str(plan.get("recompute") or "none"))


def describe_plan(plan: Mapping) -> str:
    """"dp 2, micro-batch 4, recompute full, ZeRO-1" for events and messages."""
    parts = [f"dp {plan['dp']}"] + ([f"tp {plan['tp']}"] if plan["tp"] > 1 else []) + (
        [f"pp {plan['pp']}"] if plan["pp"] > 1 else []) + [f"micro-batch {plan['micro_batch']}"]
    if plan.get("recompute", "none") != "none":
        parts.append(f"recompute {plan['recompute']}")
    parts += (["fsdp"] if plan["fsdp"] else []) + (["ZeRO-1"] if plan.get("shard_optimizer") else [])
    return ", ".join(parts)


def rung(current: Mapping, option: PlanOption) -> int | None:
    """The ladder rung of moving from `current` to `option`, or None when it is no memory-reducing
    move (same plan, another pp, or a knob turned back)."""
    cur = plan_key(current)
    new = option.key
    if new == cur or option.pp != int(current["pp"]) or option.tp < int(current["tp"]):
        return None
    if option.micro_batch > int(current["micro_batch"]) or (bool(current["fsdp"]) and not option.fsdp):
        return None
    if str(current.get("recompute") or "none") != "none" and option.recompute != current.get("recompute"):
        return None
    if (bool(current.get("shard_optimizer")) and not option.shard_optimizer and not option.fsdp
            and option.tp == int(current["tp"])):  # ZeRO-1 gives way to fsdp, or to tp (over a smaller dp)
        return None
    changed = [option.recompute != str(current.get("recompute") or "none"),
               option.micro_batch < int(current["micro_batch"]),
               option.shard_optimizer and not current.get("shard_optimizer"),
               option.fsdp and not current["fsdp"], option.tp > int(current["tp"])]
    return max(i for i, c in enumerate(changed) if c)


@dataclass(frozen=True)
class OomDecision:
    choice: PlanOption | None     # the plan to restart with; None: nothing fits
    rung: str | None              # which move it is (RUNGS)
    limit_gb: float               # what the next plan must predict below
    closest: PlanOption | None    # nothing fits: the nearest plan
    shortfall_gb: float | None    # how much more than limit_gb the closest needs
    message: str


def oom_replan(current: Mapping, options: Sequence[PlanOption], *, tried: Iterable[Mapping],
               oomed_memory_gb: Iterable[float], device_memory_gb: float) -> OomDecision:
    """The next plan after `current` (plan fields) ran out of memory. `options`: the planner's
    plans on the same devices; `tried`: every plan the job ran (current included); `oomed_memory_gb`:
    the planner's memory figure for each plan that ran out (current's included, when it has one)."""
    limit = min([float(device_memory_gb), *(float(m) for m in oomed_memory_gb)])
    done = {plan_key(p) for p in tried} | {plan_key(current)}
    moves = [(r, o) for o in options if (r := rung(current, o)) is not None]
    fits = [(r, o) for r, o in moves if o.key not in done and o.memory_gb < limit]
    if fits:
        r, best = min(fits, key=lambda ro: (ro[0], ro[1].step_time_s if ro[1].step_time_s is not None
                                            else float("inf"), ro[1].memory_gb))
        return OomDecision(best, RUNGS[r], limit, None, None,
                           f"{RUNGS[r]}: {describe_plan(best.fields())} (predicted {best.memory_gb:.3g} GB a "
                           f"device, under {limit:.3g} GB)")
    pool = [o for _, o in moves if o.key not in done] or [o for _, o in moves] or list(options)
    if not pool:
        return OomDecision(None, None, limit, None, None,
                           f"no plan on these devices needs less memory than {describe_plan(current)}")
    closest = min(pool, key=lambda o: (o.memory_gb, o.step_time_s or float("inf")))
    short = max(0.0, closest.memory_gb - limit)
    return OomDecision(None, None, limit, closest, round(short, 4),
                       f"no plan on these devices fits: the closest, {describe_plan(closest.fields())}, needs "
                       f"{closest.memory_gb:.3g} GB a device, {short:.3g} GB more than the {limit:.3g} GB "
                       "that ran out")


def may_adapt(adapt: str, adapt_max: int, adaptations: Sequence[Mapping]) -> tuple[bool, str]:
    """(whether the job may adapt once more, why not)."""
    if adapt != "auto":
        return False, "adapt is advise"
    done = sum(1 for a in adaptations if a.get("applied", True))
    if done >= adapt_max:
        return False, f"it has adapted {done} times, its adapt_max"
    return True, ""


def oom_counts_as_restart(current: Mapping, adaptations: Sequence[Mapping]) -> bool:
    """An OOM re-plan is free the first time per plan: it counts against max_restarts only when
    this very plan ran out of memory before (a revert brought it back)."""
    key = plan_key(current)
    return any(a.get("kind") == "oom" and a.get("plan_before") and plan_key(a["plan_before"]) == key
               for a in adaptations)
