"""Each attempt's own credentials on the bus (issue 21 section 3): its Redis user, created before
its launches are sent and deleted when it ends, and the secrets its sealed Launch carries.

The secrets derive from the master key (TRAINYARD_NODE_KEY) and the attempt's salt
(trainyard/attemptauth.py), so nothing secret is stored and a launch sent again carries the same
ones. Redis keeps the users in its ACL file (dispatch.bus_user_grant saves it); whatever a restart,
a lost message or a server without an ACL file leaves out of step is put right by
`attempt_access_reconcile` (the nodes check, every 2 s): a live attempt without its user gets it, a
user of an attempt that ended is deleted. A fenced attempt (written off with a lost node) keeps a
user that may only read its preemption key for FENCED_KEEP_S, so ranks that come back from a
partition read their fence and exit instead of training on unseen.
"""
from __future__ import annotations

from datetime import timedelta
from functools import partial

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from trainyard import attemptauth

from jobs.core import dispatch
from jobs.models import Attempt

FENCED_KEEP_S = 24 * 3600
LIVE = (Attempt.Status.STARTING, Attempt.Status.RUNNING, Attempt.Status.STOPPING)


def attempt_secrets(attempt: Attempt) -> attemptauth.AttemptSecrets:
    return attemptauth.derive(settings.TRAINYARD_NODE_KEY.encode(), attempt.pk, attempt.bus_salt)


def attempt_access_grant(attempt: Attempt) -> None:
    """After commit, before the launches (on_commit callbacks run in order): the attempt's user."""
    transaction.on_commit(partial(dispatch.bus_user_grant, attempt.pk, attempt.job_id,
                                  attempt_secrets(attempt).redis_password))


def attempt_access_end(attempt: Attempt) -> None:
    """The attempt ended: its user goes (a fenced one keeps only the read of its fence)."""
    if attempt.fenced_step is not None:
        attempt_access_fence(attempt)
    else:
        transaction.on_commit(partial(dispatch.bus_user_revoke, [attempt.pk]))


def attempt_access_fence(attempt: Attempt) -> None:
    transaction.on_commit(partial(dispatch.bus_user_grant, attempt.pk, attempt.job_id,
                                  attempt_secrets(attempt).redis_password, fenced=True))


def attempt_access_reconcile() -> dict:
    """Bring the attempts' Redis users in line with the database; what it did."""
    existing = dispatch.bus_users()
    if existing is None:
        return {"redis": False}
    live = dict(Attempt.objects.filter(status__in=LIVE).values_list("pk", "job_id"))
    keep_fenced = set(Attempt.objects.filter(
        status=Attempt.Status.ENDED, fenced_step__isnull=False,
        ended_at__gte=timezone.now() - timedelta(seconds=FENCED_KEEP_S)).values_list("pk", flat=True))
    granted = []
    for attempt in Attempt.objects.filter(pk__in=set(live) - existing):
        if attempt.fenced_step is not None:
            continue
        dispatch.bus_user_grant(attempt.pk, attempt.job_id, attempt_secrets(attempt).redis_password)
        granted.append(attempt.pk)
    revoked = sorted(existing - set(live) - keep_fenced)
    dispatch.bus_user_revoke(revoked)
    return {"redis": True, "granted": granted, "revoked": revoked}
