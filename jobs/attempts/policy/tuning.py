"""Closed-loop tuning of a sustained bottleneck (`adapt: auto`), pure: what the control plane does
next about a running attempt's profile (jobs/attempts/policy/profiling.py) and the job's open
bottleneck adaptation, if any. jobs/attempts/services/tuning.py applies the decision.

One adaptation at a time moves through these states (its `Job.adaptations` entry's `outcome`):

    waiting    the profile's class (communication-bound, or input-bound where a knob exists) has
               held for SUSTAIN_STEPS steps of the attempt with the same recommended change, of at
               least profiling.MIN_GAIN predicted: the change waits for the next checkpoint (one
               whose step is at least the step it was armed at), so the restart loses nothing
               but the steps since that checkpoint
    measuring  applied: the job restarted from that checkpoint with the change; the next attempt
               measures the same profiling window (services.profiling's `recommendation_result`)
    kept       the step got faster (measured gain > 0): the change stays
    reverting  it did not: the old values wait for the attempt's next checkpoint, as above
    reverted   the old values are back; the profile never offers that change again (profiling's
               `_tried`: a measured result that did not pay)
    dropped    the class or the recommendation changed while waiting: nothing was applied

A job adapts at most `adapt_max` times (OOM re-plans and bottleneck changes together; a revert is
part of its adaptation, a dropped one does not count).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jobs.attempts.policy import profiling
from jobs.attempts.policy.adapt import may_adapt

SUSTAIN_STEPS = 20  # steps the class must hold (after the profile's own warm-up and window)
OPEN = ("waiting", "measuring", "reverting")
TUNABLE = (profiling.COMM, profiling.INPUT)


@dataclass(frozen=True)
class TuningState:
    """What the decision reads: the job's settings and adaptations, the running attempt's profile
    (with `class_since_step`, the attempt's step its class was first seen at) and progress, the
    step of the job's latest complete checkpoint, and the measured results of applied changes
    (profiling's `recommendation_result` data, each naming the `applied` event's id)."""

    adapt: str
    adapt_max: int
    adaptations: Sequence[Mapping]
    profile: Mapping
    attempt_number: int
    last_step: int
    checkpoint_step: int | None
    results: Sequence[Mapping] = ()


@dataclass(frozen=True)
class Decision:
    action: str  # none | arm | drop | apply | keep | revert_arm | revert
    reason: str = ""
    change: Mapping | None = None


def open_entry(adaptations: Sequence[Mapping]) -> tuple[int, Mapping] | tuple[None, None]:
    """(index, entry) of the job's bottleneck adaptation still in progress, if any."""
    for i in range(len(adaptations) - 1, -1, -1):
        a = adaptations[i]
        if a.get("kind") == "bottleneck" and a.get("outcome") in OPEN:
            return i, a
    return None, None


def sustained(profile: Mapping, last_step: int) -> tuple[bool, str]:
    """Whether the profile is a bottleneck the control plane may act on by itself now."""
    rec = profile.get("recommendation") or {}
    cls = profile.get("class")
    if cls not in TUNABLE:
        return False, f"the job is {cls or 'not profiled'}"
    if not rec.get("change") or rec.get("kind") in ("none", "revert"):
        return False, "no spec change is recommended"
    if (rec.get("predicted_gain") or 0) < profiling.MIN_GAIN:
        return False, f"the predicted gain is under {profiling.MIN_GAIN:.0%}"
    since = profile.get("class_since_step")
    held = last_step - since if since is not None else 0
    if held < SUSTAIN_STEPS:
        return False, f"{cls}-bound for {held} of {SUSTAIN_STEPS} steps"
    return True, f"{cls}-bound for {held} steps"


def _measured(entry: Mapping, results: Sequence[Mapping]) -> Mapping | None:
    return next((r for r in results if entry.get("applied_event") and r.get("applied") == entry["applied_event"]),
                None)


def decide(s: TuningState) -> Decision:
    """The next move for the job (see the module docstring)."""
    _, entry = open_entry(s.adaptations)
    if entry is None:
        if s.adapt != "auto":
            return Decision("none", "adapt is advise")
        ok, held = sustained(s.profile, s.last_step)
        if not ok:
            return Decision("none", held)
        allowed, why = may_adapt(s.adapt, s.adapt_max, s.adaptations)
        if not allowed:
            return Decision("none", why)
        return Decision("arm", held, dict(s.profile["recommendation"]["change"]))
    armed_ok = s.checkpoint_step is not None and s.checkpoint_step >= entry.get("armed_step", 0)
    if entry["outcome"] == "waiting":
        if entry.get("attempt_number") != s.attempt_number:
            return Decision("drop", "the attempt it was armed on ended first")
        rec = s.profile.get("recommendation") or {}
        if s.profile.get("class") != entry.get("class") or rec.get("change") != entry.get("change"):
            return Decision("drop", f"the profile changed while waiting for a checkpoint (now {s.profile.get('class')})")
        return Decision("apply", "a checkpoint at or after the arming step", entry["change"]) if armed_ok \
            else Decision("none", "waiting for the next checkpoint")
    if entry["outcome"] == "measuring":
        result = _measured(entry, s.results)
        if result is None:
            return Decision("none", "measuring")
        gain = result.get("measured_gain") or 0
        if gain > 0:
            return Decision("keep", f"the step got {gain:.0%} faster")
        return Decision("revert_arm", f"the step did not get faster ({gain:+.0%})", dict(entry["before"]))
    return Decision("revert", "a checkpoint at or after the arming step", dict(entry["before"])) if armed_ok \
        else Decision("none", "waiting for the next checkpoint to revert")
