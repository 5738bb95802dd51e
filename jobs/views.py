"""Server-rendered pages. Thin: parse, check access, call one service, render.

Pages render meaningful HTML on their own (status, attempts, nodes, queue); static/js/*.js then
keeps them live over the websockets, so after the first paint nothing polls."""
from __future__ import annotations

from django.contrib import messages
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import Avg, OuterRef, Subquery
from django.http import Http404, JsonResponse
from django.utils import timezone
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from jobs import liveness, selectors, services
from jobs.errors import TooManyRequests, TransitionError
from jobs.rows import checkpoint_row, event_row
from jobs.throttles import submit_refusal
from jobs.forms import DEMO_SPEC, JobSubmitForm, field_groups, split_errors
from jobs.models import Job, MetricSample, Node, NodeJoinRequest, QuotaChange
from trainyard.spec import SpecError, parse_text


def _nodes() -> list[Node]:
    nodes = list(Node.objects.order_by("name"))
    used = selectors.slots_used_by_node()
    for n in nodes:
        n.slots_used = used.get(n.pk, 0)
        n.slots_free = max(0, n.slots - n.slots_used)
        n.slot_marks = [i < n.slots_used for i in range(n.slots)]
        n.gpus = [dict(d, detail=gpu_detail(d)) for d in (n.devices or [])
                  if isinstance(d, dict) and d.get("kind") == "cuda"]
        n.device_summary = _device_summary(n.devices)
        n.controls = _node_controls(n.drain_mode)
    return nodes


# (action, drain mode, label) offered to staff per drain_mode; static/js/cluster.js mirrors this.
_NODE_CONTROLS = {
    "": [("cordon", "", "Cordon"), ("drain", "finish", "Drain (finish)"), ("drain", "preempt", "Drain (preempt)")],
    "cordon": [("drain", "finish", "Drain (finish)"), ("drain", "preempt", "Drain (preempt)"),
               ("uncordon", "", "Uncordon")],
    "finish": [("drain", "preempt", "Drain (preempt)"), ("uncordon", "", "Uncordon")],
    "preempt": [("uncordon", "", "Uncordon")],
}


def _node_controls(drain_mode: str) -> list[dict]:
    return [{"action": a, "mode": m, "label": label}
            for a, m, label in _NODE_CONTROLS.get(drain_mode or "", _NODE_CONTROLS["cordon"])]


def gpu_detail(d: dict) -> str:
    """A GPU's NVML figures in one line: "12.0/141.0 GiB · 41 °C · 2 uncorrected ECC · Xid 79, 48"
    (static/js/cluster.js gpuDetail mirrors it); figures the agent did not report are left out."""
    parts = []
    if isinstance(d.get("memory_bytes"), int) and d["memory_bytes"]:
        parts.append(f"{(d.get('memory_used_bytes') or 0) / 2**30:.1f}/{d['memory_bytes'] / 2**30:.1f} GiB")
    if isinstance(d.get("temperature_c"), int):
        parts.append(f"{d['temperature_c']} °C")
    if isinstance(d.get("ecc_uncorrected"), int) and d["ecc_uncorrected"] > 0:
        parts.append(f"{d['ecc_uncorrected']} uncorrected ECC")
    xids = [str(e.get("xid")) for e in d.get("xid_events") or [] if isinstance(e, dict)]
    if xids:
        parts.append("Xid " + ", ".join(xids[-5:]) + (f" ({d.get('xid_errors')} in all)" if len(xids) > 5 else ""))
    return " · ".join(parts)


def _device_summary(devices) -> str:
    """[{kind: cpu}, {kind: cpu}, {kind: cuda, name: H100}] -> "2 × cpu, 1 × cuda H100"."""
    counts: dict[str, int] = {}
    for d in devices or []:
        if isinstance(d, dict):
            key = " ".join(str(x) for x in (d.get("kind"), d.get("name")) if x)
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} × {k}" for k, n in counts.items())


@login_required
def overview(request):
    visible = selectors.jobs_visible_to(request.user)
    positions = selectors.queue_positions()
    queue = list(visible.filter(status=Job.Status.QUEUED).order_by("-priority", "id")[:200])
    for j in queue:
        j.queue_position = positions.get(j.pk)
    active = visible.filter(status__in=Job.ACTIVE).order_by("-id")[:200]
    return render(request, "jobs/overview.html", {"nodes": _nodes(), "queue": queue, "active": active})


def _with_throughput(jobs):
    """Annotate each job with `per_rank_sps`: the mean samples/s over the ranks of its newest step
    (newest attempt). Correlated subqueries on the (job, step) index, so the whole list is one query
    however many samples the jobs have; job throughput is that mean times the job's world size."""
    newest = MetricSample.objects.filter(job=OuterRef("pk")).order_by("-step", "-attempt_id")
    jobs = jobs.annotate(latest_step=Subquery(newest.values("step")[:1]),
                         latest_attempt=Subquery(newest.values("attempt_id")[:1]))
    mean = (MetricSample.objects.filter(job=OuterRef("pk"), step=OuterRef("latest_step"),
                                        attempt_id=OuterRef("latest_attempt"))
            .order_by().values("job").annotate(v=Avg("samples_per_s")).values("v"))
    return jobs.annotate(per_rank_sps=Subquery(mean))


@login_required
def job_list(request):
    jobs = list(_with_throughput(selectors.jobs_visible_to(request.user)).order_by("-id")[:200])
    positions = selectors.queue_positions()
    now = timezone.now()
    for j in jobs:
        j.queue_position = positions.get(j.pk)
        j.eta = _eta_text(j.predicted_start_at, now)
        j.throughput = j.per_rank_sps * j.slots if j.per_rank_sps is not None else None
        j.progress_pct = min(100.0, 100.0 * j.step / j.total_steps) if j.total_steps else 0.0
    return render(request, "jobs/job_list.html", {"jobs": jobs})


def _eta_text(when, now) -> str:
    """A queued job's predicted start as "in ~4 min" (static/js/util.js fmtIn says the same)."""
    if when is None:
        return "unknown"
    s = (when - now).total_seconds()
    if s < 30:
        return "any moment"
    if s < 90:
        return "in ~1 min"
    if s < 5400:
        return f"in ~{round(s / 60)} min"
    if s < 48 * 3600:
        return f"in ~{s / 3600:.1f} h"
    return f"in ~{round(s / 86400)} days"


@login_required
def job_new(request):
    form = JobSubmitForm(request.POST or None)
    errors: dict[str, list[str]] = {}
    status = 400
    if request.method == "POST":
        refusal = submit_refusal(request)
        if refusal is not None:
            errors, status = {"spec": [refusal]}, 429
        elif form.is_valid():
            try:
                job = services.job_submit(user=request.user, spec=form.cleaned_data["spec"])
            except SpecError as exc:
                errors = exc.errors
            except TooManyRequests as exc:
                errors, status = exc.errors, 429
            else:
                messages.success(request, f"Job {job.pk} submitted.")
                for warning in job.warnings:
                    messages.warning(request, f"Job {job.pk}: {warning}.")
                return redirect("job-detail", pk=job.pk)
        else:
            errors = {"spec": list(form.errors.get("spec", []))}
    text = request.POST.get("spec", "") if request.method == "POST" else DEMO_SPEC
    try:
        parsed = parse_text(text)
    except SpecError:
        parsed = None
    inline, other = split_errors(errors)
    return render(request, "jobs/job_new.html", {
        "form": form, "groups": field_groups(parsed, inline), "other_errors": other, "has_errors": bool(errors),
        "inline_errors": bool(inline),
        "demo_spec": DEMO_SPEC,
    }, status=status if request.method == "POST" else 200)


def _visible_job(request, pk: int) -> Job:
    try:
        return selectors.jobs_visible_to(request.user).get(pk=pk)
    except Job.DoesNotExist:
        raise Http404("no such job") from None


def _latest_step_summary(job: Job) -> dict:
    newest = MetricSample.objects.filter(job=job).order_by("-step", "-attempt_id").values("step", "attempt_id").first()
    if newest is None:
        return {}
    agg = MetricSample.objects.filter(job=job, step=newest["step"], attempt_id=newest["attempt_id"]).aggregate(
        loss=Avg("loss"), sps=Avg("samples_per_s"), tps=Avg("tokens_per_s"), step_s=Avg("step_s"))
    world = job.slots or 1
    return {"step": newest["step"], "loss": agg["loss"], "step_s": agg["step_s"],
            "samples_per_s": agg["sps"] * world if agg["sps"] is not None else None,
            "tokens_per_s": agg["tps"] * world if agg["tps"] is not None else None}


def _checkpoint_row(c) -> dict:
    """The API's checkpoint JSON (the page seeds its table with it), plus what the first paint shows."""
    row = checkpoint_row(c)
    row["attempt_number"] = c.attempt.number if c.attempt else None
    row["state"] = "deleted" if row["deleted"] else "superseded" if c.superseded else "active"
    return row


@login_required
def job_detail(request, pk: int):
    job = _visible_job(request, pk)
    can_cancel = request.user.is_staff or job.owner_id == request.user.pk
    attempts = list(job.attempts.prefetch_related("allocations__node").order_by("-number"))
    for a in attempts:
        a.rank_rows = selectors.attempt_rank_rows(a)
    events = [event_row(e) for e in job.events.order_by("-id")[:200]]
    checkpoints = [_checkpoint_row(c)
                   for c in job.checkpoints.select_related("attempt").order_by("-step", "-id")[:100]]
    res = job.spec.get("resources", {})
    summary = _latest_step_summary(job)
    step = max(job.step, summary.get("step") or 0)
    job.queue_position = selectors.queue_positions().get(job.pk) if job.status == Job.Status.QUEUED else None
    job.eta = _eta_text(job.predicted_start_at, timezone.now())
    has_telemetry = bool(summary)  # the job has a sample at all
    config = {"id": job.pk, "status": job.status, "step": step, "total_steps": job.total_steps,
              "world": int(res.get("nodes", 1)) * int(res.get("procs_per_node", 1)), "can_cancel": can_cancel,
              "is_staff": request.user.is_staff, "has_telemetry": has_telemetry}
    mesh = job.plan.get("mesh") or {}
    plan_mesh = " × ".join(f"{d}={mesh[d]}" for d in job.plan.get("order", ()) if d in mesh)
    return render(request, "jobs/job_detail.html", {
        "job": job, "attempts": attempts, "plan_mesh": plan_mesh, "events": events, "checkpoints": checkpoints, "summary": summary,
        "step": step, "progress_pct": min(100.0, 100.0 * step / job.total_steps) if job.total_steps else 0.0,
        "logs": selectors.job_log_lines(job.pk, limit=200), "config": config,
        "telemetry_unavailable": job.status in Job.TERMINAL and not has_telemetry,
        "can_cancel": can_cancel and job.status not in Job.TERMINAL and job.status != Job.Status.STOPPING,
    })


@login_required
@require_POST
def job_cancel(request, pk: int):
    job = _visible_job(request, pk)
    if not (request.user.is_staff or job.owner_id == request.user.pk):
        messages.error(request, "Only the job's owner or staff may cancel it.")
    else:
        try:
            services.job_cancel(job, user=request.user)
            messages.success(request, f"Cancel requested for job {job.pk}.")
        except TransitionError as exc:
            messages.error(request, exc.message)
    return redirect("job-detail", pk=job.pk)


@login_required
def node_list(request):
    # Staff see the heartbeats refused from unregistered nodes (issue 16), to approve in the admin.
    joins = list(NodeJoinRequest.objects.all()[:50]) if request.user.is_staff else []
    return render(request, "jobs/node_list.html", {"nodes": _nodes(), "join_requests": joins,
                                                   **_control_plane(request.user)})


def _control_plane(user) -> dict:
    """The nodes page's "Control plane" panel: every process's liveness (jobs/liveness.py) and, for
    staff, what `make run`'s supervisor knows (pids, restarts, last exit)."""
    rows = liveness.processes()
    for row in rows:
        row["age_text"] = "never" if row["age_s"] is None else f"{row['age_s']:.0f} s ago"
    sup = liveness.supervisor() if user.is_staff else None
    if sup is not None:
        sup = {"up": sup["up"], "age_s": sup["age_s"],
               "rows": [dict(p, process=name) for name, p in sup.pop("processes").items()]}
    return {"processes": rows, "supervisor": sup}


@login_required
def control_plane(request):
    """JSON of the panel, which static/js/controlplane.js fetches every 5 s: the one thing on the pages
    that polls, because what pushes the other updates (the control worker, the relay) is what it
    must be able to show dead."""
    data = _control_plane(request.user)
    return JsonResponse({"processes": [{k: r[k] for k in ("process", "up", "age_s")} for r in data["processes"]],
                         "supervisor": data["supervisor"]})


def _quota_text(q: dict | None) -> str:
    """A QuotaChange's old/new: {"max_slots": 8, "device_hours": 100.0} -> "8 slots, 100 device-h"."""
    if not q:
        return "none"
    hours = q.get("device_hours")
    return f"{q.get('max_slots')} slots, " + ("no device-hour limit" if hours is None else f"{_hours(hours)} device-h")


def _hours(v: float) -> str:
    return f"{v or 0.0:.2f}".rstrip("0").rstrip(".")


def _quota_changes(limit: int = 50) -> list[QuotaChange]:
    changes = list(QuotaChange.objects.select_related("actor").order_by("-id")[:limit])
    for c in changes:
        c.old_text, c.new_text = _quota_text(c.old), _quota_text(c.new)
    return changes


@login_required
def quota_list(request):
    """Quotas per team (and per user with one), usage, and the audit log (staff). `?part=audit`
    renders the audit log alone: static/js/quotas.js refreshes it after a save."""
    if not request.user.is_staff:
        raise PermissionDenied("only staff may manage quotas")
    changes = _quota_changes()
    if request.GET.get("part") == "audit":
        return render(request, "jobs/_quota_audit.html", {"changes": changes})
    rows = selectors.quota_table()
    for r in rows:  # "3.25 / 100" like static/js/quotas.js
        r["hours_text"] = _hours(r["device_hours_used"]) + (
            f" / {_hours(r['device_hours'])}" if r["device_hours"] is not None else "")
    window_h = settings.TRAINYARD_QUOTA_WINDOW_S / 3600
    return render(request, "jobs/quota_list.html", {
        "rows": rows, "changes": changes,
        "window": f"{window_h / 24:g} days" if window_h >= 48 else f"{window_h:g} h"})
