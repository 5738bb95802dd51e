"""Server-rendered pages of jobs: the cluster overview, the job list, submit, the job page, cancel.
"""
from __future__ import annotations
from urllib.parse import quote
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import Group
from django.core.paginator import Paginator
from django.db.models import OuterRef, Subquery
from django.http import Http404
from django.utils import timezone
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST
from jobs.fleet.views import nodes_for_page
from jobs.access import selectors as access_selectors
from jobs.attempts import selectors as attempts_selectors
from jobs.scheduling import selectors as scheduling_selectors
from jobs.telemetry import selectors as telemetry_selectors
from jobs.runs import services
from jobs.core.errors import InvalidInput, TooManyRequests, TransitionError
from jobs.runs import selectors as runs_selectors
from jobs.attempts.rows import checkpoint_row, event_row
from jobs.core.throttles import submit_refusal
from jobs.runs.forms import DEMO_SPEC, JobSubmitForm, field_groups, split_errors
from jobs.models import Job, MetricStep, Node, Trial
from trainyard.spec import SpecError, parse_text
from trainyard.tags import MAX_NOTE_CHARS, MAX_TAGS, split_tags
from trainyard.textdoc import whole_number


@login_required
def overview(request):
    visible = access_selectors.jobs_visible_to(request.user)
    positions = scheduling_selectors.queue_positions()
    queue = list(visible.filter(status=Job.Status.QUEUED).order_by("-priority", "id")[:200])
    for j in queue:
        j.queue_position = positions.get(j.pk)
    active = visible.filter(status__in=Job.ACTIVE).order_by("-id")[:200]
    return render(request, "jobs/overview.html", {"nodes": nodes_for_page(), "queue": queue, "active": active})


def _with_throughput(jobs):
    """Annotate each job with `per_rank_sps`: the mean samples/s over the ranks of its newest step
    (newest attempt), from its per-step rows (MetricStep.samples_per_s_mean). One correlated subquery
    on the (job, step) index, so the whole list is one query however long the jobs ran; job
    throughput is that mean times the job's world size."""
    newest = MetricStep.objects.filter(job=OuterRef("pk")).order_by("-step", "-attempt_id")
    return jobs.annotate(per_rank_sps=Subquery(newest.values("samples_per_s_mean")[:1]))


PAGE_SIZES = (25, 50, 100, 200)
DEFAULT_PAGE_SIZE = 50
# Columns the list sorts by (jobs/runs/selectors.py ORDERINGS) and the direction of a first click:
# newest/most first for times and numbers, A-Z for words.
_SORT_FIRST_DESC = {"id", "submitted", "started", "finished", "steps"}


def _throughputs(ids: list[int]) -> dict[int, float | None]:
    """Per-rank samples/s of the page's jobs (`_with_throughput`), one query for the page's ids only:
    the correlated subqueries never run over the whole filtered list."""
    return dict(_with_throughput(Job.objects.filter(pk__in=ids)).values_list("pk", "per_rank_sps"))


def _link(params, **changes) -> str:
    """The list's query string with `changes` applied (None removes a parameter); page resets to 1
    unless set, so a new filter or order starts on its first page."""
    q = params.copy()
    q.pop("page", None)
    for key, value in changes.items():
        q.pop(key, None)
        if value is not None and not (key == "page" and value == 1):
            q[key] = str(value)
    return "?" + q.urlencode() if q else "?"


def _page_size(request) -> tuple[int, dict]:
    raw = request.GET.get("page_size", "")
    if raw in ("", str(DEFAULT_PAGE_SIZE)):
        return DEFAULT_PAGE_SIZE, {}
    if whole_number(raw) in PAGE_SIZES:
        return int(raw), {}
    return DEFAULT_PAGE_SIZE, {"page_size": [f"one of {', '.join(map(str, PAGE_SIZES))}"]}


@login_required
def job_list(request):
    """The jobs the user may see, a page at a time: filters, name search and ordering from the query
    string (jobs/runs/selectors.py, the same as GET /api/v1/jobs/), every link keeping them.
    A bad parameter answers 400 with the page and its field errors, and no rows."""
    size, errors = _page_size(request)
    try:
        query = runs_selectors.job_query(request.GET)
    except InvalidInput as exc:
        query, errors = runs_selectors.JobQuery(), {**exc.errors, **errors}
    listed = Job.objects.none() if errors else runs_selectors.jobs_listed(request.user, query)
    page = Paginator(runs_selectors.page_ids(listed), size).get_page(request.GET.get("page"))
    jobs = runs_selectors.page_rows(listed, page.object_list)
    sps = _throughputs([j.pk for j in jobs])
    positions = scheduling_selectors.queue_positions() if any(j.status == Job.Status.QUEUED for j in jobs) else {}
    now = timezone.now()
    params = request.GET
    chip_base = _link(params, tag=None)  # a tag chip: this query with its tag instead of the tag filter
    chip_base += "&" if chip_base != "?" else ""
    for j in jobs:
        j.queue_position = positions.get(j.pk)
        j.eta = _eta_text(j.predicted_start_at, now)
        per_rank = sps.get(j.pk)
        j.throughput = per_rank * j.slots if per_rank is not None else None
        j.progress_pct = min(100.0, 100.0 * j.step / j.total_steps) if j.total_steps else 0.0
        j.tag_links = [(t.name, f"{chip_base}tag={quote(t.name)}") for t in j.tags.all()]
    current = query.ordering
    columns = []
    for key, label in (("id", "Job"), ("owner", "Owner"), ("status", "Status"), ("steps", "Progress"),
                       ("submitted", "Submitted"), ("started", "Started"), ("finished", "Finished")):
        nxt = (key if current == f"-{key}" else f"-{key}" if current == key or key in _SORT_FIRST_DESC else key)
        arrow = "\u2191" if current == key else "\u2193" if current == f"-{key}" else ""
        columns.append({"key": key, "label": label, "href": _link(params, ordering=nxt), "arrow": arrow})
    visible_teams = (Group.objects.all() if request.user.is_staff else request.user.groups.all()).order_by("name")
    return render(request, "jobs/job_list.html", {
        "jobs": jobs, "page": page, "columns": columns, "name_sort": _link(params, ordering="-name" if current == "name" else "name"),
        "name_arrow": "\u2191" if current == "name" else "\u2193" if current == "-name" else "",
        "errors": errors, "f": _form_values(request.GET), "statuses": Job.Status.values, "page_sizes": PAGE_SIZES,
        "page_size": size, "teams": list(visible_teams.values_list("name", flat=True)),
        "nodes": list(Node.objects.order_by("name").values_list("name", flat=True)),
        "filtered": query.is_filtered(), "ordering": current,
        "prev_link": _link(params, page=page.previous_page_number()) if page.has_previous() else None,
        "next_link": _link(params, page=page.next_page_number()) if page.has_next() else None,
        "first_link": _link(params, page=1), "last_link": _link(params, page=page.paginator.num_pages),
    }, status=400 if errors else 200)


def _form_values(params) -> dict[str, str]:
    """What the filter form shows back: each parameter as typed (a list joined with commas)."""
    return {name: ",".join(v for v in params.getlist(name) if v)
            for name in ("q", "status", "owner", "team", "node", "tag", "experiment", "since", "until")}


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
                job = services.job_submit(user=request.user, spec=services.submitted_spec(form.cleaned_data["spec"]))
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
        return access_selectors.jobs_visible_to(request.user).get(pk=pk)
    except Job.DoesNotExist:
        raise Http404("no such job") from None


def _latest_step_summary(job: Job) -> dict:
    """The job's newest step (newest attempt) from its per-step rows: the means over its ranks."""
    row = (MetricStep.objects.filter(job=job).order_by("-step", "-attempt_id")
           .values("step", "loss_mean", "samples_per_s_mean", "tokens_per_s_mean", "step_s_mean").first())
    if row is None:
        return {}
    world = job.slots or 1
    sps, tps = row["samples_per_s_mean"], row["tokens_per_s_mean"]
    return {"step": row["step"], "loss": row["loss_mean"], "step_s": row["step_s_mean"],
            "samples_per_s": sps * world if sps is not None else None,
            "tokens_per_s": tps * world if tps is not None else None}


def _checkpoint_row(c) -> dict:
    """The API's checkpoint JSON (the page seeds its table with it), plus what the first paint shows."""
    row = checkpoint_row(c)
    row["attempt_number"] = c.attempt.number if c.attempt else None
    row["state"] = "deleted" if row["deleted"] else "superseded" if c.superseded else "active"
    return row


def _node_timeline(job: Job, attempts: list, now) -> dict | None:
    """An elastic job's node count over time (Job.node_history; 0 between attempts) as an SVG
    step line (400 x 60) and its rows; None for a fixed-size job or before its first start."""
    from datetime import datetime

    hist = job.node_history or []
    most = int(job.spec.get("resources", {}).get("nodes", 1))
    if not hist or job.spec.get("resources", {}).get("min_nodes") is None:
        return None
    ended = {a.number: a.ended_at for a in attempts}
    segs = []  # (start, end, nodes) in epoch seconds
    for h in hist:
        start = datetime.fromisoformat(h["at"]).timestamp()
        end = ended.get(h["attempt"])
        segs.append((start, (end or now).timestamp(), h["nodes"]))
    t0, t1 = segs[0][0], max(max(e for _, e, _ in segs), segs[0][0] + 1)
    x = lambda t: round(400 * (t - t0) / (t1 - t0), 1)  # noqa: E731
    y = lambda n: round(58 - 54 * n / most, 1)  # noqa: E731
    pts = []
    for start, end, n in segs:
        pts += [f"{x(start)},{y(0)}", f"{x(start)},{y(n)}", f"{x(end)},{y(n)}", f"{x(end)},{y(0)}"]
    return {"points": " ".join(pts), "most": most, "rows": hist[::-1]}


@login_required
def job_detail(request, pk: int):
    job = _visible_job(request, pk)
    can_cancel = request.user.is_staff or job.owner_id == request.user.pk
    attempts = list(job.attempts.prefetch_related("allocations__node").order_by("-number"))
    for a in attempts:
        a.rank_rows = attempts_selectors.attempt_rank_rows(a)
    events = [event_row(e) for e in job.events.order_by("-id")[:200]]
    checkpoints = [_checkpoint_row(c)
                   for c in job.checkpoints.select_related("attempt").order_by("-step", "-id")[:100]]
    res = job.spec.get("resources", {})
    summary = _latest_step_summary(job)
    step = max(job.step, summary.get("step") or 0)
    job.queue_position = scheduling_selectors.queue_positions().get(job.pk) if job.status == Job.Status.QUEUED else None
    job.eta = _eta_text(job.predicted_start_at, timezone.now())
    has_telemetry = bool(summary)  # the job has a sample at all
    config = {"id": job.pk, "status": job.status, "step": step, "total_steps": job.total_steps,
              "world": int(res.get("nodes", 1)) * int(res.get("procs_per_node", 1)), "can_cancel": can_cancel,
              "is_staff": request.user.is_staff, "has_telemetry": has_telemetry}
    mesh = job.plan.get("mesh") or {}
    plan_mesh = " × ".join(f"{d}={mesh[d]}" for d in job.plan.get("order", ()) if d in mesh)
    return render(request, "jobs/job_detail.html", {
        "job": job, "trial": Trial.objects.filter(job=job).select_related("experiment").first(), "attempts": attempts, "nodes_over_time": _node_timeline(job, attempts, timezone.now()), "plan_mesh": plan_mesh, "events": events, "checkpoints": checkpoints, "summary": summary,
        "step": step, "progress_pct": min(100.0, 100.0 * step / job.total_steps) if job.total_steps else 0.0,
        "logs": telemetry_selectors.job_log_lines(job.pk, limit=200), "config": config,
        "telemetry_unavailable": job.status in Job.TERMINAL and not has_telemetry,
        "tags": list(job.tags.values_list("name", flat=True)), "max_tags": MAX_TAGS, "max_note": MAX_NOTE_CHARS,
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
@require_POST
def job_annotate(request, pk: int):
    """The job page's tags and note form: the whole tag set (comma or space separated) and the note,
    by whoever may see the job (owner, team, staff); errors come back as messages, nothing changed."""
    job = _visible_job(request, pk)
    tags = split_tags(request.POST.get("tags", ""))
    try:
        services.job_annotate(job, user=request.user, tags=tags, note=request.POST.get("note", "").replace("\r\n", "\n"))
    except InvalidInput as exc:
        for field, problems in exc.errors.items():
            messages.error(request, f"{field}: {'; '.join(problems)}")
    else:
        messages.success(request, f"Saved the tags and note of job {job.pk}.")
    return redirect("job-detail", pk=job.pk)
