"""Receivers for model lifecycle signals (connected in jobs.apps.JobsConfig.ready)."""
from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django.db.backends.signals import connection_created
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from trainyard.private import tighten

from jobs.core import dispatch
from jobs.telemetry import keptlogs
from jobs.access import tokens
from jobs.models import ApiToken, Job


@receiver(post_delete, sender=Job, dispatch_uid="jobs.kept_logs_cleanup")
def remove_kept_logs(sender, instance: Job, **kwargs) -> None:
    """A deleted job (the Django admin can delete jobs) takes its kept logs with it, once the delete
    has committed; the relay keeps no more lines for a job it cannot find."""
    job_id, root = instance.pk, settings.TRAINYARD_KEPT_LOG_ROOT
    transaction.on_commit(lambda: keptlogs.remove_job(root, job_id))


def _revoke(group: str, reason: str) -> None:
    """Close the websockets in `group` once the change has committed (best effort, like every publish:
    a socket that misses it still fails its next authentication)."""
    transaction.on_commit(lambda: dispatch.publish(group, {"type": "auth.revoked", "reason": reason}))


@receiver(post_delete, sender=ApiToken, dispatch_uid="jobs.token_revoked")
def token_revoked(sender, instance: ApiToken, **kwargs) -> None:
    _revoke(tokens.token_group(instance.pk), "token revoked")


@receiver(post_save, sender=settings.AUTH_USER_MODEL, dispatch_uid="jobs.user_deactivated")
def user_deactivated(sender, instance, **kwargs) -> None:
    if not instance.is_active:
        _revoke(tokens.user_group(instance.pk), "user deactivated")


@receiver(post_delete, sender=settings.AUTH_USER_MODEL, dispatch_uid="jobs.user_deleted")
def user_deleted(sender, instance, **kwargs) -> None:
    _revoke(tokens.user_group(instance.pk), "user deleted")


_tightened: set[str] = set()


@receiver(connection_created, dispatch_uid="jobs.private_sqlite")
def private_sqlite(sender, connection, **kwargs) -> None:
    """A SQLite database (and its -wal and -shm files, which SQLite creates with the database's mode)
    is 0600: SQLite creates it under the umask (0644 by default) on the first connection, so the
    first connection of each process tightens it, whoever created it (migrate, daphne, a worker)."""
    name = str(connection.settings_dict.get("NAME") or "")
    if connection.vendor != "sqlite" or name in _tightened or name.startswith("file:") or ":memory:" in name:
        return
    for path in (name, f"{name}-wal", f"{name}-shm"):
        tighten(path)
    _tightened.add(name)
