"""Receivers for model lifecycle signals (connected in jobs.apps.JobsConfig.ready)."""
from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django.db.models.signals import post_delete
from django.dispatch import receiver

from . import keptlogs
from .models import Job


@receiver(post_delete, sender=Job, dispatch_uid="jobs.kept_logs_cleanup")
def remove_kept_logs(sender, instance: Job, **kwargs) -> None:
    """A deleted job (the Django admin can delete jobs) takes its kept logs with it, once the delete
    has committed; the relay keeps no more lines for a job it cannot find."""
    job_id, root = instance.pk, settings.TRAINYARD_ARTIFACT_ROOT
    transaction.on_commit(lambda: keptlogs.remove_job(root, job_id))
