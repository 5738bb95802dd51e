"""The knowledge-base page (/knowledge/): past configurations with predicted vs measured step time
and memory, the best known plan per model shape and cluster, the outcomes of automatic
adaptations (issue 24), and the device calibrations.

The same filters and record JSON as GET /api/v1/knowledge/ (jobs/planning/api.py); the page
renders text the API leaves as numbers. The calibrations section shows the `Calibration` rows
(jobs/models/planning.py, added with `python manage.py calibrate`) when that model exists."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from jobs.planning import selectors as planning_selectors
from jobs.planning.api import KINDS, best_dict, parse_filters, record_dict
from jobs.core.errors import InvalidInput
from jobs.models import KnowledgeRecord, Node

try:  # added by the calibration part of issue 13; the section is left out without it
    from jobs.models import Calibration
except ImportError:  # pragma: no cover - depends on which parts are merged
    Calibration = None

PAGE_ROWS = 200
CALIBRATION_ROWS = 20
ADAPTATION_ROWS = 50


def _ms(s: float | None) -> str:
    return "–" if s is None else f"{s * 1000:.1f} ms"


def _gb(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f} GB" if v >= 0.1 else f"{v * 1000:.0f} MB"


def _pct(e: float | None) -> str:
    return "–" if e is None else f"{e * 100:+.1f}%"


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "–"
    text = f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return f"{text}{unit}"


def plan_text(plan: dict) -> str:
    """{"dp": 2, "tp": 1, "pp": 2, "micro_batch": 4, "fsdp": false, ...} -> "dp 2 × pp 2 (1f1b), micro-batch 4"."""
    if plan.get("dp") is None:
        return "–"
    parts = [("fsdp " if plan.get("fsdp") else "dp ") + str(plan["dp"])]
    if (plan.get("tp") or 1) > 1:
        parts.append(f"tp {plan['tp']}")
    if (plan.get("pp") or 1) > 1:
        parts.append(f"pp {plan['pp']} ({plan.get('schedule') or '1f1b'})")
    text = " × ".join(parts)
    extras = []
    if plan.get("micro_batch"):
        extras.append(f"micro-batch {plan['micro_batch']}")
    if plan.get("shard_optimizer"):
        extras.append("ZeRO-1")
    if plan.get("recompute") not in (None, "none"):
        extras.append(f"recompute {plan['recompute']}")
    return text + (", " + ", ".join(extras) if extras else "")


def model_text(model: dict | None) -> str:
    if model is None:
        return "user code"
    if model["kind"] == "mlp":
        return f"mlp {model['layers']}×{model['hidden']}, seq {model['seq_len']}"
    return (f"gpt {model['layers']}×{model['hidden']}, {model['heads']} heads, seq {model['seq_len']}, "
            f"vocab {model['vocab']}")


def cluster_text(cluster: dict) -> str:
    return f"{cluster['nodes']}×{cluster['procs_per_node']} {cluster['device']}"


def _row(r: KnowledgeRecord) -> dict:
    d = record_dict(r)
    m, p, e = d["measured"], d["predicted"], d["error"]
    return {**d, "model_text": model_text(d["model"]), "plan_text": plan_text(d["plan"]),
            "cluster_text": cluster_text(d["cluster"]), "step_text": _ms(m["step_time_s"]),
            "pred_step_text": _ms(p["step_time_s"]), "step_error_text": _pct(e["step_time"]),
            "mem_text": _gb(m["memory_gb"]), "pred_mem_text": _gb(p["memory_gb"]),
            "mem_error_text": _pct(e["memory"]), "tokens_text": _num(m["tokens_per_s"]),
            "tflops_text": _num(m["tflops_per_device"])}


def _best_row(b: dict) -> dict:
    d = best_dict(b)
    return {**d, "model_text": model_text(d["model"]), "plan_text": plan_text(d["plan"]),
            "cluster_text": cluster_text(d["cluster"]), "step_text": _ms(d["step_time_s"]),
            "tokens_text": _num(d["tokens_per_s"]), "tflops_text": _num(d["tflops_per_device"]),
            "mem_text": _gb(d["mem_bytes"] / 1e9 if d["mem_bytes"] else None),
            "margin_text": (f"{(d['tokens_per_s'] / d['runner_up_tokens_per_s'] - 1) * 100:.0f}% faster than the next"
                            if d["runner_up_tokens_per_s"] else "the only plan measured")}


def _value(v) -> str:
    return "–" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _adaptation_row(o) -> dict:
    """One AdaptationOutcome as the page's table shows it."""
    model = None if o.model_kind is None else {"kind": o.model_kind, "layers": o.layers, "hidden": o.hidden,
                                                "heads": o.heads, "seq_len": o.seq_len, "vocab": o.vocab}
    if o.kind == "oom":
        plan = {k: getattr(o, k) for k in ("dp", "tp", "pp", "micro_batch", "fsdp", "shard_optimizer", "recompute",
                                           "schedule")}
        changed = f"ran out of memory with {plan_text(plan)}" + (f" (under {_gb(o.limit_gb)} a device)"
                                                                  if o.limit_gb is not None else "")
        outcome, measured = "re-planned; new jobs keep off this plan", "–"
    else:
        before = o.before or {}
        changed = ", ".join(f"{k} {_value(before.get(k))} → {_value(v)}" for k, v in (o.change or {}).items())
        changed += f" ({o.bottleneck_class}-bound)" if o.bottleneck_class else ""
        outcome = o.outcome
        measured = "–" if o.measured_gain is None else f"{o.measured_gain * 100:+.1f}%"
        if o.step_s_before is not None and o.step_s_after is not None:
            measured += f" ({_ms(o.step_s_before)} → {_ms(o.step_s_after)} a step)"
    return {"id": o.pk, "job": o.job_id, "job_name": o.job.name if o.job_id else None, "kind": o.kind,
            "attempt": o.attempt_number, "model_text": model_text(model),
            "cluster_text": f"{o.nodes}×{o.procs_per_node} {o.device_name}", "global_batch": o.global_batch,
            "changed": changed, "outcome": outcome, "measured": measured, "created_at": o.created_at}


def evaluation_items(evaluation, limit: int = 12) -> list[str]:
    """A calibration's evaluation JSON as "name: value" lines (nested objects flattened with dots)."""
    out: list[str] = []

    def walk(prefix: str, v) -> None:
        if len(out) >= limit:
            return
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            if isinstance(v, (str, bool)):
                out.append(f"{prefix}: {v}")
        else:
            out.append(f"{prefix}: {v:.3g}")

    walk("", evaluation if isinstance(evaluation, dict) else {})
    return out


# (key in an evaluation, label, shown as a percentage): trainyard/plan/calibration.evaluate's figures
CALIBRATION_FIGURES = (("spearman", "Spearman", False), ("step_error_median", "step time error median", True),
                       ("step_error_max", "max", True), ("states_error_median", "params+grads+optimizer error median",
                                                         True), ("activation_error_median", "activation error median", True))


def calibration_summary(evaluation) -> list[str]:
    """A calibration's {"held_out", "before", "after"} evaluation as "figure before → after" lines
    on the held-out runs; any other shape of evaluation as evaluation_items."""
    ev = evaluation if isinstance(evaluation, dict) else {}
    before, after = ev.get("before"), ev.get("after")
    if not isinstance(after, dict):
        return evaluation_items(ev)
    before = before if isinstance(before, dict) else {}

    def fmt(v, pct: bool) -> str:
        return f"{v * 100:.0f}%" if pct else f"{v:.2f}"
    out = []
    for key, label, pct in CALIBRATION_FIGURES:
        a, b = after.get(key), before.get(key)
        if isinstance(a, (int, float)):
            out.append(f"{label} {fmt(b, pct)} → {fmt(a, pct)}" if isinstance(b, (int, float))
                       else f"{label} {fmt(a, pct)}")
    if isinstance(ev.get("held_out"), list):
        out.append(f"on {len(ev['held_out'])} held-out runs")
    return out


def _calibrations() -> list | None:
    if Calibration is None:
        return None
    rows = list(Calibration.objects.order_by("-created_at")[:CALIBRATION_ROWS])
    for c in rows:
        c.evaluation_items = calibration_summary(getattr(c, "evaluation", None))
    return rows


@login_required
def knowledge_page(request):
    errors: dict[str, list[str]] = {}
    try:
        filters = parse_filters(request.GET)
    except InvalidInput as exc:
        errors, filters = exc.errors, {"kind": None, "device": None, "layers": None, "hidden": None}
    visible = planning_selectors.knowledge_filter(planning_selectors.knowledge_visible_to(request.user), **filters)
    total = visible.count()
    rows = [_row(r) for r in visible.order_by("-id")[:PAGE_ROWS]] if not errors else []
    best = [] if errors else [_best_row(b) for b in planning_selectors.knowledge_best_table(
        planning_selectors.knowledge_filter(KnowledgeRecord.objects.all(), **filters))]
    adapted = [_adaptation_row(o) for o in
               planning_selectors.adaptations_visible_to(request.user).order_by("-id")[:ADAPTATION_ROWS]]
    return render(request, "jobs/knowledge.html", {
        "kinds": KINDS, "rows": rows, "total": total, "shown": len(rows), "best": best, "errors": errors,
        "adaptations": adapted,
        "filters": {k: request.GET.get(k, "") for k in ("kind", "device", "layers", "hidden")},
        "calibrations": _calibrations(), "nodes": list(Node.objects.order_by("name").values_list("name", flat=True)),
    }, status=400 if errors else 200)
