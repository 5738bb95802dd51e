"""Submitting an experiment, and making one trial: the searcher's suggestion, its job (an ordinary
job_submit: quota, placement, checkpoints, user code and `parallel: auto` apply unchanged) and
its Trial row, in one transaction.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction

from jobs.core.dbtext import text_problems
from jobs.experiments import searcher
from jobs.experiments.services.events import experiment_event
from jobs.models import Experiment, Trial
from jobs.runs.services import job_submit
from trainyard.search import SearchSpec, parse_experiment, trial_spec
from trainyard.spec import SpecError

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser


def search_of(experiment: Experiment) -> SearchSpec:
    return SearchSpec.model_validate(experiment.search)


def experiment_submit(*, user: AbstractUser, name: object, spec: object, search: object) -> Experiment:
    """Validate the template and the search together (every choice and bound tried against the
    JobSpec: SpecError at `spec.*` / `search.*`, nothing created), then create the experiment and
    its first trials, up to max_concurrent, each an ordinary job: all in one transaction, so a
    trial job_submit refuses (no nodes, the queued-job cap) leaves nothing behind."""
    errors: dict[str, list[str]] = text_problems({"name": name, "spec": spec, "search": search})
    if errors:  # a NUL the form's YAML spelled "\0": PostgreSQL's text and jsonb cannot hold it (a 500)
        raise SpecError(errors)
    if name is not None and (not isinstance(name, str) or not name.strip() or len(name) > 200):
        errors["name"] = ["a name is a non-empty string of at most 200 characters"]
    try:
        template, parsed = parse_experiment(spec, search, data_root=settings.TRAINYARD_DATA_ROOT)
    except SpecError as exc:
        errors.update(exc.errors)
    if errors:
        raise SpecError(errors)
    title = (name.strip() if isinstance(name, str) else None) or str(template.get("name") or "experiment")[:200]
    with transaction.atomic():
        experiment = Experiment.objects.create(name=title, owner=user, team=user.groups.order_by("name").first(),
                                               spec=template, search=parsed.to_json())
        experiment_event(experiment, "submitted", f"submitted by {user.get_username()}: {parsed.algorithm} search "
                         f"over {', '.join(parsed.space)}, {parsed.total_trials()} trials, "
                         f"{parsed.max_concurrent} at once", actor=user.get_username())
        for _ in range(min(parsed.max_concurrent, parsed.total_trials())):
            trial_create(experiment, parsed)
    return experiment


def trial_create(experiment: Experiment, search: SearchSpec, *, strict: bool = True) -> Trial | None:
    """The next trial: suggested from the Trial rows (searcher.suggest), its job submitted and its
    row written in the caller's transaction. None when the search has no trial left. Raises what
    job_submit raises (SpecError, TooManyRequests): the caller's transaction then rolls back.
    With strict=False (a later trial), values the JobSpec refuses in combination (each one alone
    was checked at submit) make a `failed` trial without a job instead, which the sampler learns."""
    trials = list(experiment.trials.order_by("number"))
    suggestion = searcher.suggest(search, [_past(t, search) for t in trials])
    if suggestion is None:
        return None
    try:
        parsed = trial_spec(experiment.spec, suggestion.values, name=f"{experiment.name}-t{suggestion.number}"[:200],
                            data_root=settings.TRAINYARD_DATA_ROOT)
    except SpecError as exc:
        if strict:
            raise
        why = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.errors.items())
        trial = Trial.objects.create(experiment=experiment, number=suggestion.number, values=suggestion.values,
                                     params=suggestion.params, status=Trial.Status.FAILED,
                                     status_reason=f"invalid job: {why}"[:500])
        experiment_event(experiment, "trial_invalid", f"trial {trial.number}'s values make an invalid job: {why}",
                         trial=trial.number, values=suggestion.values)
        return trial
    job = job_submit(user=experiment.owner, spec=parsed)
    trial = Trial.objects.create(experiment=experiment, number=suggestion.number, job=job, values=suggestion.values,
                                 params=suggestion.params)
    experiment_event(experiment, "trial", f"trial {trial.number} (job {job.pk}): "
                     + ", ".join(f"{k}={v}" for k, v in suggestion.values.items()),
                     trial=trial.number, job=job.pk, values=suggestion.values)
    return trial


def _past(t: Trial, search: SearchSpec) -> searcher.PastTrial:
    state = {Trial.Status.RUNNING: "running", Trial.Status.SUCCEEDED: "complete",
             Trial.Status.EARLY_STOPPED: "pruned"}.get(t.status, "fail")
    a = search.asha
    # the metric at each rung the trial reached, at the rung's step (Optuna's intermediate values)
    rungs = {a.min_steps * a.reduction ** int(k): float(v) for k, v in (t.rung_values or {}).items()} if a else {}
    return searcher.PastTrial(number=t.number, params=dict(t.params), state=state, value=t.metric,
                              intermediate=rungs)
