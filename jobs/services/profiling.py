"""Profiles of running attempts: what bounds the step and the recommended change
(jobs/policy/profiling.py decides), stored on `Attempt.profile` by the periodic attempts check.

A change of class is a "profile" job event; every change of the stored profile goes to the job
page as a `profile` websocket message after commit. Applying the recommendation is a user's
request and lives with the other ones in jobs.py (`job_apply_recommendation`).
"""
from __future__ import annotations

from functools import partial

from django.db import transaction
from django.utils import timezone

from .. import dispatch
from ..models import Attempt
from ..policy import profiling
from .events import job_event

NAMES = {profiling.COMPUTE: "compute-bound", profiling.COMM: "communication-bound", profiling.INPUT: "input-bound",
         profiling.UNKNOWN: "not enough telemetry"}


def _round(profile: dict) -> dict:
    """Shares to 0.1%: a profile is stored (and published) again only when it visibly changes."""
    if profile.get("shares"):
        profile["shares"] = {k: round(v, 3) for k, v in profile["shares"].items()}
    return profile


def attempt_profile_update(attempt: Attempt, recent: list[dict]) -> bool:
    """Profile a running attempt from its recent samples (selectors.attempt_recent_samples);
    True when the stored profile changed."""
    job = attempt.job
    before = attempt.profile or {}
    new = _round(profiling.profile(recent, job.spec, before, first_step=attempt.resumed_from_step or 0))
    if {k: v for k, v in before.items() if k not in ("updated_at", "at_step")} == new:
        return False
    new |= {"updated_at": timezone.now().isoformat(), "at_step": attempt.last_step}
    with transaction.atomic():
        if not Attempt.objects.filter(pk=attempt.pk, status=Attempt.Status.RUNNING).update(profile=new):
            return False
        attempt.profile = new
        old_class = before.get("class")
        if new["class"] != old_class and not (old_class is None and new["class"] == profiling.UNKNOWN):
            job_event(job, "profile", _event_text(new), attempt=attempt, **{"class": new["class"]},
                      previous=old_class, shares=new["shares"], recommendation=new["recommendation"])
        payload = {"type": "job.profile", "attempt": attempt.pk, "profile": new}
        transaction.on_commit(partial(dispatch.publish, f"job.{job.pk}", payload))
    return True


def _event_text(p: dict) -> str:
    text = NAMES[p["class"]]
    if p.get("shares"):
        s = p["shares"]
        text += (f" (compute {s['compute']:.0%}, communication {s['communication']:.0%}, "
                 f"data wait {s['input']:.0%} of the step)")
    rec = p.get("recommendation")
    if rec and rec.get("change"):
        text += f": {rec['text']}; predicted {rec['predicted_gain']:+.0%} faster"
    return text
