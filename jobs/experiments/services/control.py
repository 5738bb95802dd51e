"""What a person does to an experiment: stop it, continue an early-stopped trial."""
from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import transaction
from django.utils import timezone

from jobs.attempts.services.rollback import job_resume
from jobs.core.errors import NotFound, TransitionError
from jobs.experiments.services.events import _experiment_ended, experiment_event
from jobs.models import Experiment, Job, Trial
from jobs.runs.services import job_cancel

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser


def experiment_stop(experiment: Experiment, *, user: AbstractUser) -> Experiment:
    """Stop a running experiment: no new trials, every running trial's job cancelled (its trial
    `cancelled`), status `stopped`. Raises TransitionError (409) when it already ended."""
    with transaction.atomic():
        experiment = Experiment.objects.select_for_update().get(pk=experiment.pk)
        who = user.get_username()
        if not Experiment.objects.filter(pk=experiment.pk, status=Experiment.Status.RUNNING).update(
                status=Experiment.Status.STOPPED, status_reason=f"stopped by {who}", finished_at=timezone.now()):
            raise TransitionError(f"the experiment is already {experiment.status}")
        experiment.refresh_from_db()
        cancelled = []
        for t in experiment.trials.filter(status=Trial.Status.RUNNING).select_related("job"):
            if t.job is not None and t.job.status not in Job.TERMINAL:
                job_cancel(t.job, user=user)
            Trial.objects.filter(pk=t.pk, status=Trial.Status.RUNNING).update(
                status=Trial.Status.CANCELLED, status_reason=f"experiment stopped by {who}", ended_at=timezone.now())
            cancelled.append(t.number)
        experiment_event(experiment, "stopped", f"stopped by {who}; {len(cancelled)} running trial(s) cancelled",
                         trials=cancelled, actor=who)
        _experiment_ended(experiment)
    return experiment


def trial_continue(experiment: Experiment, *, job_id: int, user: AbstractUser) -> Trial:
    """Continue an early-stopped trial from its checkpoint: its job is queued again
    (jobs.attempts' job_resume: the next attempt resumes from the latest checkpoint, as after a
    preemption; no new Job status) and runs to its train.steps; the trial is `running` again, and
    ASHA, overruled by a person, no longer stops it (its values still count at each rung). A succeeded or failed
    experiment runs again until the trial ends. Raises NotFound (no such trial), TransitionError
    (not early-stopped, a stopped experiment, no checkpoint)."""
    with transaction.atomic():
        experiment = Experiment.objects.select_for_update().get(pk=experiment.pk)
        trial = experiment.trials.select_related("job").filter(job_id=job_id).first()
        if trial is None or trial.job is None:
            raise NotFound({"job": [f"job {job_id} is not a trial of experiment {experiment.pk}"]})
        if trial.status != Trial.Status.EARLY_STOPPED:
            raise TransitionError(f"trial {trial.number} is {trial.status}: only an early-stopped trial continues",
                                  field="job")
        if experiment.status == Experiment.Status.STOPPED:
            raise TransitionError("the experiment was stopped: submit the trial's spec as a job instead")
        job_resume(trial.job, user=user, reason=f"trial {trial.number} of experiment {experiment.pk} continued")
        Trial.objects.filter(pk=trial.pk).update(status=Trial.Status.RUNNING, status_reason="", ended_at=None,
                                                 continued=True)
        if experiment.status != Experiment.Status.RUNNING:
            Experiment.objects.filter(pk=experiment.pk).update(status=Experiment.Status.RUNNING, status_reason="",
                                                               finished_at=None)
        experiment_event(experiment, "trial_continued", f"trial {trial.number} (job {trial.job_id}) continued "
                         f"from its checkpoint by {user.get_username()}", trial=trial.number, job=trial.job_id)
    trial.refresh_from_db()
    return trial
