"""One pass over a running experiment (the control worker runs it with every attempts check, 2 s):
read the trials' new metric values, apply ASHA's decisions, end the trials whose job ended, make
new trials while fewer than max_concurrent run and the search has trials left, and end the
experiment when every trial has ended.

Idempotent under redelivery and safe against a second control worker: the pass holds the
experiment's row lock (SQLite: the immediate transaction) and re-reads everything under it;
trials are numbered and (experiment, number) is unique; every status change is a
compare-and-set.
"""
from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from jobs.attempts.services.attempts import attempt_preempt
from jobs.attempts.services.events import job_event, job_set_status
from jobs.core.errors import TooManyRequests
from jobs.experiments import selectors
from jobs.experiments.policy import asha
from jobs.experiments.services.events import _experiment_ended, experiment_event
from jobs.experiments.services.submit import search_of, trial_create
from jobs.models import Attempt, Experiment, Job, Trial
from trainyard.search import SearchSpec
from trainyard.spec import SpecError

log = logging.getLogger(__name__)

# A trial that ran this many steps (or the first ASHA rung, if sooner) without reporting the
# search's metric once: the experiment says so in an event (a misspelt metric would otherwise
# look like a search that never stops anything and never has a best trial).
METRIC_MISSING_STEPS = 50

_JOB_TO_TRIAL = {Job.Status.SUCCEEDED: Trial.Status.SUCCEEDED, Job.Status.FAILED: Trial.Status.FAILED,
                 Job.Status.CANCELLED: Trial.Status.CANCELLED}


def experiments_advance() -> dict:
    """Advance every running experiment (one transaction each); {experiment id: what changed}."""
    out = {}
    for pk in Experiment.objects.filter(status=Experiment.Status.RUNNING).values_list("pk", flat=True):
        try:
            changed = experiment_advance(pk)
        except Exception:  # one experiment's trouble must not stop the others' (nor the attempts check)
            log.exception("experiment %s: advance failed", pk)
            continue
        if changed:
            out[pk] = changed
    return out


def experiment_advance(experiment_id: int) -> dict:
    """One pass over one experiment; what it did ({} when nothing changed)."""
    with transaction.atomic():
        experiment = Experiment.objects.select_for_update().filter(pk=experiment_id).first()
        if experiment is None or experiment.status != Experiment.Status.RUNNING:
            return {}
        search = search_of(experiment)
        trials = list(experiment.trials.select_related("job").order_by("number"))
        done: dict = {}
        _read_metrics(experiment, search, trials, done)
        if search.asha is not None:
            _apply_asha(experiment, search, trials, done)
        _end_trials(experiment, trials, done)
        _new_trials(experiment, search, trials, done)
        _maybe_end(experiment, search, trials, done)
    return done


def _read_metrics(experiment: Experiment, search: SearchSpec, trials: list[Trial], done: dict) -> None:
    a = search.asha
    missing_at = METRIC_MISSING_STEPS
    cfg = None
    if a is not None:
        cfg = asha.AshaConfig(a.min_steps, a.reduction, _max_steps(trials), search.mode)
        missing_at = min(missing_at, a.min_steps)
    for t in trials:
        if t.job is None or (t.status != Trial.Status.RUNNING and t.job.status not in Job.ACTIVE):
            continue
        last, values = selectors.trial_new_samples(t, search.metric)
        if last == t.steps and not values:
            continue
        best = t.metric
        for _, v in values:
            if best is None or (v < best if search.mode == "min" else v > best):
                best = v
        rung_values = dict(t.rung_values or {})
        if cfg is not None:
            for k, s in enumerate(asha.rungs(cfg)):
                # the value a trial reached a rung with: its first report at or past the rung's step
                first = next((v for step, v in values if step >= s), None)
                if str(k) not in rung_values and first is not None:
                    rung_values[str(k)] = first
        Trial.objects.filter(pk=t.pk).update(steps=last, metric=best, rung_values=rung_values)
        t.steps, t.metric, t.rung_values = last, best, rung_values
        done.setdefault("read", []).append(t.number)
    if any(t.steps >= missing_at and t.metric is None for t in trials if t.job is not None) and \
            not experiment.events.filter(kind="metric_missing").exists():
        t = next(t for t in trials if t.job is not None and t.steps >= missing_at and t.metric is None)
        experiment_event(experiment, "metric_missing",
                         f"trial {t.number} (job {t.job_id}) reached step {t.steps} without reporting "
                         f"{search.metric!r}: its samples carry no such metric (the built-in trainer reports "
                         f"'loss'; user code reports what it passes to run.log(step, {search.metric}=...)); "
                         f"no trial can be compared or stopped early until one does",
                         trial=t.number, job=t.job_id, step=t.steps, metric=search.metric)
        done["metric_missing"] = t.number


def _max_steps(trials: list[Trial]) -> int:
    steps = [int(((t.job.spec or {}).get("train") or {}).get("steps") or 0) for t in trials if t.job is not None]
    return max(steps, default=0)


def _apply_asha(experiment: Experiment, search: SearchSpec, trials: list[Trial], done: dict) -> None:
    a = search.asha
    cfg = asha.AshaConfig(a.min_steps, a.reduction, _max_steps(trials), search.mode)
    view = tuple(asha.TrialRungs(trial=t.number,
                                 values=tuple(sorted((int(k), float(v)) for k, v in (t.rung_values or {}).items())),
                                 step=t.steps, running=t.status == Trial.Status.RUNNING and t.job is not None
                                 and t.job.status in (Job.Status.QUEUED, *Job.ACTIVE) and not t.continued,
                                 judged=t.rung)
                 for t in trials)
    by_number = {t.number: t for t in trials}
    for d in asha.decide(cfg, view):
        t = by_number[d.trial]
        t.rung = d.rung
        if not d.stop:
            Trial.objects.filter(pk=t.pk).update(rung=d.rung)
            continue
        why = (f"ASHA: {search.metric} {d.value:.4g} at rung {d.rung} (step {d.step}) is not in the top "
               f"1/{a.reduction} of the {d.peers} trials there (the {d.keep} kept reach {d.cutoff:.4g})")
        if not Trial.objects.filter(pk=t.pk, status=Trial.Status.RUNNING).update(
                rung=d.rung, status=Trial.Status.EARLY_STOPPED, status_reason=why[:500], ended_at=timezone.now()):
            continue
        t.status, t.status_reason = Trial.Status.EARLY_STOPPED, why[:500]
        _stop_job(t.job, why)
        experiment_event(experiment, "early_stopped", f"trial {t.number} (job {t.job_id}) stopped early: {why}",
                         trial=t.number, job=t.job_id, rung=d.rung, step=d.step, value=d.value, cutoff=d.cutoff,
                         peers=d.peers)
        done.setdefault("early_stopped", []).append(t.number)


def _stop_job(job: Job, why: str) -> None:
    """Stop an early-stopped trial's job through the preemption path (checkpoint, exit), ending it
    (jobs.attempts' `end=True`: CANCELLED, resumable); a queued one is cancelled at once."""
    job.refresh_from_db()
    if job.status == Job.Status.QUEUED:
        if job_set_status(job, Job.Status.QUEUED, Job.Status.CANCELLED, f"early stopped: {why}"[:500]):
            job_event(job, "early_stopped", f"early stopped while queued: {why}", reason=why)
        return
    attempt = job.attempts.filter(status__in=(Attempt.Status.STARTING, Attempt.Status.RUNNING),
                                  stop_reason="").order_by("-number").first()
    if attempt is not None:
        attempt_preempt(attempt, reason=why, end=True)
    # else: it is stopping already (a preemption); _end_trials cancels it when it is back in the queue


def _end_trials(experiment: Experiment, trials: list[Trial], done: dict) -> None:
    for t in trials:
        if t.job is None:
            if t.status == Trial.Status.RUNNING and Trial.objects.filter(pk=t.pk, status=Trial.Status.RUNNING).update(
                    status=Trial.Status.CANCELLED, status_reason="its job was deleted", ended_at=timezone.now()):
                t.status = Trial.Status.CANCELLED  # (an admin deleted the job): the search goes on without it
                done.setdefault("trials_ended", []).append(t.number)
            continue
        job = t.job
        if t.status == Trial.Status.EARLY_STOPPED:
            if job.status == Job.Status.QUEUED:  # preempted by the scheduler before the early stop took
                _stop_job(job, t.status_reason)
            elif job.status == Job.Status.SUCCEEDED:  # it finished within the stop's grace period
                Trial.objects.filter(pk=t.pk, status=Trial.Status.EARLY_STOPPED).update(status=Trial.Status.SUCCEEDED)
                t.status = Trial.Status.SUCCEEDED
            continue
        new = _JOB_TO_TRIAL.get(job.status)
        if t.status != Trial.Status.RUNNING or new is None:
            continue
        if Trial.objects.filter(pk=t.pk, status=Trial.Status.RUNNING).update(
                status=new, status_reason=job.status_reason[:500], ended_at=timezone.now()):
            t.status = new
            experiment_event(experiment, "trial_ended", f"trial {t.number} (job {job.pk}) {new}"
                             + (f": {job.status_reason}" if job.status_reason else ""),
                             trial=t.number, job=job.pk, status=new, metric=t.metric)
            done.setdefault("trials_ended", []).append(t.number)


def _new_trials(experiment: Experiment, search: SearchSpec, trials: list[Trial], done: dict) -> None:
    running = sum(t.status == Trial.Status.RUNNING for t in trials)
    while running < search.max_concurrent and len(trials) < search.total_trials():
        try:
            with transaction.atomic():  # a refused submit rolls back this trial alone
                trial = trial_create(experiment, search, strict=False)
        except (SpecError, TooManyRequests) as exc:
            why = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.errors.items())
            last = experiment.events.filter(kind="trial_waiting").order_by("-id").first()
            if last is None or last.message != f"next trial waits: {why}"[:1000]:
                experiment_event(experiment, "trial_waiting", f"next trial waits: {why}", errors=exc.errors)
            return
        if trial is None:
            return
        trials.append(trial)
        running += trial.status == Trial.Status.RUNNING
        done.setdefault("created", []).append(trial.number)


def _maybe_end(experiment: Experiment, search: SearchSpec, trials: list[Trial], done: dict) -> None:
    if len(trials) < search.total_trials() or any(t.status == Trial.Status.RUNNING for t in trials):
        return
    # an early-stopped trial's job is still checkpointing (or finished in its grace: a success):
    # the experiment ends once every trial's job has
    if any(t.job is not None and t.job.status not in Job.TERMINAL for t in trials):
        return
    ok = [t for t in trials if t.status == Trial.Status.SUCCEEDED]
    status = Experiment.Status.SUCCEEDED if ok else Experiment.Status.FAILED
    counts = {s: sum(t.status == s for t in trials) for s in Trial.Status.values}
    reason = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    if not Experiment.objects.filter(pk=experiment.pk, status=Experiment.Status.RUNNING).update(
            status=status, status_reason=reason[:500], finished_at=timezone.now()):
        return
    experiment.refresh_from_db()
    _experiment_ended(experiment)
    done["ended"] = status
