"""Rolling a job back to one of its checkpoints (staff): the running attempt stops like a preemption, and the next attempt resumes from the chosen checkpoint.
"""
from __future__ import annotations

from typing import TYPE_CHECKING
from pathlib import Path
from django.db import transaction
from jobs.core import dispatch
from jobs.core.errors import RollbackCheckpointError, TransitionError
from jobs.models import Attempt, Checkpoint, Job
from jobs.attempts.policy import checkpoints as ckpt_policy
from jobs.attempts.services.attempts import attempt_stop
from jobs.attempts.services.checkpoints import checkpoint_publish, checkpoint_states, resume_checkpoint
from jobs.attempts.services.events import job_event, job_set_status
from trainyard.textdoc import whole_number


if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser


def job_rollback(job: Job, *, user: AbstractUser, checkpoint_id: int | str) -> Job:
    """Rewind a job to one of its checkpoints: later checkpoints are superseded, a running attempt
    stops (outcome rolled_back), and the next attempt resumes from the checkpoint. A finished job
    runs again. Raises RollbackCheckpointError for a bad checkpoint, TransitionError when the job
    is being cancelled."""
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, (int, str)) or whole_number(str(checkpoint_id)) is None:
        raise RollbackCheckpointError({"checkpoint": ["must be the id of one of this job's checkpoints"]})
    with transaction.atomic():
        job = Job.objects.get(pk=job.pk)
        target = Checkpoint.objects.filter(pk=whole_number(str(checkpoint_id))).first()
        if not job.checkpoints.exists():
            raise RollbackCheckpointError({"checkpoint": [f"job {job.pk} has no checkpoints to roll back to"]})
        if target is None or target.job_id != job.pk:
            raise RollbackCheckpointError({"checkpoint": [f"checkpoint {checkpoint_id} is not a checkpoint of job {job.pk}"]})
        if target.deleted_at is not None:
            raise RollbackCheckpointError({"checkpoint": [f"checkpoint {target.pk} (step {target.step}) was deleted by retention; "
                                            "pick a checkpoint that still exists"]})
        if not Path(target.path).is_dir():
            raise RollbackCheckpointError({"checkpoint": [f"checkpoint {target.pk} (step {target.step}): its files are missing "
                                            f"at {target.path}"]})
        if job.cancel_requested and job.status not in Job.TERMINAL:
            raise TransitionError("the job is being cancelled")
        doomed = ckpt_policy.rollback_supersedes(checkpoint_states(job), next(
            s for s in checkpoint_states(job) if s.id == target.pk))
        Checkpoint.objects.filter(pk__in=doomed).update(superseded=True)
        Checkpoint.objects.filter(pk=target.pk).update(superseded=False)
        for c in Checkpoint.objects.filter(pk__in=[*doomed, target.pk]):
            checkpoint_publish(c)
        who = user.get_username()
        job_event(job, "rollback", f"{who} rolled back to the checkpoint at step {target.step}"
               + (f"; {len(doomed)} later checkpoint(s) superseded" if doomed else ""),
               actor=user, checkpoint=target.pk, step=target.step, superseded=doomed, from_status=job.status)
        reason = f"rolling back to step {target.step} ({who})"
        if job.status in Job.TERMINAL:
            job_set_status(job, Job.TERMINAL, Job.Status.QUEUED, reason, finished_at=None, restarts=0,
                            cancel_requested=False, avoid_nodes=[])
            transaction.on_commit(dispatch.request_tick)
        elif job.status == Job.Status.QUEUED:
            Job.objects.filter(pk=job.pk).update(status_reason=reason, restarts=0)
        else:
            Job.objects.filter(pk=job.pk).update(restarts=0)
            job_set_status(job, Job.ACTIVE, Job.Status.STOPPING, reason)
            attempt = job.attempts.exclude(status=Attempt.Status.ENDED).order_by("-number").first()
            if attempt is not None:
                Attempt.objects.filter(pk=attempt.pk).update(stop_reason="rollback")
                attempt.refresh_from_db()
                attempt_stop(attempt, reason="rollback")
            else:
                job_set_status(job, Job.Status.STOPPING, Job.Status.QUEUED, reason)
                transaction.on_commit(dispatch.request_tick)
    job.refresh_from_db()
    return job


def job_resume(job: Job, *, user: AbstractUser, reason: str) -> Job:
    """A cancelled job (an experiment's early-stopped trial) queued again; its next attempt resumes
    from its latest checkpoint, as after a preemption. Raises TransitionError when the job is not
    CANCELLED or has no checkpoint to resume from (it would start over, which is a new job)."""
    with transaction.atomic():
        job = Job.objects.get(pk=job.pk)
        if job.status != Job.Status.CANCELLED:
            raise TransitionError(f"job {job.pk} is {job.status}: only a cancelled or early-stopped job continues")
        point = resume_checkpoint(job)
        if point is None:
            raise TransitionError(f"job {job.pk} has no checkpoint to continue from", field="job")
        text = f"{reason}: continuing from the checkpoint at step {point.step} ({user.get_username()})"
        if not job_set_status(job, Job.Status.CANCELLED, Job.Status.QUEUED, text[:500], finished_at=None, restarts=0,
                              cancel_requested=False, avoid_nodes=[]):
            raise TransitionError(f"job {job.pk} changed meanwhile; try again")
        job_event(job, "continued", text, actor=user, checkpoint=point.pk, step=point.step)
        transaction.on_commit(dispatch.request_tick)
    job.refresh_from_db()
    return job
