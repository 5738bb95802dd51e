"""Fitting DEFAULT_GPU's efficiency constants on published runs, and the honest evaluation of the
planner on the rows left out of the fit (published.py; tests/trainyard/plan/test_published.py).

Per row: the planner costs the published layout (its (tp, pp, dp) and what the source states,
the rest left to the search) and its predicted tokens/s is compared with the measured ones; the
unrestricted search (restricted only to what the run's framework could do) is asked whether the
published (tp, pp) is among its three best distinct (tp, pp) layouts.
"""
from __future__ import annotations

import dataclasses
import math
import statistics

from .constants import DeviceConstants
from .inputs import parse_plan_request
from .published import ROWS, TRAIN, measured_tokens_per_s
from .search import search

FIT_N = (1024.0, 4096.0, 16384.0)
# Where the fit starts (DEFAULT_GPU is its result on published.TRAIN; a test re-runs it).
FIT_START = DeviceConstants(name="gpu", matmul_eff=((1024.0, 0.35), (4096.0, 0.6), (16384.0, 0.7)),
                            comm_eff=0.7, overlap=0.5, layer_overhead_s=1e-4, elementwise_gbs=2000.0,
                            elementwise_bytes=8.0, attention_bytes=4.0, source="fit start")


def _request(row: dict, fix: dict):
    return parse_plan_request({**row["request"], "fix": fix})


def predicted_tokens_per_s(row: dict, k: DeviceConstants) -> float | None:
    """The planner's tokens/s for the published layout (None when nothing fits in it)."""
    fix = {**row["framework"], **row["published"]}
    req = _request(row, fix)
    _, found, _ = search(req, k)
    if not found:
        return None
    return req.global_batch * req.model.seq_len / found[0][0].total_s


def top_layouts(row: dict, k: DeviceConstants, n: int = 3) -> list[tuple[int, int]]:
    """The best `n` distinct (tp, pp) of the search restricted to the run's framework."""
    _, found, _ = search(_request(row, dict(row["framework"])), k)
    out: list[tuple[int, int]] = []
    for _, c, _ in found:
        if (c.tp, c.pp) not in out:
            out.append((c.tp, c.pp))
        if len(out) == n:
            break
    return out


def evaluate_row(row: dict, k: DeviceConstants) -> dict:
    pred = predicted_tokens_per_s(row, k)
    meas = measured_tokens_per_s(row)
    top = top_layouts(row, k)
    pub = (row["published"]["tp"], row["published"]["pp"])
    return {"id": row["id"], "measured_tokens_per_s": round(meas), "predicted_tokens_per_s": round(pred) if pred else None,
            "error": None if pred is None else round(pred / meas - 1, 4), "published_layout": list(pub),
            "top3_layouts": [list(t) for t in top], "published_in_top3": pub in top,
            "baseline": bool(row.get("baseline"))}


def regret(rows: list[dict], k: DeviceConstants) -> list[dict]:
    """Per group of rows measuring several layouts of one model on one cluster and batch: how much
    slower (measured) the layout the planner ranks first among them is than the group's best."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        key = repr(r["request"])  # one model, one cluster, one batch
        groups.setdefault(key, []).append(r)
    out = []
    for members in groups.values():
        if len({(m["published"]["tp"], m["published"]["pp"], m["published"]["dp"]) for m in members}) < 2:
            continue
        pick = max(members, key=lambda m: predicted_tokens_per_s(m, k) or 0.0)
        best = max(measured_tokens_per_s(m) for m in members)
        out.append({"rows": [m["id"] for m in members], "pick": pick["id"],
                    "regret": round(1 - measured_tokens_per_s(pick) / best, 4)})
    return out


def evaluate(rows: list[dict], k: DeviceConstants) -> dict:
    """Mean and max |error| of predicted throughput, the top-3 rate (over the layouts a run chose;
    a source's baselines, chosen to lose, are counted apart) and the regret over `rows`."""
    per = [evaluate_row(r, k) for r in rows]
    errs = [abs(p["error"]) if p["error"] is not None else math.inf for p in per]
    chosen = [p for p in per if not p["baseline"]]
    rate = lambda ps: round(sum(p["published_in_top3"] for p in ps) / len(ps), 4) if ps else None  # noqa: E731
    return {"rows": per, "n": len(per), "mean_abs_error": round(statistics.fmean(errs), 4) if per else None,
            "max_abs_error": round(max(errs), 4) if per else None,
            "top3_rate": rate(chosen), "top3_rows": len(chosen), "top3_rate_with_baselines": rate(per),
            **_regret_summary(regret(rows, k))}


def _regret_summary(groups: list[dict]) -> dict:
    values = [g["regret"] for g in groups]
    return {"regret": groups, "regret_mean": round(statistics.fmean(values), 4) if values else None,
            "regret_max": max(values) if values else None}


def split() -> tuple[list[dict], list[dict], list[dict]]:
    """(training rows, held-out rows the model covers, held-out rows outside it: `out_of_scope`
    says why)."""
    train = [r for r in ROWS if r["id"] in TRAIN]
    held = [r for r in ROWS if r["id"] not in TRAIN]
    return train, [r for r in held if not r.get("out_of_scope")], [r for r in held if r.get("out_of_scope")]


def _with(base: DeviceConstants, x: list[float]) -> DeviceConstants:
    e = sorted(min(0.95, max(0.02, v)) for v in x[:3])
    return dataclasses.replace(base, matmul_eff=tuple(zip(FIT_N, e)), comm_eff=min(1.0, max(0.05, x[3])),
                               layer_overhead_s=max(0.0, x[4]), elementwise_bytes=max(0.0, x[5]),
                               attention_bytes=max(0.0, x[6]), overlap=min(1.0, max(0.0, x[7])))


def _loss(rows: list[dict], k: DeviceConstants) -> float:
    total = 0.0
    for r in rows:
        pred = predicted_tokens_per_s(r, k)
        total += 10.0 if pred is None else abs(math.log(pred / measured_tokens_per_s(r)))
    return total / len(rows)


def fit(rows: list[dict], base: DeviceConstants, *, rounds: int = 12) -> DeviceConstants:
    """Coordinate descent on the mean |log(predicted / measured)| throughput of `rows` over the
    GEMM efficiency at FIT_N, the collective efficiency, the per-layer overhead, the bytes of
    non-GEMM work (at base.elementwise_gbs) and the share of the dp reduction hidden (overlap)."""
    x = [base.efficiency(n) for n in FIT_N] + [base.comm_eff, base.layer_overhead_s or 1e-4,
                                               base.elementwise_bytes or 8.0, base.attention_bytes or 4.0,
                                               base.overlap or 0.5]
    best = _loss(rows, _with(base, x))
    for _ in range(rounds):
        for i in range(len(x)):
            for step in (1.25, 0.8, 1.06, 0.94):
                while True:
                    y = list(x)
                    y[i] = x[i] * step
                    loss = _loss(rows, _with(base, y))
                    if loss >= best - 1e-6:
                        break
                    x, best = y, loss
    ids = ", ".join(r["id"] for r in rows)
    return dataclasses.replace(_with(base, x), source=f"published-fit on {ids} (loss {best:.4f})")
