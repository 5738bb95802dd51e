"""The knowledge base, pure: what one finished attempt teaches (`extract`), which past records are
nearest a new configuration (`rank_nearest`), and the best measured plan per model shape and
cluster (`best_plans`). Dicts and frozen dataclasses in and out; the services load the samples
and write `KnowledgeRecord` rows, the selectors read them (docs/architecture.md, section 5).

A record's measured step time is the median over the attempt's *warm* steps (its first
WARMUP_STEPS reported steps left out: model build, allocator and autograd warm-up, the first
all-reduce buckets) of the slowest rank's step_s at each step (a step ends for the job when its
last rank finishes). At least MIN_WARM_STEPS warm steps are needed, else nothing is recorded:
fewer say more about start-up noise than about the configuration. Peak memory is the largest
mem_bytes any rank reported at any step (RSS on CPU, torch.cuda.max_memory_allocated on CUDA).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trainyard.mesh import param_count, train_flops

WARMUP_STEPS = 3
MIN_WARM_STEPS = 5
SHAPE_FIELDS = ("kind", "layers", "hidden", "heads", "seq_len", "vocab")
PLAN_FIELDS = ("dp", "tp", "pp", "micro_batch", "fsdp", "shard_optimizer", "recompute", "schedule")
# The dimensions nearest-neighbour distance is measured over (log-ratios: 2x larger is as far as 2x smaller).
DISTANCE_FIELDS = ("layers", "hidden", "seq_len", "global_batch", "world")
# Full activation recompute runs each block's forward twice: 8 x parameters x tokens instead of 6.
RECOMPUTE_FLOPS_FACTOR = {"none": 1.0, "full": 8.0 / 6.0}


@dataclass(frozen=True)
class Measured:
    step_time_s: float
    warm_steps: int
    mem_bytes: int | None
    tokens_per_s_reported: float | None  # the ranks' own tokens_per_s summed, median over warm steps


def measure(samples: Iterable[Mapping]) -> Measured | None:
    """The attempt's measured figures from its metric samples (dicts with rank, step, step_s,
    mem_bytes, tokens_per_s), or None with fewer than MIN_WARM_STEPS warm steps."""
    per_step: dict[int, list[Mapping]] = {}
    peak = None
    for s in samples:
        per_step.setdefault(int(s["step"]), []).append(s)
        mem = s.get("mem_bytes")
        if mem is not None and mem > 0 and (peak is None or mem > peak):
            peak = int(mem)
    steps = sorted(per_step)[WARMUP_STEPS:]
    slowest, tokens = [], []
    for step in steps:
        times = [s["step_s"] for s in per_step[step] if _positive(s.get("step_s"))]
        if times:
            slowest.append(max(times))
        rates = [s["tokens_per_s"] for s in per_step[step] if _positive(s.get("tokens_per_s"))]
        if rates:
            tokens.append(sum(rates))
    if len(slowest) < MIN_WARM_STEPS:
        return None
    return Measured(statistics.median(slowest), len(slowest), peak, statistics.median(tokens) if tokens else None)


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def plan_fields(spec: Mapping, plan: Mapping) -> dict:
    """The plan a job ran under, in the planner's terms (trainyard/plan: dp, tp, pp, micro_batch,
    fsdp, shard_optimizer, recompute, schedule). The job's stored plan (what `parallel: auto`
    resolved to) wins over the spec's `parallel` section; fields older specs lack default to
    recompute "none" and shard_optimizer False. micro_batch: the per-replica batch over
    parallel.microbatches under pp, over train.grad_accum without."""
    par = spec.get("parallel")
    par = par if isinstance(par, Mapping) else {}
    train, res = spec.get("train") or {}, spec.get("resources") or {}
    world = int(res.get("nodes", 1)) * int(res.get("procs_per_node", 1))

    def pick(key, default):
        v = plan.get(key)
        return v if v is not None else par.get(key) if par.get(key) is not None else default

    tp, pp = int(pick("tp", 1)), int(pick("pp", 1))
    dp = int(pick("dp", max(1, world // max(1, tp * pp))))
    per_replica = max(1, int(train.get("global_batch", dp)) // max(1, dp))
    split = int(pick("microbatches", 1)) if pp > 1 else int(train.get("grad_accum", 1))
    micro = plan.get("micro_batch")
    return {"dp": dp, "tp": tp, "pp": pp, "micro_batch": int(micro) if micro else max(1, per_replica // max(1, split)),
            "fsdp": bool(pick("fsdp", False)), "shard_optimizer": bool(pick("shard_optimizer", False)),
            "recompute": str(pick("recompute", "none")), "schedule": str(pick("schedule", "1f1b"))}


def extract(spec: Mapping, plan: Mapping, samples: Iterable[Mapping], *, device_name: str,
            described: Mapping | None = None) -> dict | None:
    """The KnowledgeRecord fields one attempt gives (None when it has too few warm steps, or is a
    user-code job that reported no steps). `spec` is the job's stored JobSpec, `plan` its stored
    plan (its "planner" section: the predicted step_time_s / memory_gb_per_device of the plan
    it runs, chosen by the planner or the user's own). `described`: for user code, the model as
    run.prepare described it (kind "user", layers, hidden, heads, seq_len, vocab, params), so its
    record has a shape the knowledge base can match."""
    m = measure(samples)
    if m is None:
        return None
    # the planner's figures for the plan the job ran (jobs/planning/autoplan.py puts them in plan["planner"])
    predicted = plan.get("planner") or {}
    res, train = spec.get("resources") or {}, spec.get("train") or {}
    nodes, procs = int(res.get("nodes", 1)), int(res.get("procs_per_node", 1))
    world = nodes * procs
    out = {"nodes": nodes, "procs_per_node": procs, "device_name": device_name, "step_time_s": m.step_time_s,
           "warm_steps": m.warm_steps, "mem_bytes": m.mem_bytes,
           "predicted_step_time_s": _number(predicted.get("step_time_s")),
           "predicted_memory_gb": _number(predicted.get("memory_gb_per_device"))}
    model = spec.get("model")
    if spec.get("entrypoint") and isinstance(described, Mapping) and described.get("seq_len"):
        shape = {k: described.get(k) for k in SHAPE_FIELDS}
        gb = int(train.get("global_batch", 1))
        tokens = gb * int(shape["seq_len"])
        params = int(described["params"])
        fields = plan_fields(spec, plan)
        flops = train_flops(params, tokens) * RECOMPUTE_FLOPS_FACTOR.get(fields["recompute"], 1.0)
        return {**out, **shape, "params": params, "global_batch": gb, **fields,
                "tokens_per_s": m.tokens_per_s_reported or tokens / m.step_time_s,
                "tflops_per_device": flops / m.step_time_s / world / 1e12}
    if spec.get("entrypoint") or not isinstance(model, Mapping):
        # the user's own code: no model shape or plan the spec can see; its reported throughput if any
        return {**out, **dict.fromkeys(SHAPE_FIELDS), "params": None, "global_batch": None,
                **dict.fromkeys(PLAN_FIELDS), "dp": world, "tp": 1, "pp": 1,
                "tokens_per_s": m.tokens_per_s_reported, "tflops_per_device": None}
    shape = {k: model.get(k) for k in SHAPE_FIELDS}
    params = param_count(shape["kind"], layers=int(shape["layers"]), hidden=int(shape["hidden"]),
                         seq_len=int(shape["seq_len"]), vocab=int(shape["vocab"]))
    gb = int(train.get("global_batch", 1))
    tokens = gb * int(shape["seq_len"])
    fields = plan_fields(spec, plan)
    flops = train_flops(params, tokens) * RECOMPUTE_FLOPS_FACTOR.get(fields["recompute"], 1.0)
    return {**out, **shape, "params": params, "global_batch": gb, **fields,
            "tokens_per_s": tokens / m.step_time_s, "tflops_per_device": flops / m.step_time_s / world / 1e12}


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured: +0.1 means predicted 10% too high."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


# ---------------------------------------------------------------- nearest records

@dataclass(frozen=True)
class Point:
    """One record as the ranking sees it (selectors build these from KnowledgeRecord rows)."""

    id: int
    layers: int
    hidden: int
    seq_len: int
    global_batch: int
    world: int
    step_time_s: float
    plan: dict = field(default_factory=dict, compare=False, hash=False)
    created: float = 0.0


def distance(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """Euclidean distance over the log-ratios of DISTANCE_FIELDS both sides give (missing: skipped)."""
    total = 0.0
    for k in DISTANCE_FIELDS:
        x, y = a.get(k), b.get(k)
        if x and y:
            total += math.log(float(x) / float(y)) ** 2
    return math.sqrt(total)


def plan_matches(point_plan: Mapping, plan: Mapping | None) -> bool:
    """Whether the record ran the asked plan (only the fields `plan` gives are compared; the
    pipeline schedule only under pp > 1)."""
    if not plan:
        return False
    for k in PLAN_FIELDS:
        if k not in plan or plan[k] is None or (k == "schedule" and int(plan.get("pp", 1) or 1) == 1):
            continue
        if point_plan.get(k) != plan[k]:
            return False
    return True


def point_dims(p: Point) -> dict:
    return {"layers": p.layers, "hidden": p.hidden, "seq_len": p.seq_len, "global_batch": p.global_batch,
            "world": p.world}


def rank_nearest(query: Mapping[str, float], points: Sequence[Point], plan: Mapping | None = None,
                 limit: int = 5) -> list[tuple[Point, float]]:
    """The `limit` points nearest `query` ({layers, hidden, seq_len, global_batch?, world?}), as
    (point, distance): those that ran `plan` first, then by distance, then newest first."""
    scored = [(p, distance(query, point_dims(p))) for p in points]
    scored.sort(key=lambda pd: (not plan_matches(pd[0].plan, plan), pd[1], -pd[0].created, -pd[0].id))
    return scored[:max(0, limit)]


# ---------------------------------------------------------------- best plan per shape and cluster

def best_plans(rows: Iterable[Mapping]) -> list[dict]:
    """The best measured plan per (model shape, global batch, cluster) by tokens/s: rows are
    record dicts (SHAPE_FIELDS, global_batch, nodes, procs_per_node, device_name, PLAN_FIELDS,
    tokens_per_s, step_time_s, tflops_per_device, mem_bytes). Each plan is judged by the median
    over its runs; each answer says how many runs and how many plans were compared."""
    groups: dict[tuple, dict[tuple, list[Mapping]]] = {}
    for r in rows:
        if r.get("kind") is None or not _positive(r.get("tokens_per_s")):
            continue
        where = tuple(r.get(k) for k in (*SHAPE_FIELDS, "global_batch", "nodes", "procs_per_node", "device_name"))
        groups.setdefault(where, {}).setdefault(tuple(r.get(k) for k in PLAN_FIELDS), []).append(r)
    out = []
    for where, plans in groups.items():
        scored = []
        for plan_key, runs in plans.items():
            scored.append((statistics.median(r["tokens_per_s"] for r in runs), plan_key, runs))
        scored.sort(key=lambda s: -s[0])
        tps, plan_key, runs = scored[0]
        out.append({
            **dict(zip((*SHAPE_FIELDS, "global_batch", "nodes", "procs_per_node", "device_name"), where)),
            "plan": dict(zip(PLAN_FIELDS, plan_key)), "tokens_per_s": tps,
            "step_time_s": statistics.median(r["step_time_s"] for r in runs),
            "tflops_per_device": _median_or_none(r.get("tflops_per_device") for r in runs),
            "mem_bytes": max((r["mem_bytes"] for r in runs if r.get("mem_bytes")), default=None),
            "runs": len(runs), "plans_compared": len(scored),
            "runner_up_tokens_per_s": scored[1][0] if len(scored) > 1 else None})
    out.sort(key=lambda b: tuple(str(b[k]) for k in ("device_name", "kind")) + tuple(
        int(b[k] or 0) for k in ("layers", "hidden", "seq_len", "global_batch", "nodes", "procs_per_node")))
    return out


def _median_or_none(values) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None
