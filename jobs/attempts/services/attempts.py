"""Attempts: stop, preempt, finish (outcome, diagnosis, restart or fail), hang and straggler checks.

An attempt ends once no node still runs it; its outcome then moves the job on (succeeded,
cancelled, back to the queue, or failed) as jobs/attempts/policy/diagnosis.py classifies the evidence.
A node implicated in TRAINYARD_QUARANTINE_FAILURES faults within the window (failed attempts blamed on
it, GPU Xid/ECC errors its agent reported) is quarantined.
"""
from __future__ import annotations

import logging
from datetime import timedelta
from functools import partial

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs.core import dispatch
from jobs.attempts import selectors
from jobs.models import Attempt, Job
from jobs.attempts.policy import diagnosis
from jobs.attempts.services.adapt import adapt_after_oom
from jobs.attempts.services.busaccess import attempt_access_end, attempt_access_fence
from jobs.attempts.services.checkpoints import checkpoints_reconcile, resume_checkpoint
from jobs.attempts.services.elastic import elastic_after_loss
from jobs.attempts.services.events import job_event, job_publish_status, job_set_status
from jobs.planning.services.knowledge import knowledge_record
from jobs.attempts.services.profiling import attempt_profile_update

log = logging.getLogger(__name__)


def attempt_stop(attempt: Attempt, *, reason: str) -> None:
    """Ask every node still running this attempt to stop it (inside a transaction)."""
    Attempt.objects.filter(pk=attempt.pk).exclude(status=Attempt.Status.ENDED).update(
        status=Attempt.Status.STOPPING)
    if not attempt.stop_reason:
        Attempt.objects.filter(pk=attempt.pk, stop_reason="").update(stop_reason=reason)
    attempt.refresh_from_db()
    for alloc in attempt.allocations.filter(active=True).select_related("node"):
        transaction.on_commit(partial(dispatch.send_stop, alloc.node.name, attempt.job_id, attempt.pk, reason))
    attempt_maybe_finish(attempt)


def attempt_maybe_finish(attempt: Attempt) -> bool:
    """End the attempt once no node still runs it, and move the job on; True if it ended now.
    (A failure blamed on a node may then quarantine it: jobs.fleet.services, which handles the
    reports and losses through which such failures arrive.)"""
    if attempt.status == Attempt.Status.ENDED or attempt.allocations.filter(active=True).exists():
        return False
    attempt.refresh_from_db()
    job = Job.objects.get(pk=attempt.job_id)
    outcome, failure = _attempt_outcome(job, attempt)
    if not Attempt.objects.filter(pk=attempt.pk).exclude(status=Attempt.Status.ENDED).update(
            status=Attempt.Status.ENDED, outcome=outcome, failure=failure, ended_at=timezone.now()):
        return False
    attempt_access_end(attempt)  # its Redis user goes (a fenced one keeps the read of its fence)
    job_event(job, "attempt_ended", f"attempt {attempt.number} ended: {outcome}", attempt=attempt,
           outcome=outcome, **({"evidence": failure} if failure else {}))
    knowledge_record(attempt)  # whatever the outcome: its warm steps measured the configuration
    if outcome == "succeeded":
        job_set_status(job, Job.ACTIVE, Job.Status.SUCCEEDED, "")
        job_event(job, "succeeded", _success_text(job, attempt), attempt=attempt)
    elif outcome == "cancelled":
        job_set_status(job, Job.ACTIVE, Job.Status.CANCELLED, "cancelled")
        job_event(job, "cancelled", "all processes stopped", attempt=attempt)
    elif outcome == "early_stopped":
        # an experiment's stop (jobs/experiments): checkpointed like a preemption, but it ends here;
        # the job can be continued from that checkpoint later (trial_continue)
        point = resume_checkpoint(job)
        at = f"checkpoint at step {point.step}" if point else "no checkpoint"
        job_set_status(job, Job.ACTIVE, Job.Status.CANCELLED, f"early stopped: {attempt.preempt_reason}; {at}"[:500],
                       borrowing=False)
        job_event(job, "early_stopped", f"early stopped: {attempt.preempt_reason}; {at}", attempt=attempt,
                  reason=attempt.preempt_reason, step=point.step if point else None,
                  checkpoint=point.pk if point else None)
    elif outcome == "preempted":
        point = resume_checkpoint(job)
        origin = f"resumes from the checkpoint at step {point.step}" if point else "no checkpoint: restarts from step 0"
        job_set_status(job, Job.ACTIVE, Job.Status.QUEUED, f"preempted ({attempt.preempt_reason}); {origin}"[:500],
                        borrowing=False)
        job_event(job, "preempted", f"preempted: {attempt.preempt_reason}; {origin}", attempt=attempt,
               reason=attempt.preempt_reason, resume_step=point.step if point else 0,
               checkpoint=point.pk if point else None)
    elif outcome == "rolled_back":
        point = resume_checkpoint(job)
        job_set_status(job, Job.ACTIVE, Job.Status.QUEUED, f"rolling back to step {point.step if point else 0}",
                        avoid_nodes=[])
    elif outcome == "failed:oom" and adapt_after_oom(job, attempt, failure):
        pass  # adapt auto: re-planned to a plan that needs less memory (or failed with the closest one)
    elif elastic_after_loss(job, attempt, outcome, failure):
        pass  # an elastic job restarts at once on the surviving nodes (services/elastic.py)
    elif failure.get("retry") and job.restarts < job.spec.get("max_restarts", 0):
        checkpoints_reconcile(job)
        point = resume_checkpoint(job)
        origin = f"from the checkpoint at step {point.step}" if point else "from step 0 (no checkpoint yet)"
        job_set_status(job, Job.ACTIVE, Job.Status.QUEUED, f"restarting after {outcome}, {origin}",
                        restarts=job.restarts + 1, avoid_nodes=list(failure.get("exclude") or []))
        job_event(job, "restart", f"restart {job.restarts} of {job.spec.get('max_restarts')} after {outcome}, {origin}"
               + (f"; avoiding {', '.join(failure['exclude'])}" if failure.get("exclude") else ""),
               attempt=attempt, resume_step=point.step if point else 0, checkpoint=point.pk if point else None,
               failure_class=failure.get("class"))
    else:
        why = ("not retried: " if not failure.get("retry") else "no restarts left: ") + (failure.get("message") or outcome)
        if failure.get("suggestion"):
            why += f" ({failure['suggestion']})"
        job_set_status(job, Job.ACTIVE, Job.Status.FAILED, why[:500])
        job_event(job, "failed", why, attempt=attempt, failure_class=failure.get("class"))
    transaction.on_commit(dispatch.request_tick)
    return True


def _attempt_outcome(job: Job, attempt: Attempt) -> tuple[str, dict]:
    """The attempt's outcome and, for a failure, the evidence and the policy (retry, exclude)."""
    allocs = list(attempt.allocations.select_related("node"))
    reports = [a.result or {} for a in allocs]
    reason = attempt.stop_reason
    # A lost node is the cause even when its peers' comm errors (consequences) were reported first.
    lost_node = next((r.get("node") for r in reports if r.get("node_lost")), None)
    not_joined = tuple(a.node.name for a in allocs if not a.ranks)
    if job.cancel_requested or reason == "cancel":
        return "cancelled", {}
    if reason == "rollback":
        return "rolled_back", {}
    if reason in ("", "preempt", "early_stop") and reports and all(r.get("exit_code") == 0 for r in reports):
        return "succeeded", {}  # a job that finished during its preemption grace period simply finished
    if reason == "early_stop":
        return "early_stopped", {}
    if reason == "preempt":
        return "preempted", {"class": "preempted", "retry": True, "message": attempt.preempt_reason}
    if reason == "hang":
        return "failed:hang", attempt.failure  # the detector wrote the evidence when it stopped it
    if reason in ("placement", "placement_refused"):  # a pool's scheduler (Slurm) failed the allocation
        # (retried), or refused the request itself (a bad partition or account: not retried); its words
        # are on the attempt's SlurmJob (jobs/fleet/services/slurm.py)
        message = getattr(getattr(attempt, "slurm", None), "error", "") or "the pool's scheduler failed the allocation"
        return "failed:placement", {"class": "placement", "retry": reason == "placement", "node": None,
                                    "exclude": [], "message": message}
    if reason == "launch_timeout":
        return "failed:launch_timeout", {
            "class": "launch_timeout", "retry": True, "node": not_joined[0] if not_joined else None,
            "exclude": list(not_joined),
            "message": f"ranks did not start within {settings.TRAINYARD_LAUNCH_TIMEOUT_S:.0f} s"
                       + (f" on {', '.join(not_joined)}" if not_joined else "")}
    d = diagnosis.diagnose(reports, node_lost=lost_node, not_joined=not_joined if len(not_joined) < len(allocs) else (),
                           node_mem_percent={a.node.name: a.node.mem_percent or 0.0 for a in allocs},
                           device=(job.spec.get("resources") or {}).get("device", "cpu"))
    outcome = "lost" if d.failure_class == "lost" else f"failed:{d.failure_class}"
    return outcome, {"class": d.failure_class, "retry": d.retry, "rank": d.rank, "node": d.node,
                     "message": d.message, "traceback": d.traceback, "suggestion": d.suggestion,
                     "exclude": list(d.exclude)}


def attempt_preempt(attempt: Attempt, *, reason: str, for_job: int | None = None, end: bool = False) -> bool:
    """Ask a running attempt to checkpoint and exit (cooperative preemption). It ends `preempted`,
    and its job goes back to the queue and resumes from that checkpoint. One still launching
    cannot checkpoint yet and is stopped at once. False if it is already stopping.

    `end`: the same stop, but the job then ends (outcome `early_stopped`, job CANCELLED with its
    checkpoint): an experiment's early stop (jobs/experiments), which may continue it later."""
    now = timezone.now()
    kind = "early_stop" if end else "preempt"
    if not Attempt.objects.filter(pk=attempt.pk, status__in=(Attempt.Status.STARTING, Attempt.Status.RUNNING),
                                  stop_reason="").update(stop_reason=kind, preempt_requested_at=now,
                                                         preempt_reason=reason[:500], preempt_for=for_job):
        return False
    attempt.refresh_from_db()
    job = attempt.job
    grace = settings.TRAINYARD_PREEMPT_GRACE_S
    Job.objects.filter(pk=job.pk).update(status_reason=f"preempting: {reason}"[:500])
    job.refresh_from_db()
    job_event(job, "preempt_requested", f"{'early stop' if end else 'preemption'} requested: {reason}",
              attempt=attempt, reason=reason, for_job=for_job, grace_s=grace, end=end)
    if attempt.status == Attempt.Status.STARTING:
        attempt_stop(attempt, reason=kind)
    else:
        transaction.on_commit(partial(dispatch.request_preempt, attempt.pk, reason, grace))
    job_publish_status(job)
    return True


def _success_text(job: Job, attempt: Attempt) -> str:
    if not job.spec.get("entrypoint"):
        return f"finished {job.total_steps} steps"
    # user code: train.steps is only what it said it would run; say what it reported
    return (f"the entrypoint exited 0 after step {attempt.last_step}" if attempt.last_step
            else "the entrypoint exited 0 (it reported no steps)")


def attempts_check() -> dict:
    """Stop hung attempts, flag stragglers and profile what bounds each step (services.profiling),
    from the telemetry the relay committed. Hangs are judged only while the relay is alive: a
    stopped relay also stops progress in the database; and idle time counts only from the
    running relay's start (a restarted relay commits what was trained meanwhile after it, and
    on a loaded machine catching up can take a while)."""
    relay_since = selectors.relay_alive()
    relay_ok = relay_since is not None and relay_since is not False
    since = float(relay_since) if relay_ok else 0.0
    now = timezone.now()
    hung, flagged, profiles = [], {}, {}
    grace = timedelta(seconds=settings.TRAINYARD_PREEMPT_GRACE_S)
    for attempt in Attempt.objects.filter(status=Attempt.Status.RUNNING, stop_reason__in=("preempt", "early_stop"),
                                          preempt_requested_at__lt=now - grace).select_related("job"):
        with transaction.atomic():  # it did not checkpoint and exit in time: stop it
            job_event(attempt.job, "preempt_forced", f"attempt {attempt.number} did not exit within "
                   f"{settings.TRAINYARD_PREEMPT_GRACE_S:.0f} s of its preemption request: stopping it", attempt=attempt)
            attempt_stop(attempt, reason="preempt")
    for attempt in Attempt.objects.filter(status=Attempt.Status.RUNNING).select_related("job"):
        recent = selectors.attempt_recent_samples(attempt.pk, attempt.last_step)
        if relay_ok and _attempt_hang_check(attempt, now, since):
            hung.append(attempt.pk)
            continue
        ranks = _attempt_stragglers_check(attempt, recent)
        if ranks:
            flagged[attempt.pk] = ranks
        if attempt.stop_reason == "":
            attempt_profile_update(attempt, recent)
            profiles[attempt.pk] = attempt.profile.get("class")
    return {"hung": hung, "stragglers": flagged, "profiles": profiles, "relay_alive": relay_ok}


def _attempt_hang_check(attempt: Attempt, now, relay_since: float) -> bool:
    """`relay_since`: the epoch second the running relay started; no idle time counts before it."""
    started = attempt.started_at or attempt.created_at
    progress = attempt.last_progress_at.timestamp() if attempt.last_progress_at else None
    check = diagnosis.hang_check(
        now=now.timestamp(), started=max(started.timestamp(), relay_since),
        last_progress=max(progress, relay_since) if progress is not None else None,
        spec_timeout=attempt.job.spec.get("hang_timeout_s", "auto"),
        recent_step_s=selectors.attempt_recent_step_s(attempt.pk, attempt.last_step),
        floor_s=settings.TRAINYARD_HANG_FLOOR_S, user_code=bool(attempt.job.spec.get("entrypoint")))
    if not check.hung:
        return False
    with transaction.atomic():
        evidence = {"class": "hang", "retry": True, "rank": None, "node": None,
                    "message": f"no step progress for {check.idle_s:.0f} s (timeout {check.timeout_s:.0f} s, "
                               f"{check.source}) after step {attempt.last_step}",
                    "last_step": attempt.last_step, "idle_s": round(check.idle_s, 1),
                    "timeout_s": round(check.timeout_s, 1), "timeout_source": check.source}
        if not Attempt.objects.filter(pk=attempt.pk, status=Attempt.Status.RUNNING, stop_reason="").update(
                failure=evidence):
            return False
        job_event(attempt.job, "hang_detected", evidence["message"], attempt=attempt, evidence=evidence)
        attempt_stop(attempt, reason="hang")
    return True


def _attempt_stragglers_check(attempt: Attempt, recent: list[dict]) -> list[int]:
    work: dict[int, list[float]] = {}
    for s in recent:
        parts = (s["data_s"], s["compute_s"], s["optim_s"])
        if None not in parts:
            work.setdefault(s["rank"], []).append(sum(parts))
    before = {f["rank"]: f for f in attempt.stragglers or []}
    found = diagnosis.stragglers(work, frozenset(before))
    nodes = selectors.attempt_rank_nodes(attempt.pk)
    step = attempt.last_step
    now = [{"rank": f.rank, "node": nodes.get(f.rank), "ratio": f.ratio, "work_s": round(f.work_s, 6),
            "median_s": round(f.median_s, 6), "since_step": before.get(f.rank, {}).get("since_step", step)}
           for f in found]
    if {f["rank"] for f in now} == set(before) and not now:
        return []
    with transaction.atomic():
        Attempt.objects.filter(pk=attempt.pk).update(stragglers=now)
        for f in now:
            if f["rank"] not in before:
                job_event(attempt.job, "straggler",
                       f"rank {f['rank']} on {f['node']} is {(f['ratio'] - 1) * 100:.0f}% slower than the median "
                       f"of its peers ({f['work_s'] * 1000:.1f} ms vs {f['median_s'] * 1000:.1f} ms of work per step)",
                       attempt=attempt, **f)
        for rank, f in before.items():
            if rank not in {x["rank"] for x in now}:
                job_event(attempt.job, "straggler_cleared", f"rank {rank} on {f.get('node')} has recovered",
                       attempt=attempt, rank=rank, node=f.get("node"))
        if {f["rank"] for f in now} != set(before):
            job_publish_status(attempt.job)
    return [f["rank"] for f in now]


def attempt_fence(attempt: Attempt, node: str) -> None:
    """Fence an attempt written off with a lost node: its ranks may run on behind a partition.
    From here on nothing of it beyond the last step the control plane accepted is taken in (the
    relay drops its later samples, checkpoint_register refuses its later checkpoints), and the
    fence is set in Redis, where every rank of it polls (trainyard/sdk/reporter.py): the moment a
    rank reaches Redis again it exits, before it flushes another sample or starts a checkpoint."""
    if attempt.fenced_step is not None:
        return
    Attempt.objects.filter(pk=attempt.pk, fenced_step__isnull=True).update(fenced_step=attempt.last_step)
    attempt.fenced_step = attempt.last_step
    job_event(attempt.job, "fenced", f"attempt {attempt.number} fenced at step {attempt.last_step}: node {node} "
              f"was lost, so its ranks may still run; nothing of theirs after that step is kept",
              attempt=attempt, node=node, step=attempt.last_step)
    transaction.on_commit(partial(dispatch.fence, attempt.pk, f"node_lost:{node}"))
    attempt_access_fence(attempt)  # its ranks may read the fence, and write nothing more
