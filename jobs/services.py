"""Every write and state transition. Views, consumers, tasks and the relay call these.

Transitions are compare-and-set (`filter(status=old).update(...)`), each writes a JobEvent, and
side effects (Celery sends) run only after commit.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from functools import partial
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from . import dispatch, selectors
from .models import (Allocation, Attempt, Checkpoint, Job, JobEvent, MetricSample, Node, Quota, QuotaChange,
                     SchedulerLock)
from .policy import checkpoints as ckpt_policy
from .policy import diagnosis, planner, predictor, scheduler
from trainyard import keys
from trainyard.launch import Heartbeat, Launch, NodeExit, RankInfo, Resume
from trainyard.spec import SpecError, parse_job_spec

log = logging.getLogger(__name__)


def _event(job: Job, kind: str, message: str = "", *, attempt: Attempt | None = None, actor=None,
           **data) -> JobEvent:
    event = JobEvent.objects.create(job=job, attempt=attempt, kind=kind, message=message, data=data, actor=actor)
    payload = {"type": "job.event", "event": selectors.event_dict(event)}
    transaction.on_commit(partial(dispatch.publish, f"job.{job.pk}", payload))
    return event


def _publish_status(job: Job) -> None:
    attempt_id = job.attempts.order_by("-number").values_list("pk", flat=True).first()
    payload = {"type": "job.status", "status": job.status, "status_reason": job.status_reason,
               "attempt": attempt_id, "step": job.step}
    transaction.on_commit(partial(dispatch.publish, f"job.{job.pk}", payload))
    transaction.on_commit(partial(dispatch.publish_cluster_changed, "jobs"))


def _set_job_status(job: Job, old: tuple | str, new: str, reason: str = "", **fields) -> bool:
    olds = (old,) if isinstance(old, str) else old
    now = timezone.now()
    if new in Job.TERMINAL:
        fields.setdefault("finished_at", now)
    if new == Job.Status.RUNNING:
        fields.setdefault("started_at", job.started_at or now)
    n = Job.objects.filter(pk=job.pk, status__in=olds).update(status=new, status_reason=reason, **fields)
    if n:
        job.refresh_from_db()
        _publish_status(job)
    return bool(n)


# ---------------------------------------------------------------- submit / cancel

def job_submit(user, data) -> Job:
    """Validate a JobSpec and queue it. Raises SpecError (nothing is created) on bad input."""
    spec = parse_job_spec(data, data_root=settings.TRAINYARD_DATA_ROOT)
    nodes = selectors.cluster_snapshot()
    if not nodes:
        raise SpecError({"resources": ["no nodes have registered yet; start a node agent first"]})
    r = spec.resources
    if not scheduler.fits_cluster(nodes, r.nodes, r.procs_per_node):
        biggest = max(n.slots for n in nodes)
        raise SpecError({"resources": [
            f"needs {r.nodes} node(s) with {r.procs_per_node} slot(s) each, but the cluster has "
            f"{len(nodes)} node(s) with at most {biggest} slot(s): it could never run"]})
    stored = spec.to_json()
    if spec.parallel != "auto":
        stored["parallel"]["dp"] = spec.dp
    plan = planner.describe(stored)
    plan["source"] = ("auto: data parallel over all processes (no strategy search yet)"
                      if spec.parallel == "auto" else "spec")
    team = user.groups.order_by("name").first()
    shape = predictor.shape_from_spec(stored, user.get_username(), team.name if team else None)
    prediction = predictor.predict(shape, selectors.past_runs())
    plan["predicted_s"] = round(prediction.seconds, 1)
    plan["prediction_source"] = prediction.source
    with transaction.atomic():
        job = Job.objects.create(
            name=spec.name, owner=user, team=team, spec=stored, plan=plan, predicted_s=prediction.seconds,
            priority=Job.PRIORITIES[spec.priority], slots=r.world_size)
        _event(job, "submitted", f"submitted by {user.get_username()}", actor=user, plan_source=plan["source"])
        transaction.on_commit(dispatch.request_tick)
        transaction.on_commit(partial(dispatch.publish_cluster_changed, "jobs"))
    return job


class TransitionError(Exception):
    pass


def job_cancel(user, job: Job) -> Job:
    with transaction.atomic():
        job = Job.objects.get(pk=job.pk)
        if job.status in Job.TERMINAL:
            raise TransitionError(f"job is already {job.status}")
        if job.status == Job.Status.QUEUED:
            _set_job_status(job, Job.Status.QUEUED, Job.Status.CANCELLED, f"cancelled by {user.get_username()}")
            _event(job, "cancelled", f"cancelled by {user.get_username()} while queued", actor=user)
            return job
        Job.objects.filter(pk=job.pk).update(cancel_requested=True)
        _set_job_status(job, Job.ACTIVE, Job.Status.STOPPING, f"cancel requested by {user.get_username()}")
        _event(job, "cancel_requested", f"cancel requested by {user.get_username()}", actor=user)
        attempt = job.attempts.exclude(status=Attempt.Status.ENDED).order_by("-number").first()
        if attempt is not None:
            _attempt_stop(attempt, "cancel")
    return job


def _attempt_stop(attempt: Attempt, reason: str) -> None:
    """Ask every node still running this attempt to stop it (inside a transaction)."""
    Attempt.objects.filter(pk=attempt.pk).exclude(status=Attempt.Status.ENDED).update(
        status=Attempt.Status.STOPPING)
    if not attempt.stop_reason:
        Attempt.objects.filter(pk=attempt.pk, stop_reason="").update(stop_reason=reason)
    attempt.refresh_from_db()
    for alloc in attempt.allocations.filter(active=True).select_related("node"):
        transaction.on_commit(partial(dispatch.send_stop, alloc.node.name, attempt.job_id, attempt.pk, reason))
    _attempt_maybe_finish(attempt)


# ---------------------------------------------------------------- scheduling

def schedule_tick() -> list[int]:
    """Place queued jobs, start reclaim preemptions and re-mark borrowing jobs (jobs/policy/
    scheduler.py decides). Serialized: the lock row is taken first in the transaction (FOR UPDATE
    on PostgreSQL; BEGIN IMMEDIATE already holds SQLite's write lock), so two ticks can never both
    see the same free slots."""
    started: list[int] = []
    with transaction.atomic():
        lock, _ = SchedulerLock.objects.select_for_update().get_or_create(pk=1)
        SchedulerLock.objects.filter(pk=1).update(ticks=lock.ticks + 1)
        view = selectors.cluster_view()
        decision = scheduler.schedule(view)
        for placement in decision.placements:
            if _start_attempt(placement):
                started.append(placement.job_id)
        for p in decision.preemptions:
            attempt = Attempt.objects.filter(job_id=p.job_id, status__in=(
                Attempt.Status.STARTING, Attempt.Status.RUNNING)).order_by("-number").first()
            if attempt is not None:
                _attempt_preempt(attempt, p.reason, for_job=p.for_job)
        running = {r.id for r in view.running}
        Job.objects.filter(pk__in=running & decision.borrowing, borrowing=False).update(borrowing=True)
        Job.objects.filter(pk__in=running - decision.borrowing, borrowing=True).update(borrowing=False)
        for job_id, reason in decision.waiting.items():
            Job.objects.filter(pk=job_id, status=Job.Status.QUEUED).exclude(status_reason=reason).update(
                status_reason=reason[:500])
    return started


def eta_refresh() -> int:
    """Predicted start times of queued jobs (the policy run forward over predicted run times);
    beat runs it every 5 s. Writes only the ones that moved by more than 5 s; returns that count."""
    view = selectors.cluster_view()
    etas = scheduler.predict_starts(view)
    changed = 0
    with transaction.atomic():
        for job_id, old in Job.objects.filter(status=Job.Status.QUEUED).values_list("pk", "predicted_start_at"):
            ts = etas.get(job_id)
            new = datetime.fromtimestamp(ts, tz=dt_timezone.utc) if ts is not None and math.isfinite(ts) else None
            if (old is None) != (new is None) or (old and new and abs((old - new).total_seconds()) > 5):
                Job.objects.filter(pk=job_id).update(predicted_start_at=new)
                changed += 1
    return changed


def _start_attempt(placement: scheduler.Placement) -> bool:
    job = Job.objects.get(pk=placement.job_id)
    if not _set_job_status(job, Job.Status.QUEUED, Job.Status.STARTING, "launching on "
                           + ", ".join(s.node for s in placement.shares)
                           + (" (borrowing idle capacity beyond its team's quota)" if placement.borrowing else ""),
                           borrowing=placement.borrowing, predicted_start_at=None):
        return False
    number = (job.attempts.order_by("-number").values_list("number", flat=True).first() or 0) + 1
    checkpoints_reconcile(job)
    resume = _resume_checkpoint(job)
    attempt = Attempt.objects.create(
        job=job, number=number, resumed_from=resume,
        resumed_from_step=resume.step if resume else (0 if number > 1 else None))
    if number > 1:  # progress restarts where this attempt resumes; the charts rewind there too
        Job.objects.filter(pk=job.pk).update(step=attempt.resumed_from_step)
    nodes = {n.name: n for n in Node.objects.filter(name__in=[s.node for s in placement.shares])}
    host = placement.shares[0]
    stream = keys.job_stream(job.pk)
    for share in placement.shares:
        Allocation.objects.create(attempt=attempt, node=nodes[share.node], node_rank=share.node_rank,
                                  slot_ids=list(share.slot_ids))
        payload = Launch(
            job_id=job.pk, attempt_id=attempt.pk, node=share.node, node_rank=share.node_rank,
            nnodes=len(placement.shares), nproc=len(share.slot_ids), slots=list(share.slot_ids),
            device=job.spec["resources"]["device"], rdzv_host=host.address, local_addr=share.address,
            stream=stream, spec=job.spec,
            resume=Resume(path=resume.path, step=resume.step, checkpoint_id=resume.pk) if resume else None,
        ).model_dump(mode="json")
        transaction.on_commit(partial(dispatch.send_launch, share.node, payload))
    where = ", ".join(f"{s.node}[{','.join(map(str, s.slot_ids))}]" for s in placement.shares)
    origin = (f"resuming from the checkpoint at step {resume.step}" if resume
              else "from step 0 (no checkpoint yet)" if number > 1 else "")
    _event(job, "attempt_started", f"attempt {number} placed on {where}" + (f", {origin}" if origin else ""),
           attempt=attempt, nodes=[s.node for s in placement.shares],
           resume_step=attempt.resumed_from_step, checkpoint=resume.pk if resume else None)
    return True


# ---------------------------------------------------------------- node agents

def node_heartbeat(payload: dict) -> tuple[Node, list[int]]:
    """Upsert a node from its agent's heartbeat. Returns the node and the attempts the agent runs
    that the control plane no longer expects there (the caller tells the agent to stop them)."""
    beat = Heartbeat.model_validate(payload)
    name = beat.name
    now = timezone.now()
    fields = {
        "address": beat.address, "slots": beat.slots, "labels": beat.labels, "devices": beat.devices,
        "cpu_percent": beat.cpu_percent, "mem_percent": beat.mem_percent, "agent_id": beat.agent_id,
        "last_heartbeat": now,
    }
    with transaction.atomic():
        node, created = Node.objects.get_or_create(name=name, defaults=fields)
        if not created:
            was_lost = node.status == Node.Status.LOST
            Node.objects.filter(pk=node.pk).update(**fields)
            if was_lost:
                back = (Node.Status.QUARANTINED if node.quarantined_at else
                        Node.Status.CORDONED if node.drain_mode == "cordon" else
                        Node.Status.DRAINING if node.drain_mode else Node.Status.READY)
                Node.objects.filter(pk=node.pk, status=Node.Status.LOST).update(status=back)
                log.info("node %s is back (%s)", name, back)
            node.refresh_from_db()
        transaction.on_commit(partial(dispatch.publish_cluster_changed, "nodes"))
        running = set(beat.attempts)
        expected = set(Allocation.objects.filter(node=node, active=True).values_list("attempt_id", flat=True))
        return node, sorted(running - expected)


def attempt_ranks(attempt_id: int, node_name: str, ranks: list[dict]) -> None:
    with transaction.atomic():
        alloc = Allocation.objects.filter(attempt_id=attempt_id, node__name=node_name).select_related(
            "attempt__job").first()
        if alloc is None:
            return
        infos = [RankInfo.model_validate(r) for r in ranks]
        Allocation.objects.filter(pk=alloc.pk).update(
            ranks=sorted(({"rank": r.rank, "local_rank": r.local_rank, "pid": r.pid} for r in infos),
                         key=lambda r: r["rank"]))
        attempt = alloc.attempt
        waiting = Allocation.objects.filter(attempt=attempt, ranks=[]).exists()
        if waiting:
            return
        if Attempt.objects.filter(pk=attempt.pk, status=Attempt.Status.STARTING).update(
                status=Attempt.Status.RUNNING, started_at=timezone.now()):
            job = attempt.job
            if _set_job_status(job, Job.Status.STARTING, Job.Status.RUNNING, ""):
                _event(job, "running", f"attempt {attempt.number}: all ranks started", attempt=attempt)


def attempt_node_exit(attempt_id: int, node_name: str, result: dict) -> None:
    """A node's processes for an attempt have exited (or were stopped, or never started).
    `result` is a NodeExit's JSON, stored as it came (the evidence diagnosis reads)."""
    report = NodeExit.model_validate(result)
    with transaction.atomic():
        alloc = Allocation.objects.filter(attempt_id=attempt_id, node__name=node_name, active=True).select_related(
            "attempt", "node").first()
        if alloc is None:
            return  # duplicate report, or the node was already written off as lost
        Allocation.objects.filter(pk=alloc.pk).update(active=False, result=result, ended_at=timezone.now())
        attempt = alloc.attempt
        failed = report.exit_code != 0 and not report.stopped
        if failed and attempt.status != Attempt.Status.ENDED and not attempt.stop_reason:
            _attempt_stop(attempt, "failure")
        else:
            _attempt_maybe_finish(attempt)


def nodes_check() -> list[str]:
    """Write off nodes that stopped heartbeating and attempts stuck in launch."""
    now = timezone.now()
    lost: list[str] = []
    with transaction.atomic():
        cutoff = now - timedelta(seconds=settings.TRAINYARD_NODE_LOST_S)
        for node in Node.objects.exclude(status=Node.Status.LOST).filter(last_heartbeat__lt=cutoff):
            Node.objects.filter(pk=node.pk).update(status=Node.Status.LOST)
            lost.append(node.name)
            for alloc in Allocation.objects.filter(node=node, active=True).select_related("attempt"):
                Allocation.objects.filter(pk=alloc.pk).update(
                    active=False, ended_at=now, result={"node": node.name, "node_lost": True, "exit_code": None})
                _attempt_stop(alloc.attempt, f"node_lost:{node.name}")
        launch_cutoff = now - timedelta(seconds=settings.TRAINYARD_LAUNCH_TIMEOUT_S)
        for attempt in Attempt.objects.filter(status=Attempt.Status.STARTING, created_at__lt=launch_cutoff):
            _attempt_stop(attempt, "launch_timeout")
    return lost


def _attempt_maybe_finish(attempt: Attempt) -> None:
    """End the attempt once no node still runs it, and move the job on."""
    if attempt.status == Attempt.Status.ENDED or attempt.allocations.filter(active=True).exists():
        return
    attempt.refresh_from_db()
    job = Job.objects.get(pk=attempt.job_id)
    outcome, failure = _attempt_outcome(job, attempt)
    if not Attempt.objects.filter(pk=attempt.pk).exclude(status=Attempt.Status.ENDED).update(
            status=Attempt.Status.ENDED, outcome=outcome, failure=failure, ended_at=timezone.now()):
        return
    _event(job, "attempt_ended", f"attempt {attempt.number} ended: {outcome}", attempt=attempt,
           outcome=outcome, **({"evidence": failure} if failure else {}))
    if failure.get("node") and failure.get("class") in diagnosis.NODE_FAULT_CLASSES:
        _node_maybe_quarantine(failure["node"], job, attempt)
    if outcome == "succeeded":
        _set_job_status(job, Job.ACTIVE, Job.Status.SUCCEEDED, "")
        _event(job, "succeeded", f"finished {job.total_steps} steps", attempt=attempt)
    elif outcome == "cancelled":
        _set_job_status(job, Job.ACTIVE, Job.Status.CANCELLED, "cancelled")
        _event(job, "cancelled", "all processes stopped", attempt=attempt)
    elif outcome == "preempted":
        point = _resume_checkpoint(job)
        origin = f"resumes from the checkpoint at step {point.step}" if point else "no checkpoint: restarts from step 0"
        _set_job_status(job, Job.ACTIVE, Job.Status.QUEUED, f"preempted ({attempt.preempt_reason}); {origin}"[:500],
                        borrowing=False)
        _event(job, "preempted", f"preempted: {attempt.preempt_reason}; {origin}", attempt=attempt,
               reason=attempt.preempt_reason, resume_step=point.step if point else 0,
               checkpoint=point.pk if point else None)
    elif outcome == "rolled_back":
        point = _resume_checkpoint(job)
        _set_job_status(job, Job.ACTIVE, Job.Status.QUEUED, f"rolling back to step {point.step if point else 0}",
                        avoid_nodes=[])
    elif failure.get("retry") and job.restarts < job.spec.get("max_restarts", 0):
        checkpoints_reconcile(job)
        point = _resume_checkpoint(job)
        origin = f"from the checkpoint at step {point.step}" if point else "from step 0 (no checkpoint yet)"
        _set_job_status(job, Job.ACTIVE, Job.Status.QUEUED, f"restarting after {outcome}, {origin}",
                        restarts=job.restarts + 1, avoid_nodes=list(failure.get("exclude") or []))
        _event(job, "restart", f"restart {job.restarts} of {job.spec.get('max_restarts')} after {outcome}, {origin}"
               + (f"; avoiding {', '.join(failure['exclude'])}" if failure.get("exclude") else ""),
               attempt=attempt, resume_step=point.step if point else 0, checkpoint=point.pk if point else None,
               failure_class=failure.get("class"))
    else:
        why = ("not retried: " if not failure.get("retry") else "no restarts left: ") + (failure.get("message") or outcome)
        if failure.get("suggestion"):
            why += f" ({failure['suggestion']})"
        _set_job_status(job, Job.ACTIVE, Job.Status.FAILED, why[:500])
        _event(job, "failed", why, attempt=attempt, failure_class=failure.get("class"))
    transaction.on_commit(dispatch.request_tick)


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
    if reason in ("", "preempt") and reports and all(r.get("exit_code") == 0 for r in reports):
        return "succeeded", {}  # a job that finished during its preemption grace period simply finished
    if reason == "preempt":
        return "preempted", {"class": "preempted", "retry": True, "message": attempt.preempt_reason}
    if reason == "hang":
        return "failed:hang", attempt.failure  # the detector wrote the evidence when it stopped it
    if reason == "launch_timeout":
        return "failed:launch_timeout", {
            "class": "launch_timeout", "retry": True, "node": not_joined[0] if not_joined else None,
            "exclude": list(not_joined),
            "message": f"ranks did not start within {settings.TRAINYARD_LAUNCH_TIMEOUT_S:.0f} s"
                       + (f" on {', '.join(not_joined)}" if not_joined else "")}
    d = diagnosis.diagnose(reports, node_lost=lost_node, not_joined=not_joined if len(not_joined) < len(allocs) else (),
                           node_mem_percent={a.node.name: a.node.mem_percent or 0.0 for a in allocs})
    outcome = "lost" if d.failure_class == "lost" else f"failed:{d.failure_class}"
    return outcome, {"class": d.failure_class, "retry": d.retry, "rank": d.rank, "node": d.node,
                     "message": d.message, "traceback": d.traceback, "suggestion": d.suggestion,
                     "exclude": list(d.exclude)}


def _node_maybe_quarantine(name: str, job: Job, attempt: Attempt) -> None:
    """Quarantine a node implicated in TRAINYARD_QUARANTINE_FAILURES failures within the window."""
    cutoff = timezone.now() - timedelta(seconds=settings.TRAINYARD_QUARANTINE_WINDOW_S)
    recent = Attempt.objects.filter(ended_at__gte=cutoff, status=Attempt.Status.ENDED).exclude(failure={})
    hits = [a for a in recent.only("id", "failure")
            if a.failure.get("node") == name and a.failure.get("class") in diagnosis.NODE_FAULT_CLASSES]
    if len(hits) < settings.TRAINYARD_QUARANTINE_FAILURES:
        return
    window_min = settings.TRAINYARD_QUARANTINE_WINDOW_S / 60
    reason = (f"implicated in {len(hits)} failures within {window_min:.0f} min (attempts "
              + ", ".join(str(a.pk) for a in hits) + ")")
    if not Node.objects.filter(name=name, quarantined_at__isnull=True).update(
            quarantined_at=timezone.now(), quarantine_reason=reason[:500]):
        return
    Node.objects.filter(name=name).exclude(status=Node.Status.LOST).update(status=Node.Status.QUARANTINED)
    _event(job, "node_quarantined", f"node {name} quarantined: {reason}; an admin clears it on the nodes page",
           attempt=attempt, node=name, failures=[a.pk for a in hits])
    transaction.on_commit(partial(dispatch.publish_cluster_changed, "nodes"))


def node_clear(user, node: Node) -> Node:
    """Lift a quarantine (staff; the API checks). The node takes work again unless it is LOST."""
    with transaction.atomic():
        Node.objects.filter(pk=node.pk).update(quarantined_at=None, quarantine_reason="")
        Node.objects.filter(pk=node.pk, status=Node.Status.QUARANTINED).update(status=_node_base_status(node))
        log.info("node %s cleared by %s", node.name, user.get_username())
        transaction.on_commit(partial(dispatch.publish_cluster_changed, "nodes"))
        transaction.on_commit(dispatch.request_tick)
    node.refresh_from_db()
    return node


def _node_base_status(node: Node) -> str:
    """What a node that is neither lost nor quarantined is: its drain/cordon state or READY."""
    return (Node.Status.CORDONED if node.drain_mode == "cordon" else
            Node.Status.DRAINING if node.drain_mode else Node.Status.READY)


NODE_ACTIONS = ("drain", "cordon", "uncordon")
DRAIN_MODES = ("finish", "preempt")


def node_set_schedulable(user, node: Node, action: str, mode: str | None = None) -> Node:
    """Staff controls (the API checks): `cordon` (no new work, running work continues), `drain`
    (no new work; mode "finish" lets running attempts end, "preempt" checkpoints them away so they
    resume elsewhere) and `uncordon` (takes work again). Raises SpecError for bad input."""
    if action not in NODE_ACTIONS:
        raise SpecError({"action": [f"must be one of {', '.join(NODE_ACTIONS)}"]})
    if action == "drain" and mode not in DRAIN_MODES:
        raise SpecError({"mode": ["must be \"finish\" (running jobs finish) or \"preempt\" (running jobs "
                                  "checkpoint and move)"]})
    who = user.get_username()
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node.pk)
        drain_mode = {"drain": mode, "cordon": "cordon", "uncordon": ""}[action]
        Node.objects.filter(pk=node.pk).update(drain_mode=drain_mode)
        node.drain_mode = drain_mode
        if node.status != Node.Status.LOST and not node.quarantined_at:
            Node.objects.filter(pk=node.pk).update(status=_node_base_status(node))
        log.info("node %s: %s%s by %s", node.name, action, f" ({mode})" if mode else "", who)
        if action == "drain" and mode == "preempt":
            for alloc in Allocation.objects.filter(node=node, active=True).select_related("attempt__job"):
                _attempt_preempt(alloc.attempt, f"node {node.name} is being drained by {who}")
        transaction.on_commit(partial(dispatch.publish_cluster_changed, "nodes"))
        transaction.on_commit(dispatch.request_tick)
    node.refresh_from_db()
    return node


def _attempt_preempt(attempt: Attempt, reason: str, *, for_job: int | None = None) -> bool:
    """Ask a running attempt to checkpoint and exit (cooperative preemption). It ends `preempted`,
    and its job goes back to the queue and resumes from that checkpoint. One still launching
    cannot checkpoint yet and is stopped at once. False if it is already stopping."""
    now = timezone.now()
    if not Attempt.objects.filter(pk=attempt.pk, status__in=(Attempt.Status.STARTING, Attempt.Status.RUNNING),
                                  stop_reason="").update(stop_reason="preempt", preempt_requested_at=now,
                                                         preempt_reason=reason[:500], preempt_for=for_job):
        return False
    attempt.refresh_from_db()
    job = attempt.job
    grace = settings.TRAINYARD_PREEMPT_GRACE_S
    Job.objects.filter(pk=job.pk).update(status_reason=f"preempting: {reason}"[:500])
    job.refresh_from_db()
    _event(job, "preempt_requested", f"preemption requested: {reason}", attempt=attempt, reason=reason,
           for_job=for_job, grace_s=grace)
    if attempt.status == Attempt.Status.STARTING:
        _attempt_stop(attempt, "preempt")
    else:
        transaction.on_commit(partial(dispatch.request_preempt, attempt.pk, reason, grace))
    _publish_status(job)
    return True


# ---------------------------------------------------------------- quotas

QUOTA_KEYS = {"team", "user", "max_slots", "device_hours"}


def quotas_update(actor, entries) -> list[Quota]:
    """Create or change quotas, all or nothing, each change in the audit log (QuotaChange). Entries:
    {"team": name} or {"user": name}, "max_slots": int >= 0, "device_hours": number > 0 or null
    (kept as is when absent). Raises SpecError with per-entry field errors ("0.max_slots")."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list) or not entries:
        raise SpecError({"quotas": ["send a quota object or a non-empty list of them"]})
    errors: dict[str, list[str]] = {}
    parsed = []
    for i, e in enumerate(entries):
        where = f"{i}." if len(entries) > 1 else ""
        if not isinstance(e, dict):
            errors[f"{i}"] = ["must be an object"]
            continue
        for k in sorted(set(e) - QUOTA_KEYS):
            errors[f"{where}{k}"] = ["unknown field"]
        if ("team" in e) == ("user" in e):
            errors[f"{where}team"] = ["give exactly one of team or user"]
            continue
        kind = "team" if "team" in e else "user"
        name = e[kind]
        owner = (Group.objects.filter(name=name).first() if kind == "team"
                 else get_user_model().objects.filter(username=name).first()) if isinstance(name, str) else None
        if owner is None:
            errors[f"{where}{kind}"] = [f"no {kind} named {name!r}"]
        slots = e.get("max_slots")
        if "max_slots" not in e:
            errors[f"{where}max_slots"] = ["required"]
        elif isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= 1_000_000:
            errors[f"{where}max_slots"] = [f"must be a whole number of slots >= 0, got {slots!r}"]
        hours = e.get("device_hours")
        if hours is not None and (isinstance(hours, bool) or not isinstance(hours, (int, float))
                                  or not 0 < hours < 1e9):
            errors[f"{where}device_hours"] = [f"must be a positive number of device-hours or null, got {hours!r}"]
        parsed.append((kind, owner, slots, hours, "device_hours" in e))
    if errors:
        raise SpecError(errors)
    out = []
    with transaction.atomic():
        for kind, owner, slots, hours, has_hours in parsed:
            quota = Quota.objects.select_for_update().filter(**{kind: owner}).first()
            old = {"max_slots": quota.max_slots, "device_hours": quota.device_hours} if quota else None
            if quota is None:
                quota = Quota.objects.create(**{kind: owner}, max_slots=slots, device_hours=hours)
            else:
                quota.max_slots = slots
                if has_hours:
                    quota.device_hours = hours
                quota.save(update_fields=["max_slots", "device_hours", "updated_at"])
            quota_audit(actor, quota, old)
            out.append(quota)
        transaction.on_commit(dispatch.request_tick)
        transaction.on_commit(partial(dispatch.publish_cluster_changed, "quotas"))
    return out


def quota_audit(actor, quota: Quota, old: dict | None) -> None:
    """Record a quota change (the API, the quota page and the Django admin all come here) and let
    the scheduler see it at its next tick."""
    new = {"max_slots": quota.max_slots, "device_hours": quota.device_hours}
    if new == old:
        return
    subject = f"team:{quota.team.name}" if quota.team_id else f"user:{quota.user.get_username()}"
    QuotaChange.objects.create(team=quota.team, user=quota.user, subject=subject, old=old, new=new, actor=actor)
    log.info("quota %s: %s -> %s by %s", subject, old, new, actor)
    transaction.on_commit(dispatch.request_tick)
    transaction.on_commit(partial(dispatch.publish_cluster_changed, "quotas"))


# ---------------------------------------------------------------- hangs and stragglers

def attempts_check() -> dict:
    """Stop hung attempts and flag stragglers, from the telemetry the relay committed. Hangs are
    judged only while the relay is alive: a stopped relay also stops progress in the database."""
    relay_ok = selectors.relay_alive()
    now = timezone.now()
    hung, flagged = [], {}
    grace = timedelta(seconds=settings.TRAINYARD_PREEMPT_GRACE_S)
    for attempt in Attempt.objects.filter(status=Attempt.Status.RUNNING, stop_reason="preempt",
                                          preempt_requested_at__lt=now - grace).select_related("job"):
        with transaction.atomic():  # it did not checkpoint and exit in time: stop it
            _event(attempt.job, "preempt_forced", f"attempt {attempt.number} did not exit within "
                   f"{settings.TRAINYARD_PREEMPT_GRACE_S:.0f} s of its preemption request: stopping it", attempt=attempt)
            _attempt_stop(attempt, "preempt")
    for attempt in Attempt.objects.filter(status=Attempt.Status.RUNNING).select_related("job"):
        recent = selectors.attempt_recent_samples(attempt.pk, attempt.last_step)
        if relay_ok and _attempt_hang_check(attempt, recent, now):
            hung.append(attempt.pk)
            continue
        ranks = _attempt_stragglers_check(attempt, recent)
        if ranks:
            flagged[attempt.pk] = ranks
    return {"hung": hung, "stragglers": flagged, "relay_alive": relay_ok}


def _attempt_hang_check(attempt: Attempt, recent: list[dict], now) -> bool:
    started = attempt.started_at or attempt.created_at
    check = diagnosis.hang_check(
        now=now.timestamp(), started=started.timestamp(),
        last_progress=attempt.last_progress_at.timestamp() if attempt.last_progress_at else None,
        spec_timeout=attempt.job.spec.get("hang_timeout_s", "auto"),
        recent_step_s=[s["step_s"] for s in recent if s["step_s"] is not None],
        floor_s=settings.TRAINYARD_HANG_FLOOR_S)
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
        _event(attempt.job, "hang_detected", evidence["message"], attempt=attempt, evidence=evidence)
        _attempt_stop(attempt, "hang")
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
                _event(attempt.job, "straggler",
                       f"rank {f['rank']} on {f['node']} is {(f['ratio'] - 1) * 100:.0f}% slower than the median "
                       f"of its peers ({f['work_s'] * 1000:.1f} ms vs {f['median_s'] * 1000:.1f} ms of work per step)",
                       attempt=attempt, **f)
        for rank, f in before.items():
            if rank not in {x["rank"] for x in now}:
                _event(attempt.job, "straggler_cleared", f"rank {rank} on {f.get('node')} has recovered",
                       attempt=attempt, rank=rank, node=f.get("node"))
        if {f["rank"] for f in now} != set(before):
            _publish_status(attempt.job)
    return [f["rank"] for f in now]


# ---------------------------------------------------------------- checkpoints and rollback

def _checkpoint_root() -> Path:
    return Path(settings.TRAINYARD_CHECKPOINT_ROOT).resolve()


def _job_checkpoint_dir(job_id: int) -> Path:
    return keys.job_checkpoint_dir(_checkpoint_root(), job_id)


def _ckpt_states(job: Job) -> list[ckpt_policy.CheckpointState]:
    return [ckpt_policy.CheckpointState(c.pk, c.step, c.created_at.timestamp(), c.superseded, c.pinned,
                                        c.deleted_at is not None) for c in job.checkpoints.all()]


def _resume_checkpoint(job: Job) -> Checkpoint | None:
    """The checkpoint the next attempt loads; one whose directory vanished (deleted by hand) is
    written off instead of failing the attempt on a missing path."""
    while (point := ckpt_policy.resume_point(_ckpt_states(job))) is not None:
        c = Checkpoint.objects.get(pk=point.id)
        if Path(c.path).is_dir():
            return c
        log.warning("checkpoint %s of job %s is missing on disk (%s): skipping it", c.pk, job.pk, c.path)
        Checkpoint.objects.filter(pk=c.pk).update(deleted_at=timezone.now())
        _publish_checkpoint(c)
    return None


def _publish_checkpoint(c: Checkpoint) -> None:
    payload = {"type": "job.checkpoint", "checkpoint": selectors.checkpoint_dict(c)}
    transaction.on_commit(partial(dispatch.publish, f"job.{c.job_id}", payload))


def _is_superseded(job: Job, attempt: Attempt, step: int) -> bool:
    """A checkpoint registered late (Redis was away; a save finished while its attempt stopped)
    belongs to a discarded future when a later attempt resumed from an earlier step or an admin
    rolled back behind it since its attempt began."""
    later = job.attempts.filter(number__gt=attempt.number).values_list("resumed_from_step", flat=True)
    if any((r or 0) < step for r in later):
        return True
    rollbacks = job.events.filter(kind="rollback", created_at__gte=attempt.created_at).values_list("data", flat=True)
    return any(int(d.get("step", 0)) < step for d in rollbacks)


def checkpoint_register(attempt_id: int, data: dict) -> Checkpoint | None:
    """Register a complete checkpoint, reported by the runtime's rank 0 after its directory got its
    final name (or found on disk by checkpoints_reconcile). Idempotent per (job, path)."""
    attempt = Attempt.objects.select_related("job").filter(pk=attempt_id).first()
    if attempt is None:
        return None
    job = attempt.job
    try:
        step, path = int(data["step"]), Path(str(data["path"])).resolve()
    except (KeyError, TypeError, ValueError):
        log.warning("ignoring malformed checkpoint report for attempt %s: %r", attempt_id, data)
        return None
    if path.parent != _job_checkpoint_dir(job.pk) or step < 0:
        log.warning("ignoring checkpoint %s of job %s: not under %s", path, job.pk, _job_checkpoint_dir(job.pk))
        return None
    with transaction.atomic():
        existing = Checkpoint.objects.filter(job=job, path=str(path)).first()
        if existing is not None:
            return existing

        def num(key: str) -> float:
            v = data.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0

        c = Checkpoint.objects.create(job=job, attempt=attempt, step=step, path=str(path),
                                      size_bytes=int(num("size_bytes")), blocking_s=num("blocking_s"),
                                      save_s=num("save_s"), superseded=_is_superseded(job, attempt, step))
        _publish_checkpoint(c)
        _apply_retention(job)
    return c


def _apply_retention(job: Job) -> None:
    keep = int((job.spec.get("checkpoint") or {}).get("keep", 3))
    doomed = ckpt_policy.retention(_ckpt_states(job), keep)
    if not doomed:
        return
    Checkpoint.objects.filter(pk__in=doomed).update(deleted_at=timezone.now())
    for c in Checkpoint.objects.filter(pk__in=doomed):
        _publish_checkpoint(c)
        transaction.on_commit(partial(_delete_checkpoint_files, c.path))


def _delete_checkpoint_files(path: str) -> None:
    p = Path(path).resolve()
    if _checkpoint_root() not in p.parents:
        log.error("refusing to delete %s: outside the checkpoint root %s", p, _checkpoint_root())
        return
    shutil.rmtree(p, ignore_errors=True)


def checkpoints_reconcile(job: Job) -> int:
    """Register complete checkpoints found on disk but never reported (the runtime died, or Redis
    lost the report, between its rename and its report). A directory counts only with its
    manifest trainyard.json, which rank 0 writes last, before the rename."""
    root = _job_checkpoint_dir(job.pk)
    if not root.is_dir():
        return 0
    known = set(job.checkpoints.values_list("path", flat=True))
    found = 0
    for manifest in sorted(root.glob(f"{keys.STEP_DIR_GLOB}/{keys.MANIFEST}")):
        if str(manifest.parent.resolve()) in known:
            continue
        try:
            meta = json.loads(manifest.read_text())
            attempt_id = int(meta["attempt_id"])
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("unreadable checkpoint manifest %s", manifest)
            continue
        if not job.attempts.filter(pk=attempt_id).exists():
            continue
        if checkpoint_register(attempt_id, {**meta, "path": str(manifest.parent)}) is not None:
            found += 1
            log.info("registered checkpoint %s from its manifest", manifest.parent)
    return found


def checkpoint_pin(user, checkpoint: Checkpoint, pinned: bool) -> Checkpoint:
    with transaction.atomic():
        c = Checkpoint.objects.select_for_update().get(pk=checkpoint.pk)
        if c.deleted_at is not None:
            raise TransitionError("the checkpoint's files were deleted by retention; it cannot be pinned")
        if c.pinned != pinned:
            Checkpoint.objects.filter(pk=c.pk).update(pinned=pinned)
            c.refresh_from_db()
            _event(c.job, "checkpoint_pinned" if pinned else "checkpoint_unpinned",
                   f"checkpoint at step {c.step} {'pinned' if pinned else 'unpinned'} by {user.get_username()}",
                   actor=user, checkpoint=c.pk, step=c.step)
            _publish_checkpoint(c)
            if not pinned:
                _apply_retention(c.job)
    return c


def job_rollback(user, job: Job, checkpoint_id) -> Job:
    """Rewind a job to one of its checkpoints: later checkpoints are superseded, a running attempt
    stops (outcome rolled_back), and the next attempt resumes from the checkpoint. A finished job
    runs again. Raises SpecError (field errors) for a bad checkpoint, TransitionError when the job
    is being cancelled."""
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, (int, str)) or not str(checkpoint_id).isdigit():
        raise SpecError({"checkpoint": ["must be the id of one of this job's checkpoints"]})
    with transaction.atomic():
        job = Job.objects.get(pk=job.pk)
        target = Checkpoint.objects.filter(pk=int(checkpoint_id)).first()
        if not job.checkpoints.exists():
            raise SpecError({"checkpoint": [f"job {job.pk} has no checkpoints to roll back to"]})
        if target is None or target.job_id != job.pk:
            raise SpecError({"checkpoint": [f"checkpoint {checkpoint_id} is not a checkpoint of job {job.pk}"]})
        if target.deleted_at is not None:
            raise SpecError({"checkpoint": [f"checkpoint {target.pk} (step {target.step}) was deleted by retention; "
                                            "pick a checkpoint that still exists"]})
        if not Path(target.path).is_dir():
            raise SpecError({"checkpoint": [f"checkpoint {target.pk} (step {target.step}): its files are missing "
                                            f"at {target.path}"]})
        if job.cancel_requested and job.status not in Job.TERMINAL:
            raise TransitionError("the job is being cancelled")
        doomed = ckpt_policy.rollback_supersedes(_ckpt_states(job), next(
            s for s in _ckpt_states(job) if s.id == target.pk))
        Checkpoint.objects.filter(pk__in=doomed).update(superseded=True)
        Checkpoint.objects.filter(pk=target.pk).update(superseded=False)
        for c in Checkpoint.objects.filter(pk__in=[*doomed, target.pk]):
            _publish_checkpoint(c)
        who = user.get_username()
        _event(job, "rollback", f"{who} rolled back to the checkpoint at step {target.step}"
               + (f"; {len(doomed)} later checkpoint(s) superseded" if doomed else ""),
               actor=user, checkpoint=target.pk, step=target.step, superseded=doomed, from_status=job.status)
        reason = f"rolling back to step {target.step} ({who})"
        if job.status in Job.TERMINAL:
            _set_job_status(job, Job.TERMINAL, Job.Status.QUEUED, reason, finished_at=None, restarts=0,
                            cancel_requested=False, avoid_nodes=[])
            transaction.on_commit(dispatch.request_tick)
        elif job.status == Job.Status.QUEUED:
            Job.objects.filter(pk=job.pk).update(status_reason=reason, restarts=0)
        else:
            Job.objects.filter(pk=job.pk).update(restarts=0)
            _set_job_status(job, Job.ACTIVE, Job.Status.STOPPING, reason)
            attempt = job.attempts.exclude(status=Attempt.Status.ENDED).order_by("-number").first()
            if attempt is not None:
                Attempt.objects.filter(pk=attempt.pk).update(stop_reason="rollback")
                attempt.refresh_from_db()
                _attempt_stop(attempt, "rollback")
            else:
                _set_job_status(job, Job.Status.STOPPING, Job.Status.QUEUED, reason)
                transaction.on_commit(dispatch.request_tick)
    job.refresh_from_db()
    return job


# ---------------------------------------------------------------- telemetry

METRIC_FIELDS = MetricSample.FIELDS
_METRIC_TYPES = frozenset((int, float, type(None)))
_INT64 = 2**63


def _metric_row(job_id: int, attempt_id: int, s: dict) -> tuple | None:
    """One sample's INSERT parameters, or None for a sample no database would accept (rank, step
    and ts are required, rank/step non-negative ints, everything else a number or null), so one bad
    sample never rejects the batch it came in. ~3 us: this runs for every sample."""
    vals = tuple(map(s.get, METRIC_FIELDS))
    rank, step = vals[0], vals[1]
    if type(rank) is not int or type(step) is not int or rank < 0 or step < 0 or vals[2] is None:
        return None
    if not _METRIC_TYPES.issuperset(map(type, vals)):
        return None
    for v in vals:
        if type(v) is int and not -_INT64 <= v < _INT64:
            return None
    return (job_id, attempt_id) + vals


_TELEMETRY_SQL: dict[str, tuple[str, str, str]] = {}


def _telemetry_sql(vendor: str) -> tuple[str, str, str]:
    """(attempt -> job lookup, sample INSERT, job step UPDATE) for this database.

    Raw SQL: the ORM's bulk_create spent ~95% of the relay's time building SQL and model
    instances (2.9k samples/s; ~40k/s with executemany), and the ORM lookup + update cost ~1.5 ms
    of a ~3 ms round at low rates. The INSERT skips (attempt, rank, step) duplicates: OR IGNORE on
    SQLite, ON CONFLICT DO NOTHING on PostgreSQL."""
    from django.db import connection
    from django.db.models.constants import OnConflict

    if vendor in _TELEMETRY_SQL:
        return _TELEMETRY_SQL[vendor]
    ops, qn = connection.ops, connection.ops.quote_name
    meta, att, job = MetricSample._meta, Attempt._meta, Job._meta
    columns = [meta.get_field("job").column, meta.get_field("attempt").column,
               *(meta.get_field(f).column for f in METRIC_FIELDS)]
    insert = " ".join(filter(None, [
        ops.insert_statement(on_conflict=OnConflict.IGNORE), qn(meta.db_table),
        "(" + ", ".join(qn(c) for c in columns) + ")",
        "VALUES (" + ", ".join(["%s"] * len(columns)) + ")",
        ops.on_conflict_suffix_sql(None, OnConflict.IGNORE, None, None)]))
    lookup = (f"SELECT {qn(att.pk.column)}, {qn(att.get_field('job').column)} FROM {qn(att.db_table)} "
              f"WHERE {qn(att.pk.column)} IN ")
    step = qn(job.get_field("step").column)
    update = f"UPDATE {qn(job.db_table)} SET {step} = %s WHERE {qn(job.pk.column)} = %s AND {step} < %s"
    _TELEMETRY_SQL[vendor] = lookup, insert, update
    return lookup, insert, update


def telemetry_ingest(samples: list[dict], events: list[dict]) -> dict[int, int]:
    """Store a batch of metric samples (idempotent: duplicates of (attempt, rank, step) are skipped)
    and runtime events, in one transaction. Returns job id -> highest step seen in the batch."""
    from django.db import connection

    lookup, insert, update = _telemetry_sql(connection.vendor)
    wanted = {a for a in (s.get("attempt") for s in samples) if type(a) is int}
    wanted |= {a for a in (e.get("attempt") for e in events) if type(a) is int}
    with transaction.atomic(), connection.cursor() as cursor:
        # Inside the (IMMEDIATE) transaction: an attempt deleted meanwhile cannot break the FK.
        attempts: dict[int, int] = {}
        if wanted:
            cursor.execute(lookup + "(" + ", ".join(["%s"] * len(wanted)) + ")", list(wanted))
            attempts = dict(cursor.fetchall())
        rows, top, attempt_top, malformed = [], {}, {}, 0
        for s in samples:
            attempt_id = s.get("attempt")
            job_id = attempts.get(attempt_id) if type(attempt_id) is int else None
            if job_id is None:
                continue  # an attempt this database does not know (e.g. deleted job): drop, never crash
            row = _metric_row(job_id, attempt_id, s)
            if row is None:
                malformed += 1
                continue
            rows.append(row)
            if row[3] > top.get(job_id, 0):
                top[job_id] = row[3]
            if row[3] > attempt_top.get(attempt_id, -1):
                attempt_top[attempt_id] = row[3]
        if malformed:
            log.warning("dropped %d malformed metric samples", malformed)
        if rows:
            cursor.executemany(insert, rows)
        for job_id, step in top.items():
            cursor.execute(update, [step, job_id, step])
        now = timezone.now()
        for attempt_id, step in attempt_top.items():  # the hang detector's evidence
            Attempt.objects.filter(pk=attempt_id, last_step__lt=step).update(last_step=step, last_progress_at=now)
        for e in events:
            attempt_id = e.get("attempt")
            job_id = attempts.get(attempt_id) if type(attempt_id) is int else None
            if job_id is not None:
                _runtime_event(job_id, attempt_id, e)
    return top


RANK_PLAN_KEYS = ("strategy", "coords", "role", "param_bytes", "optim_bytes")


def _rank_plan(attempt_id: int, e: dict) -> None:
    """What one rank really holds under the plan (mesh coordinates, role, parameter and optimizer
    bytes): kept on the attempt, shown per rank on the job page and in the API."""
    rank = e.get("rank")
    if type(rank) is not int:
        return
    attempt = Attempt.objects.select_for_update().filter(pk=attempt_id).first()
    if attempt is None:
        return
    plans = dict(attempt.rank_plans or {})
    plans[str(rank)] = {k: e[k] for k in RANK_PLAN_KEYS if k in e}
    Attempt.objects.filter(pk=attempt_id).update(rank_plans=plans)


def _runtime_event(job_id: int, attempt_id: int, e: dict) -> None:
    kind = e.get("kind")
    if kind == "checkpoint":
        checkpoint_register(attempt_id, e)
    elif kind == "resumed":
        load_s = e.get("load_s") if isinstance(e.get("load_s"), (int, float)) else None
        job = Job.objects.get(pk=job_id)
        _event(job, "resumed", f"rank {e.get('rank')} loaded the checkpoint at step {e.get('step')}"
               + (f" in {load_s:.2f} s" if load_s is not None else ""), attempt=Attempt(pk=attempt_id),
               step=e.get("step"), load_s=load_s, path=e.get("path"))
    elif kind == "rank_plan":
        _rank_plan(attempt_id, e)
    elif kind == "telemetry_dropped":
        JobEvent.objects.create(job_id=job_id, attempt_id=attempt_id, kind=kind,
                                message=f"rank {e.get('rank')} dropped {e.get('count')} telemetry samples "
                                        "while Redis was unreachable", data=e)
