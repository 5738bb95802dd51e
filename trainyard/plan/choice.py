"""The planner's choice in words, for the job page and the SDK alike: a plan's label, the
runners-up with why each lost, and the shortfall of the closest plan that does not fit. Used by
the control plane's `parallel: auto` (jobs/planning/autoplan.py) and by run.prepare's for a user's
own model (trainyard/sdk/autoplan.py)."""
from __future__ import annotations

RUNNERS_UP = 3


def label(p: dict) -> str:
    """A plan in a few words: "dp 2 · tp 1 · pp 1 · micro-batch 8 · fsdp"."""
    bits = [f"dp {p['dp']}", f"tp {p['tp']}", f"pp {p['pp']}", f"micro-batch {p['micro_batch']}"]
    bits += ["fsdp"] if p.get("fsdp") else []
    bits += ["ZeRO-1"] if p.get("shard_optimizer") else []
    bits += [f"recompute {p['recompute']}"] if p.get("recompute", "none") != "none" else []
    bits += [p["schedule"]] if p["pp"] > 1 else []
    return " · ".join(bits)


def runners_up(plans: list[dict], rejected: list[dict], memory_gb: float) -> list[dict]:
    """The next RUNNERS_UP plans after the best, each with how much slower it is, and the nearest
    plan that does not fit with its shortfall."""
    best = plans[0]
    out = [{"label": label(p), "step_time_s": p["step_time_s"],
            "why": f"slower by {(p['step_time_s'] / best['step_time_s'] - 1) * 100:.1f}% "
                   f"({p['step_time_s']:.4g} s vs {best['step_time_s']:.4g} s a step)"}
           for p in plans[1:1 + RUNNERS_UP]]
    if rejected:
        miss = min(rejected, key=lambda r: r["memory_gb_per_device"])
        out.append({"label": label(miss), "step_time_s": None, "why": shortfall(miss, memory_gb)})
    return out


def shortfall(miss: dict, memory_gb: float) -> str:
    need = miss["memory_gb_per_device"]
    return (f"does not fit: needs {need:.3g} GB per device, {need - memory_gb:.3g} GB more than the "
            f"{memory_gb:.3g} GB a device has")


def nothing_fits(rejected: list[dict], memory_gb: float) -> str:
    """Why no plan was chosen: the closest plan's shortfall, or that none splits the model."""
    if rejected:
        miss = min(rejected, key=lambda r: r["memory_gb_per_device"])
        return f"fits nowhere on this cluster: the closest plan ({label(miss)}) {shortfall(miss, memory_gb)}"
    return "no plan of the runtime's strategies splits this model over these processes"
