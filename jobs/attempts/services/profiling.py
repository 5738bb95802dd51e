"""Profiles of running attempts: what bounds the step and the recommended change
(jobs/attempts/policy/profiling.py decides), stored on `Attempt.profile` by the periodic attempts check.

A change of class is a "profile" job event; every change of the stored profile goes to the job
page as a `profile` websocket message after commit. The first profile of the attempt after an
applied recommendation (a person's, or adapt auto's) writes a "recommendation_result" event: the measured step time against
the one before and the prediction, so a change that did not pay shows on the timeline. Applying the recommendation is a user's
request and lives with the other ones in jobs.py (`job_apply_recommendation`).
"""
from __future__ import annotations

from functools import partial

from django.db import transaction
from django.utils import timezone

from jobs.core import dispatch
from jobs.models import Attempt
from jobs.attempts.policy import profiling
from jobs.attempts.services.events import job_event

NAMES = {profiling.COMPUTE: "compute-bound", profiling.COMM: "communication-bound", profiling.INPUT: "input-bound",
         profiling.UNKNOWN: "not enough telemetry"}


# Kept beside the policy's profile: when it was stored, at which step, and the step its class was
# first seen at in this attempt (a sustained bottleneck is measured from it: services.tuning).
KEPT = ("updated_at", "at_step", "class_since_step")


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
    results = [e.data for e in job.events.filter(kind="recommendation_result").order_by("id")]
    described = None
    if job.spec.get("entrypoint"):  # run.prepare described the model: its comm changes can be applied
        described = next((p["model"] for p in (attempt.rank_plans or {}).values()
                          if isinstance(p, dict) and isinstance(p.get("model"), dict)), None)
    new = _round(profiling.profile(recent, job.spec, before, first_step=attempt.resumed_from_step or 0,
                                   results=results, model=described))
    if {k: v for k, v in before.items() if k not in KEPT} == new:
        return False
    since = before.get("class_since_step") if before.get("class") == new["class"] else attempt.last_step
    new |= {"updated_at": timezone.now().isoformat(), "at_step": attempt.last_step, "class_since_step": since}
    with transaction.atomic():
        if not Attempt.objects.filter(pk=attempt.pk, status=Attempt.Status.RUNNING).update(profile=new):
            return False
        attempt.profile = new
        old_class = before.get("class")
        if new["class"] != old_class and not (old_class is None and new["class"] == profiling.UNKNOWN):
            job_event(job, "profile", _event_text(new), attempt=attempt, **{"class": new["class"]},
                      previous=old_class, shares=new["shares"], recommendation=new["recommendation"])
        if new.get("shares"):
            _applied_result(attempt, new)
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


def _applied_result(attempt: Attempt, profile: dict) -> None:
    """Once per applied recommendation, on the first later attempt with enough telemetry."""
    job = attempt.job
    applied = (job.events.filter(kind__in=("recommendation_applied", "adapted")).select_related("attempt")
               .order_by("-id").first())  # a person's, or adapt auto's (services.tuning)
    if (applied is None or applied.attempt is None or applied.attempt.number >= attempt.number
            or job.events.filter(kind="recommendation_result", data__applied=applied.pk).exists()):
        return
    before, after = applied.data.get("step_s"), profile["window"]["step_s"]
    if not before or not after:
        return
    measured = round(before / after - 1, 4)
    predicted = applied.data.get("predicted_gain")
    change = ", ".join(f"{k} {v}" for k, v in (applied.data.get("after") or {}).items())
    job_event(job, "recommendation_result",
              f"with {change}: {after * 1000:.1f} ms a step, was {before * 1000:.1f} ms (speed {measured:+.0%}"
              + (f"; predicted {predicted:+.0%})" if predicted is not None else ")"), attempt=attempt,
              applied=applied.pk, step_s_before=before, step_s_after=after, measured_gain=measured,
              predicted_gain=predicted, before=applied.data.get("before"), after=applied.data.get("after"),
              recommendation=applied.data.get("recommendation"))
