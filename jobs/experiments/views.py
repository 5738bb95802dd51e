"""Server-rendered experiment pages: the list and an experiment's page (the trial table, the best
trial and its spec ready to submit; static/js/experiment.js, when present, adds the live charts
from the experiment's API JSON)."""
from __future__ import annotations

import json

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from trainyard.rules import SpecError
from trainyard.search import experiment_document
from trainyard.spec import parse_text

from jobs.core.errors import DomainError
from jobs.core.throttles import submit_refusal
from jobs.experiments import selectors, services
from jobs.experiments.serializers import best_row, trial_row
from jobs.models import Experiment


@login_required
def experiment_list(request):
    experiments = list(selectors.experiments_visible_to(request.user).prefetch_related("trials").order_by("-id")[:200])
    for e in experiments:
        rows = list(e.trials.all())
        e.counts = {s: n for s in ("running", "succeeded", "early_stopped", "failed", "cancelled")
                    if (n := sum(t.status == s for t in rows))}
        e.total = e.search.get("max_trials")
        e.best = best_row(e, rows)
    return render(request, "jobs/experiment_list.html", {"experiments": experiments})


EXAMPLE = settings.BASE_DIR / "examples" / "experiments" / "lr_search.yaml"
MAX_TEXT = 256 * 1024  # an experiment document is a spec and a search: far smaller


@login_required
def experiment_new(request):
    """The experiment form: one text, YAML or JSON, as `trainyard experiment submit` reads a file (a
    JobSpec with a `search` block, or {name, spec, search}); its errors are listed by field and
    nothing is created."""
    errors: dict[str, list[str]] = {}
    status = 200
    text = EXAMPLE.read_text() if request.method != "POST" else request.POST.get("document", "")
    if request.method == "POST":
        status = 400
        refusal = submit_refusal(request)
        try:
            if refusal is not None:
                status, errors = 429, {"document": [refusal]}
            elif len(text) > MAX_TEXT:
                errors = {"document": [f"at most {MAX_TEXT // 1024} KiB"]}
            else:
                body = experiment_document(parse_text(text))
                experiment = services.experiment_submit(user=request.user, **body)
                messages.success(request, f"Experiment {experiment.pk} submitted: "
                                          f"{experiment.trials.count()} trials started.")
                return redirect("experiment-detail", pk=experiment.pk)
        except SpecError as exc:
            errors = exc.errors
        except DomainError as exc:  # the queued-job cap (429) and any other refusal of a trial's job
            status, errors = exc.status_code, exc.errors
    return render(request, "jobs/experiment_new.html", {"document": text, "errors": sorted(errors.items())},
                  status=status)


@login_required
def experiment_detail(request, pk: int):
    experiment = _visible(request, pk)
    trials = list(experiment.trials.select_related("job").order_by("number"))
    best = selectors.best_trial(experiment, trials)
    best_spec = None
    if best is not None and best.job is not None:
        best_spec = json.dumps({**best.job.spec, "name": f"{experiment.name}-best"[:200]}, indent=2)
    return render(request, "jobs/experiment_detail.html", {
        "experiment": experiment, "trials": [trial_row(t) for t in trials], "best": best_row(experiment, trials),
        "best_spec": best_spec, "paths": list(experiment.search.get("space", {})),
        "events": list(experiment.events.order_by("-id")[:100]),
        "can_change": request.user.is_staff or experiment.owner_id == request.user.pk,
    })


def _visible(request, pk: int) -> Experiment:
    try:
        return selectors.experiments_visible_to(request.user).get(pk=pk)
    except Experiment.DoesNotExist:
        raise Http404("no such experiment") from None


@login_required
@require_POST
def experiment_stop(request, pk: int):
    experiment = _visible(request, pk)
    if not (request.user.is_staff or experiment.owner_id == request.user.pk):
        messages.error(request, "Only the experiment's owner or staff may stop it.")
    else:
        try:
            services.experiment_stop(experiment, user=request.user)
            messages.success(request, f"Experiment {experiment.pk} stopped.")
        except DomainError as exc:
            messages.error(request, exc.message)
    return redirect("experiment-detail", pk=pk)


@login_required
@require_POST
def trial_continue(request, pk: int, job_id: int):
    experiment = _visible(request, pk)
    if not (request.user.is_staff or experiment.owner_id == request.user.pk):
        messages.error(request, "Only the experiment's owner or staff may continue a trial.")
    else:
        try:
            trial = services.trial_continue(experiment, job_id=job_id, user=request.user)
            messages.success(request, f"Trial {trial.number} (job {job_id}) continues from its checkpoint.")
        except DomainError as exc:
            messages.error(request, exc.message)
    return redirect("experiment-detail", pk=pk)
