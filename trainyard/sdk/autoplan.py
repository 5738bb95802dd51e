"""`parallel: auto` for a user's own model: run.prepare describes the model (prepare.describe) and
plans it here with the control plane's planner (trainyard/plan) and the inputs the control plane
put in the launch config at submit (`planner`: this cluster's device facts and the newest
calibration's constants for the job's device; the defaults when absent). Every rank computes the
same plan from the same inputs, so no rank has to tell the others.

The search is restricted to what run.prepare applies to a user's model: the plan as a concrete
spec passes trainyard.spec's rules (no pp, no ZeRO-1 under tp, ...), and a tp plan only where
tensorpar.py can split this model (`tp_ok`). The best plan becomes the run's spec (its `parallel`
section and `train.grad_accum`); the document of the choice (the chosen plan with its predicted
step time, memory and TFLOP/s, the runners-up with why each lost) goes in rank 0's rank_plan
event, and the job page shows it as it does for a built-in job planned at submit. No torch here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from trainyard.plan.choice import nothing_fits, runners_up
from trainyard.plan.constants import DEFAULT_CPU, DEFAULT_GPU, DeviceConstants
from trainyard.plan.inputs import PlanInputError, parse_plan_request
from trainyard.plan.job import KIND_DEFAULTS, runtime_supports, spec_parallel
from trainyard.plan.search import plan

from .config import ConfigError

if TYPE_CHECKING:
    from trainyard.spec import JobSpec

CHOSEN = ("dp", "tp", "pp", "micro_batch", "fsdp", "shard_optimizer", "recompute", "step_time_s",
          "memory_gb_per_device", "tflops_per_device", "explain")


def constants_of(inputs: dict | None, kind: str) -> DeviceConstants:
    """The DeviceConstants the launch config carries (dataclasses.asdict form), else the default."""
    raw = (inputs or {}).get("constants")
    if not raw:
        return DEFAULT_CPU if kind == "cpu" else DEFAULT_GPU
    try:
        return DeviceConstants.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"launch config planner.constants: {exc}") from None


TIE = 0.03  # predicted step times this close are within the cost model's error: a tie


def moving_parts(p: dict) -> tuple:
    """What a plan adds to plain DDP of whole micro-batches, fewest first."""
    return (bool(p["fsdp"]), p["tp"] > 1, bool(p["shard_optimizer"]), p["recompute"] != "none", -p["micro_batch"])


def by_preference(plans: list[dict]) -> list[dict]:
    """The planner's plans (fastest predicted first) with the pick first: among the plans predicted
    within TIE of the fastest, the one with the fewest moving parts (bench/auto_user.py measured
    ZeRO-1 and FSDP of a small model 2-3x slower than plain DDP at predictions 1% apart)."""
    fastest = plans[0]["step_time_s"]
    pick = min((p for p in plans if p["step_time_s"] <= fastest * (1 + TIE)), key=moving_parts)
    return [pick] + [p for p in plans if p is not pick]


def _tie(runner: dict, pick: dict) -> dict:
    t = runner["step_time_s"]
    if t is not None and t < pick["step_time_s"]:
        return {**runner, "why": f"predicted {(1 - t / pick['step_time_s']) * 100:.1f}% faster ({t:.4g} s vs "
                                 f"{pick['step_time_s']:.4g} s), within the model's {TIE:.0%} error: a tie, "
                                 f"and it has more moving parts"}
    return runner


def _request(description: dict, *, nodes: int, per_node: int, kind: str, global_batch: int,
             inputs: dict | None) -> dict:
    facts = {**KIND_DEFAULTS.get(kind, KIND_DEFAULTS["cuda"]), **((inputs or {}).get("device") or {})}
    return {
        "model": {"layers": description["layers"], "hidden": description["hidden"],
                  "heads": description.get("heads") or 1, "seq_len": description["seq_len"],
                  "vocab": description.get("vocab") or 1},
        "cluster": {"nodes": nodes, "devices_per_node": per_node,
                    "device": {"name": str(facts.get("name", kind)), "memory_gb": float(facts["memory_gb"]),
                               "peak_tflops": float(facts["peak_tflops"])},
                    "intra_node_gbs": float(facts["intra_node_gbs"]), "inter_node_gbs": float(facts["inter_node_gbs"])},
        "global_batch": global_batch,
        "precision": "fp32" if kind == "cpu" else "bf16",
    }


def request(spec: JobSpec, description: dict, inputs: dict | None) -> dict:
    """The planner request for the described model on the job's resources."""
    res = spec.resources
    return _request(description, nodes=res.nodes, per_node=res.procs_per_node, kind=res.device,
                    global_batch=spec.train.global_batch, inputs=inputs)


def standalone_request(description: dict, *, world: int, device: str, global_batch: int) -> dict:
    """A standalone run's model as a `trainyard plan` request (POST /api/v1/plan/): this machine's
    world as one node with the default device facts, to be edited to the cluster it will run on;
    pp fixed at 1 (run.prepare has no pipeline stages)."""
    kind = "cpu" if device == "cpu" else "cuda"
    return {**_request(description, nodes=1, per_node=world, kind=kind, global_batch=global_batch, inputs=None),
            "fix": {"pp": 1}}


def plan_user_model(spec: JobSpec, description: dict, inputs: dict | None,
                    tp_ok: Callable[[int], bool]) -> tuple[JobSpec, dict]:
    """(the spec running the best plan, the choice's document) for `spec` with parallel auto and
    the model `description`; ConfigError with the closest plan's shortfall when nothing fits."""
    try:
        req = parse_plan_request(request(spec, description, inputs))
    except PlanInputError as exc:
        raise ConfigError(f"parallel auto cannot plan this model ({exc}): give the job a parallel section") from None
    constants = constants_of(inputs, spec.resources.device)

    def runnable(c: Any) -> bool:
        return c.pp == 1 and runtime_supports(spec, c) and (c.tp == 1 or tp_ok(c.tp))

    doc = plan(req, constants, runnable=runnable)
    memory_gb = req.cluster.device.memory_gb
    if not doc["plans"]:
        raise ConfigError(f"parallel auto: {nothing_fits(doc['rejected'], memory_gb)}")
    plans = by_preference(doc["plans"])
    best = plans[0]
    par, accum = spec_parallel(best, spec.train.global_batch)
    resolved = spec.with_parallel(par, accum)
    flops = best["tflops_per_device"] * 1e12 * best["step_time_s"] * spec.resources.world_size
    auto = {"chosen": {k: best[k] for k in CHOSEN if k in best},
            "runners_up": [_tie(r, best) for r in runners_up(plans, doc["rejected"], memory_gb)],
            "candidates": len(doc["plans"]), "searched": len(doc["plans"]) + len(doc["rejected"]),
            "constants_source": constants.source[:500], "flops_per_step": flops}
    return resolved, auto
