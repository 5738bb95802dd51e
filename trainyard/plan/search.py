"""The plan search: every candidate (tp | heads, pp <= layers (uneven stages costed by the largest), dp = devices / (tp*pp), micro-batch
sizes dividing the per-replica batch, fsdp / ZeRO-1 / plain DDP, recompute none / full, GPipe /
1F1B when pp > 1) costed by cost.py; those that fit, best first, and those that do not, with the
reason. tp stays inside a node unless no plan fits that way. `fix` restricts every dimension.

The cost of a request (shape, cluster, precision) is computed once (cost.Ctx); per candidate only
a few arithmetic lines run, memory first, step time only for what fits, so a 1T GPT on 3,072
devices is searched in tens of milliseconds.
"""
from __future__ import annotations

from .constants import DEFAULT_CPU, DEFAULT_GPU, DeviceConstants
from .cost import Candidate, Ctx, MemoryBreakdown, TimeBreakdown, context, memory_ctx, step_time_ctx
from .explain import explain
from .inputs import PlanInputError, PlanRequest, parse_plan_request

GB = 1e9
STRATEGIES = ((False, False), (False, True), (True, False))  # (fsdp, shard_optimizer)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def layouts(req: PlanRequest, x: Ctx, *, cross_node_tp: bool) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) meshes that fill the cluster and split the batch evenly."""
    f = req.fix
    tps = [1] if x.sized_only else divisors(x.heads)
    pps = [1] if x.sized_only else [p for p in divisors(x.devices) if p <= x.layers]
    out = []
    for tp in tps:
        if f.tp is not None and tp != f.tp:
            continue
        if f.tp is None and (tp > x.per_node) != cross_node_tp:
            continue
        if x.per_node % tp and tp % x.per_node:  # a tp group must tile the nodes
            continue
        for pp in pps:
            if (f.pp is not None and pp != f.pp) or x.devices % (tp * pp):
                continue
            dp = x.devices // (tp * pp)
            if (f.dp is not None and dp != f.dp) or x.batch % dp:
                continue
            out.append((dp, tp, pp))
    return out


def families(req: PlanRequest, dp: int, pp: int):
    """(fsdp, shard_optimizer, recompute, schedule) combinations the fix allows for a layout (a
    model given only by size has no activations to recompute)."""
    f = req.fix
    recomputes = ("none",) if req.model.sized_only and f.recompute is None else ("none", "full")
    for fsdp, shard in STRATEGIES:
        if (fsdp or shard) and dp == 1 and not (f.fsdp or f.shard_optimizer):
            continue
        if (f.fsdp is not None and fsdp != f.fsdp) or (f.shard_optimizer is not None and shard != f.shard_optimizer):
            continue
        for rc in recomputes:
            if f.recompute is not None and rc != f.recompute:
                continue
            for sched in (("1f1b", "gpipe") if pp > 1 else ("1f1b",)):
                if f.schedule is None or sched == f.schedule:
                    yield fsdp, shard, rc, sched


def micro_batches(req: PlanRequest, dp: int) -> list[int]:
    """Micro-batch sizes dividing the per-replica batch, ascending."""
    sizes = divisors(req.global_batch // dp)
    return [b for b in sizes if b == req.fix.micro_batch] if req.fix.micro_batch is not None else sizes


def _fields(c: Candidate) -> dict:
    return {"dp": c.dp, "tp": c.tp, "pp": c.pp, "micro_batch": c.micro_batch, "fsdp": c.fsdp,
            "shard_optimizer": c.shard_optimizer, "recompute": c.recompute,
            "schedule": c.schedule if c.pp > 1 else None}


def _evaluate(req, x, k, found, rejected, *, cross_node_tp: bool, runnable) -> None:
    """Memory grows with the micro-batch (activations ~ b x min(p, m) = min(p*b, batch), GPipe's
    b x m is constant, logits ~ b): within a family the first size that does not fit is the
    nearest miss and every larger one misses by more, so the larger ones are not costed."""
    cap = x.memory
    for dp, tp, pp in layouts(req, x, cross_node_tp=cross_node_tp):
        sizes = micro_batches(req, dp)
        for fsdp, shard, rc, sched in families(req, dp, pp):
            for mb in sizes:
                c = Candidate(dp, tp, pp, mb, fsdp, shard, rc, sched)
                if runnable is not None and not runnable(c):
                    continue
                mem = memory_ctx(x, c, k)
                if mem.total > cap:
                    rejected.append((mem.total - cap, c, mem))
                    break
                found.append((step_time_ctx(x, c, k), c, mem))


def _no_candidate(req: PlanRequest, x: Ctx) -> dict[str, list[str]]:
    """Why not one candidate exists (so the caller gets a field error, not an empty answer)."""
    f = req.fix
    rule = (f"no layout fills the {x.devices} devices: tp must divide the {x.heads} heads and tile the "
            f"{x.per_node}-device nodes, pp be at most {x.layers} layers, and dp = devices / (tp*pp) divide "
            f"global_batch {req.global_batch}")
    found = list(_layouts_any(req, x))
    if f.schedule is not None and found and all(pp == 1 for _, _, pp in found):
        return {"fix.schedule": ["a pipeline schedule needs pp > 1, and no layout here has more than one stage"]}
    if f.micro_batch is not None and found:
        return {"fix.micro_batch": [f"micro_batch {f.micro_batch} divides no replica's batch "
                                    f"(global_batch {req.global_batch} / dp)"]}
    if any(getattr(f, k) is not None for k in ("dp", "tp", "pp")):
        return {"fix": [rule + " with the fixed values"]}
    return {"global_batch": [rule]}


def _layouts_any(req: PlanRequest, x: Ctx):
    yield from layouts(req, x, cross_node_tp=False)
    yield from layouts(req, x, cross_node_tp=True)


def search(req: PlanRequest, k: DeviceConstants, runnable=None) -> tuple[Ctx, list, list]:
    """(context, feasible [(time, cand, mem)] best first, rejected [(overshoot, cand, mem)] by
    smallest overshoot). `runnable(candidate) -> bool` drops what the caller cannot run."""
    x = context(req, k)
    found: list = []
    rejected: list = []
    _evaluate(req, x, k, found, rejected, cross_node_tp=False, runnable=runnable)
    if not found and req.fix.tp is None:
        _evaluate(req, x, k, found, rejected, cross_node_tp=True, runnable=runnable)
    if not found and not rejected and runnable is None:
        raise PlanInputError(_no_candidate(req, x))
    found.sort(key=lambda e: (e[0].total_s, e[2].total))
    rejected.sort(key=lambda e: e[0])
    return x, found, rejected


def default_constants(req: PlanRequest) -> DeviceConstants:
    return DEFAULT_CPU if req.cluster.device.name.strip().lower() == "cpu" else DEFAULT_GPU


def plan(req: PlanRequest, constants: DeviceConstants | None = None, *, limit_rejected: int = 200,
         runnable=None) -> dict:
    """DESIGN.md's planner output: {"plans": [every feasible plan, best first], "rejected":
    [the `limit_rejected` nearest misses, each with its reason]}. `runnable(candidate)` (optional)
    restricts the search to what the caller can run (plan_for_job: our runtime)."""
    k = constants or default_constants(req)
    x, found, rejected = search(req, k, runnable)
    best = found[0][0] if found else None
    plans = [plan_entry(x, t, c, m, best) for t, c, m in found]
    out_rej = []
    for _over, c, m in rejected[:limit_rejected]:
        row = _fields(c)
        row["memory_gb_per_device"] = round(m.total / GB, 3)
        row["memory_breakdown_gb"] = _mem_gb(m)
        row["reason"] = f"memory {m.total / GB:.1f} GB > {x.memory / GB:g} GB"
        out_rej.append(row)
    return {"plans": plans, "rejected": out_rej}


def _mem_gb(m: MemoryBreakdown) -> dict:
    return {"params": round(m.params / GB, 3), "grads": round(m.grads / GB, 3), "optimizer": round(m.optimizer / GB, 3),
            "gathered": round(m.gathered / GB, 3), "activations": round(m.activations / GB, 3), "logits": round(m.logits / GB, 3),
            "total": round(m.total / GB, 3)}


def plan_entry(x: Ctx, t: TimeBreakdown, c: Candidate, m: MemoryBreakdown, best: TimeBreakdown | None) -> dict:
    row = _fields(c)
    row.update({
        "step_time_s": round(t.total_s, 6),
        "tflops_per_device": round(t.flops_per_step / x.devices / t.total_s / 1e12, 4),
        "memory_gb_per_device": round(m.total / GB, 3),
        "bubble_fraction": round(t.bubble_fraction, 4),
        "comm_bytes": {"tp": int(t.comm_bytes[0]), "pp": int(t.comm_bytes[1]), "dp": int(t.comm_bytes[2])},
        "memory_breakdown_gb": _mem_gb(m),
        "time_breakdown_s": {"compute_s": round(t.compute_s, 6), "tp_s": round(t.tp_s, 6), "pp_s": round(t.pp_s, 6),
                             "dp_exposed_s": round(t.dp_exposed_s, 6), "optimizer_s": round(t.optimizer_s, 6),
                             "overhead_s": round(t.overhead_s, 6), "total_s": round(t.total_s, 6)},
    })
    row["explain"] = explain(x, c, t, m, best)
    return row


def plan_dict(data: dict, constants: DeviceConstants | None = None, *, limit_rejected: int = 200) -> dict:
    """Parse `data` (PlanInputError on bad input) and plan it."""
    return plan(parse_plan_request(data), constants, limit_rejected=limit_rejected)
