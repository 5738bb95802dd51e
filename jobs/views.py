"""Server-rendered pages. Thin: parse, check access, call one service, render."""
from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from . import selectors, services
from .forms import JobSubmitForm
from .models import Job, Node
from .specs import SpecError


@login_required
def overview(request):
    nodes = list(Node.objects.all())
    used = selectors.slots_used_by_node()
    for n in nodes:
        n.slots_used = used.get(n.pk, 0)
    queue = selectors.jobs_visible_to(request.user).filter(status=Job.Status.QUEUED).order_by("-priority", "id")
    active = selectors.jobs_visible_to(request.user).filter(status__in=Job.ACTIVE).order_by("-id")
    return render(request, "jobs/overview.html", {"nodes": nodes, "queue": queue, "active": active})


@login_required
def job_list(request):
    jobs = selectors.jobs_visible_to(request.user).order_by("-id")[:200]
    return render(request, "jobs/job_list.html", {"jobs": jobs, "positions": selectors.queue_positions()})


@login_required
def job_new(request):
    form = JobSubmitForm(request.POST or None)
    spec_errors = None
    if request.method == "POST" and form.is_valid():
        try:
            job = services.job_submit(request.user, form.cleaned_data["spec"])
        except SpecError as exc:
            spec_errors = exc.errors
        else:
            messages.success(request, f"Job {job.pk} submitted.")
            return redirect("job-detail", pk=job.pk)
    status = 400 if request.method == "POST" else 200
    return render(request, "jobs/job_new.html", {"form": form, "spec_errors": spec_errors}, status=status)


def _visible_job(request, pk: int) -> Job:
    try:
        return selectors.jobs_visible_to(request.user).get(pk=pk)
    except Job.DoesNotExist:
        raise Http404("no such job") from None


@login_required
def job_detail(request, pk: int):
    job = _visible_job(request, pk)
    metrics = list(selectors.job_metrics(job, limit=100000).values(
        "rank", "step", "loss", "samples_per_s", "step_s", "data_s", "compute_s", "comm_s", "optim_s"))
    latest = metrics[-10:]
    return render(request, "jobs/job_detail.html", {
        "job": job, "attempts": job.attempts.prefetch_related("allocations__node").order_by("-number"),
        "events": job.events.order_by("-id")[:100], "latest": latest,
        "logs": selectors.job_log_lines(job.pk, limit=200),
        "can_cancel": job.status not in Job.TERMINAL and (request.user.is_staff or job.owner_id == request.user.pk),
    })


@login_required
@require_POST
def job_cancel(request, pk: int):
    job = _visible_job(request, pk)
    if not (request.user.is_staff or job.owner_id == request.user.pk):
        messages.error(request, "Only the job's owner or staff may cancel it.")
    else:
        try:
            services.job_cancel(request.user, job)
            messages.success(request, f"Cancel requested for job {job.pk}.")
        except services.TransitionError as exc:
            messages.error(request, str(exc))
    return redirect("job-detail", pk=job.pk)


@login_required
def node_list(request):
    nodes = list(Node.objects.all())
    used = selectors.slots_used_by_node()
    for n in nodes:
        n.slots_used = used.get(n.pk, 0)
    return render(request, "jobs/node_list.html", {"nodes": nodes})
