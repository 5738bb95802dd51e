"""Spec changes to a running job from its profile: a person's (jobs/runs/services.py
`job_apply_recommendation`) and adapt auto's own after a sustained bottleneck (`attempts_tune`,
every attempts check; jobs/attempts/policy/tuning.py decides).

Either way the change is validated like a submit (SpecError: nothing changes), stored with the
plan described anew, and the attempt stops like a rollback (outcome rolled_back), so the next
attempt resumes from the latest checkpoint with the new spec; services.profiling then measures the
same window on it (`recommendation_result`). adapt auto arms a sustained recommendation, applies it
once a checkpoint at or after that step is complete, keeps it if the step got faster and otherwise
reverts it at the next checkpoint; each step is a timeline event and its `Job.adaptations` entry
carries the evidence (shares and window), the change, the predicted and the measured effect.
"""
from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from jobs.attempts.policy import checkpoints as ckpt_policy
from jobs.attempts.policy import profiling
from jobs.attempts.policy import tuning as policy
from jobs.attempts.services.attempts import attempt_stop
from jobs.attempts.services.checkpoints import checkpoint_states, checkpoints_reconcile, resume_checkpoint
from jobs.attempts.services.events import job_event, job_set_status
from jobs.core.errors import TransitionError
from jobs.models import Attempt, Job
from jobs.planning import autoplan
from jobs.planning.services.knowledge import knowledge_adaptation
from trainyard.spec import SpecError

log = logging.getLogger(__name__)


def spec_value(spec: dict, path: str):
    for part in path.split("."):
        spec = spec[part]
    return spec


def spec_change_apply(job: Job, attempt: Attempt, change: dict, *, describe, **data):
    """Inside a transaction: run `job` with `change` (dotted spec paths -> values) from its latest
    checkpoint, stopping `attempt`. `describe(text, step)` is the event's message for the change
    text ("a -> b, ...") and the checkpoint's step; `data` goes on the event ("kind" names it).
    Returns (the event, before, after). SpecError when a rule refuses the new spec, TransitionError
    when the job has no checkpoint yet; nothing changes then."""
    changed = profiling.spec_with_change(job.spec, change)
    new_spec = changed.to_json()
    checkpoints_reconcile(job)
    point = resume_checkpoint(job)
    if point is None:
        raise TransitionError("the job has no checkpoint yet to restart from: apply after its first "
                              f"checkpoint (every {job.spec['checkpoint']['every_steps']} steps)", field="checkpoint")
    before = {k: spec_value(job.spec, k) for k in change}
    after = {k: spec_value(new_spec, k) for k in change}
    Job.objects.filter(pk=job.pk).update(spec=new_spec, plan=autoplan.replanned(job.plan, changed))
    text = ", ".join(f"{k} {before[k]} -> {after[k]}" for k in after)
    kind = data.pop("kind")
    event = job_event(job, kind, describe(text, point.step), attempt=attempt, before=before, after=after,
                      step_s=((attempt.profile or {}).get("window") or {}).get("step_s"),
                      profile_class=(attempt.profile or {}).get("class"), checkpoint=point.pk, step=point.step,
                      **data)
    job_set_status(job, Job.Status.RUNNING, Job.Status.STOPPING,
                   f"applying {text}: restarting from step {point.step}"[:500])
    Attempt.objects.filter(pk=attempt.pk).update(stop_reason="rollback")
    attempt.refresh_from_db()
    attempt_stop(attempt, reason="rollback")
    return event, before, after


def attempts_tune() -> dict:
    """adapt auto on every running attempt of a running job: {attempt id: the action taken}."""
    out = {}
    for attempt in Attempt.objects.filter(status=Attempt.Status.RUNNING, stop_reason="",
                                          job__status=Job.Status.RUNNING).select_related("job"):
        if attempt.job.spec.get("adapt") != "auto" or not (attempt.profile or attempt.job.adaptations):
            continue
        try:
            action = attempt_tune(attempt)
        except Exception:  # one job's trouble must not stop the others' checks
            log.exception("adapt auto: attempt %s not tuned", attempt.pk)
            continue
        if action != "none":
            out[attempt.pk] = action
    return out


def _checkpoint_step(job: Job) -> int | None:
    point = ckpt_policy.resume_point(checkpoint_states(job))
    return point.step if point else None


def attempt_tune(attempt: Attempt) -> str:
    """One decision for `attempt`'s job, applied in one transaction; returns its action."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=attempt.job_id)
        attempt = Attempt.objects.get(pk=attempt.pk)
        if job.status != Job.Status.RUNNING or attempt.status != Attempt.Status.RUNNING or attempt.stop_reason:
            return "none"
        results = [{**e.data} for e in job.events.filter(kind="recommendation_result").order_by("id")]
        state = policy.TuningState(
            adapt=job.spec.get("adapt", "advise"), adapt_max=int(job.spec.get("adapt_max", 3)),
            adaptations=list(job.adaptations or []), profile=attempt.profile or {}, attempt_number=attempt.number,
            last_step=attempt.last_step or 0, checkpoint_step=_checkpoint_step(job), results=results)
        decision = policy.decide(state)
        if decision.action != "none":
            ACTIONS[decision.action](job, attempt, state, decision)
        return decision.action


def _save(job: Job, index: int | None, entry: dict) -> None:
    history = list(job.adaptations or [])
    if index is None:
        history.append(entry)
    else:
        history[index] = entry
    Job.objects.filter(pk=job.pk).update(adaptations=history)
    job.adaptations = history


def _arm(job, attempt, state, decision) -> None:
    p = state.profile
    rec = p["recommendation"]
    shares = p.get("shares") or {}
    entry = {"kind": "bottleneck", "class": p["class"], "attempt_number": attempt.number,
             "at": timezone.now().isoformat(), "armed_step": state.last_step, "change": dict(decision.change),
             "before": rec.get("before"), "recommendation": rec.get("kind"), "text": rec.get("text"),
             "evidence": {"shares": shares, "window": p.get("window"), "since_step": p.get("class_since_step")},
             "predicted": {"gain": rec.get("predicted_gain"), "step_s": rec.get("predicted_step_s")},
             "step_s_before": (p.get("window") or {}).get("step_s"), "outcome": "waiting", "applied": False}
    _save(job, None, entry)
    change = ", ".join(f"{k} {v}" for k, v in decision.change.items())
    job_event(job, "adapt_waiting", f"{p['class']}-bound for {decision.reason.split(' for ')[-1]} "
              f"({_shares_text(shares)}): setting {change} at the next checkpoint; predicted "
              f"{(rec.get('predicted_gain') or 0):+.0%} faster", attempt=attempt,
              **{k: v for k, v in entry.items() if k != "kind"})


def _shares_text(shares: dict) -> str:
    return ", ".join(f"{k} {v:.0%}" for k, v in shares.items())


def _drop(job, attempt, state, decision) -> None:
    index, entry = policy.open_entry(state.adaptations)
    _save(job, index, {**entry, "outcome": "dropped", "dropped": decision.reason})
    job_event(job, "adapt_dropped", f"not applying {entry['text'] or entry['change']}: {decision.reason}",
              attempt=attempt, change=entry["change"], reason=decision.reason)


def _apply(job, attempt, state, decision) -> None:
    index, entry = policy.open_entry(state.adaptations)
    n = sum(1 for a in state.adaptations if a.get("applied", True)) + 1
    try:
        event, before, after = spec_change_apply(
            job, attempt, dict(decision.change), kind="adapted", cause="bottleneck", recommendation=entry["recommendation"],
            predicted_gain=entry["predicted"]["gain"], predicted_step_s=entry["predicted"]["step_s"],
            evidence=entry["evidence"], adaptation=n,
            describe=lambda text, step: (f"adapt auto ({n} of {state.adapt_max}): {entry['class']}-bound "
                                         f"({_shares_text(entry['evidence']['shares'])}): {text}; restarting "
                                         f"from the checkpoint at step {step}"))
    except (SpecError, TransitionError) as exc:
        _save(job, index, {**entry, "outcome": "dropped", "dropped": str(exc)[:300]})
        job_event(job, "adapt_dropped", f"not applying {entry['change']}: {exc}", attempt=attempt)
        return
    _save(job, index, {**entry, "outcome": "measuring", "applied": True, "applied_event": event.pk,
                       "before": before, "after": after, "resume_step": event.data["step"]})


def _keep(job, attempt, state, decision) -> None:
    index, entry = policy.open_entry(state.adaptations)
    result = next(r for r in state.results if r.get("applied") == entry["applied_event"])
    done = {**entry, "outcome": "kept", "step_s_after": result.get("step_s_after"),
            "measured_gain": result.get("measured_gain")}
    _save(job, index, done)
    knowledge_adaptation(job, attempt, done)  # the next job of this shape starts with it
    job_event(job, "adapt_kept", f"kept {_change_text(entry)}: {decision.reason} "
              f"({_ms(result.get('step_s_after'))} a step, was {_ms(result.get('step_s_before'))}; predicted "
              f"{(entry['predicted']['gain'] or 0):+.0%})", attempt=attempt, **_outcome(done))


def _revert_arm(job, attempt, state, decision) -> None:
    index, entry = policy.open_entry(state.adaptations)
    result = next(r for r in state.results if r.get("applied") == entry["applied_event"])
    _save(job, index, {**entry, "outcome": "reverting", "armed_step": state.last_step,
                       "step_s_after": result.get("step_s_after"), "measured_gain": result.get("measured_gain")})
    job_event(job, "adapt_reverting", f"{_change_text(entry)} made no gain: {decision.reason} "
              f"({_ms(result.get('step_s_after'))} a step, was {_ms(result.get('step_s_before'))}): "
              "reverting it at the next checkpoint; it is not offered again", attempt=attempt,
              change=entry["change"], before=entry.get("before"), step_s_before=result.get("step_s_before"),
              step_s_after=result.get("step_s_after"), measured_gain=result.get("measured_gain"),
              predicted_gain=(entry.get("predicted") or {}).get("gain"))


def _revert(job, attempt, state, decision) -> None:
    index, entry = policy.open_entry(state.adaptations)
    try:
        spec_change_apply(job, attempt, dict(decision.change), kind="adapt_reverted", reverted=entry["change"],
                          measured_gain=entry.get("measured_gain"),
                          describe=lambda text, step: f"reverted ({text}): it measured "
                                                      f"{(entry.get('measured_gain') or 0):+.0%}; restarting "
                                                      f"from the checkpoint at step {step}")
    except (SpecError, TransitionError) as exc:
        log.warning("job %s: revert of %s not applied: %s", job.pk, entry["change"], exc)
        return
    _save(job, index, {**entry, "outcome": "reverted"})
    knowledge_adaptation(job, attempt, {**entry, "outcome": "reverted"})  # never started with


def _change_text(entry: dict) -> str:
    return ", ".join(f"{k} {entry['before'].get(k)} -> {v}" for k, v in (entry.get("after") or entry["change"]).items())


def _ms(s) -> str:
    return f"{s * 1000:.1f} ms" if s else "?"


def _outcome(entry: dict) -> dict:
    return {k: entry.get(k) for k in ("class", "change", "before", "after", "predicted", "step_s_before",
                                      "step_s_after", "measured_gain", "outcome", "evidence")}


ACTIONS = {"arm": _arm, "drop": _drop, "apply": _apply, "keep": _keep, "revert_arm": _revert_arm, "revert": _revert}
