"""Reads about experiments: who sees which, a trial's new metric values, the best trial."""
from __future__ import annotations

import math

from django.db.models import Q, QuerySet

from jobs.experiments.policy import asha
from jobs.models import Experiment, MetricStep, Trial

# One pass reads at most this many of a trial's new steps: a trial far ahead is caught up over a few
# passes rather than in one long transaction.
READ_LIMIT = 5000


def experiments_visible_to(user) -> QuerySet[Experiment]:
    """Own experiments and the teams' (as jobs: jobs.access.selectors.jobs_visible_to); staff all."""
    qs = Experiment.objects.select_related("owner", "team")
    if user.is_staff:
        return qs
    return qs.filter(Q(owner=user) | Q(team__in=user.groups.all())).distinct()


def metric_value(metric: str, loss: float | None, extra: dict | None) -> float | None:
    """The search's metric in one sample: `loss` is the sample's loss (the built-in trainer's, or
    run.log's loss=); any other name is one of the user's own run.log metrics."""
    v = loss if metric == "loss" else (extra or {}).get(metric)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def trial_new_samples(trial: Trial, metric: str) -> tuple[int, list[tuple[int, float]]]:
    """(the last step read, [(step, value)]) of the trial job's per-step rows (MetricStep, kept for the
    job's life) after `trial.steps`, in step order, the steps without the metric left out: `loss` is
    the mean over the ranks that reported it, a user metric the value of the lowest rank that logged
    any at that step (rank 0's when it logs). Each step once, read once: a step whose ranks arrive in
    several relay rounds is read as it stands then (its user metric already final when rank 0's came
    first, as the ranks' samples of one step usually do)."""
    if trial.job_id is None:
        return trial.steps, []
    rows = list(MetricStep.objects.filter(job_id=trial.job_id, step__gt=trial.steps)
                .order_by("step", "attempt_id").values_list("step", "loss_mean", "extra")[:READ_LIMIT])
    last = trial.steps
    out = []
    for step, loss, extra in rows:
        last = max(last, step)
        v = metric_value(metric, loss, extra)
        if v is not None:
            out.append((step, v))
    return last, out


def best_trial(experiment: Experiment, trials: list[Trial] | None = None) -> Trial | None:
    """The trial with the best metric so far (ties to the lower number), or None."""
    trials = list(experiment.trials.all()) if trials is None else trials
    mode = (experiment.search or {}).get("mode", "min")
    pick = asha.best(mode, tuple((t.number, t.metric) for t in trials if t.metric is not None))
    if pick is None:
        return None
    return next(t for t in trials if t.number == pick[0])
