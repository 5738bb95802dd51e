"""Slurm pools (issue 27): an admitted attempt placed on a pool's seats becomes one Slurm job
(`sbatch --nodes=N --ntasks-per-node=1 --no-requeue`) whose body runs an ephemeral Trainyard agent
on every allocated node (workers/slurm_agent.py); the agents register as the seats, with a
credential minted for this allocation only, and from then on everything is today's path (launch,
ranks, telemetry, checkpoints, stop, preemption). This module is the imperative shell around
trainyard/slurm.py's backend:

    gang_start(attempt)      the tick placed an attempt on seats: its SlurmJob row, the seats'
                             credentials and Redis users, then (after commit) the submit task
    gang_submit(id)          sbatch (idempotent on the attempt's tag); a refusal is a placement failure
    seat_heartbeat_ok(...)   a seat's heartbeat counts only from the Slurm job that holds it
    seat_up(holder)          every seat's agent registered: the launches go out (compare-and-set)
    slurm_poll()             batched status: Slurm's pending reason on the job, ends, cancels, releases;
                             a gang on a node Slurm drains or downs checkpoints and moves
    slurm_reconcile()        our tagged Slurm jobs with no live attempt are cancelled

Two queues, one truth: Trainyard's quotas, priorities and fair share decide what is admitted (the
seats are how many nodes of the pool Trainyard may hold at once); Slurm decides when the machines
are there, and its reason is shown while it pends.
"""
from __future__ import annotations

import json
import logging
import secrets
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from functools import partial

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from trainyard import backends, nodeauth, redis_acl
from trainyard.backends import Handle, State
from jobs.core import dispatch
from jobs.models import Allocation, Attempt, Job, Node, Pool, SlurmJob
from jobs.attempts.services.attempts import attempt_fence, attempt_maybe_finish, attempt_preempt, attempt_stop
from jobs.attempts.services.events import job_event
from jobs.attempts.services.launch import launch_payload
from jobs.fleet.services.identity import master_key, security_event
from jobs.fleet.services.pools import seat_shape

log = logging.getLogger(__name__)
AGENTS_FILE = "agents.json"
# An answer-less Slurm job (squeue, sacct and scontrol all silent, or the login node unreachable)
# is never taken as gone at once: SkyPilot lost live allocations that way (#10457). After this
# long without any answer, one whose agents never registered is given up as a placement failure.
UNKNOWN_GIVE_UP_S = 300.0
RESUBMIT_AFTER_S = 10.0   # a SUBMITTING row whose submit task did not finish (worker killed, Slurm away)
STOP_GRACE_S = 30.0       # a stop the agents have not finished, or agents still there after the attempt
                          # ended: scancel --signal (then scancel) after this
LIVE = (SlurmJob.State.SUBMITTING, SlurmJob.State.PENDING, SlurmJob.State.RUNNING, SlurmJob.State.UNKNOWN)


def backend_for(pool: Pool):
    from trainyard.slurm import SlurmBackend, SlurmSettings

    return SlurmBackend(pool.name, SlurmSettings.model_validate(pool.settings))


def _seat_secrets(seat: str, salt: str) -> tuple[str, str]:
    """(the seat's node credential, its Redis password) for this allocation's salt."""
    key = master_key()
    return nodeauth.derive_credential(key, seat, salt), nodeauth.derive_credential(key, f"redis/{seat}", salt)


def _redis_base() -> str:
    """The Redis URL the agents connect to: the control plane's, without its user and password
    (each agent gets its seat's own); TRAINYARD_SLURM_REDIS_URL when the compute nodes reach Redis
    at another address."""
    from urllib.parse import urlsplit, urlunsplit

    base = settings.TRAINYARD_SLURM_REDIS_URL or settings.REDIS_URL
    parts = urlsplit(base)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


# ---------------------------------------------------------------- start and submit

def gang_start(attempt: Attempt) -> SlurmJob:
    """The attempt was placed on a pool's seats (attempt_start created its allocations and sent
    nothing): its SlurmJob, each seat's fresh credential and Redis user, and the submit task after
    commit. Inside the tick's transaction."""
    allocs = list(attempt.allocations.filter(active=True).select_related("node").order_by("node_rank"))
    pool = Pool.objects.get(pk=allocs[0].node.pool_id)
    sj = SlurmJob.objects.create(attempt=attempt, pool=pool, seats=[a.node.name for a in allocs])
    for alloc in allocs:
        salt = secrets.token_hex(16)
        credential, redis_password = _seat_secrets(alloc.node.name, salt)
        Node.objects.filter(pk=alloc.node_id).update(
            holder=sj, credential_salt=salt, credential_digest=nodeauth.fingerprint(credential),
            address="", agent_id="", last_heartbeat=None, status=Node.Status.READY)
        transaction.on_commit(partial(dispatch.node_user_grant, alloc.node.name, redis_password))
    transaction.on_commit(partial(dispatch.send_slurm_submit, sj.pk))
    job_event(attempt.job, "slurm_submitting", f"attempt {attempt.number}: asking Slurm pool {pool.name} for "
              f"{len(allocs)} node(s)", attempt=attempt, pool=pool.name, nodes=len(allocs))
    return sj


def _gang(sj: SlurmJob, path: str) -> backends.Gang:
    attempt, pool = sj.attempt, sj.pool
    job = attempt.job
    from trainyard.keys import run_root

    env = {"TRAINYARD_RUN_DIR": pool.agent_run_dir or str(run_root()),
           **{str(k): str(v) for k, v in (pool.agent_env or {}).items()}}
    if pool.agent_code_dir:
        env["PYTHONPATH"] = pool.agent_code_dir
    # the ranks each node runs (the job's procs_per_node): Slurm allocates that many GPUs per node,
    # not the whole node's, so the rest stay Slurm's to give to others
    per_node = max((len(a.slot_ids) for a in attempt.allocations.filter(active=True)), default=pool.slots_per_node)
    return backends.Gang(
        job_id=job.pk, attempt_id=attempt.pk, nodes=len(sj.seats), procs_per_node=per_node,
        command=(pool.agent_python or settings.TRAINYARD_SLURM_AGENT_PYTHON, "-m", "workers.slurm_agent", path),
        gpus_per_node=per_node if pool.device == "cuda" else 0, priority=job.priority, env=env)


def _agents_file(sj: SlurmJob) -> str:
    """What the ephemeral agents read (0600, on the pool's shared state directory): each seat's name,
    credential and Redis user, in node-rank order, and how to reach Redis. Nothing of it is in argv."""
    seats = []
    for node in sorted(Node.objects.filter(name__in=sj.seats), key=lambda n: sj.seats.index(n.name)):
        credential, redis_password = _seat_secrets(node.name, node.credential_salt)
        seats.append({"name": node.name, "credential": credential,
                      "redis_url": redis_acl.url_for(_redis_base(), node.name, redis_password)})
    pool = sj.pool
    return json.dumps({"attempt": sj.attempt_id, "job": sj.attempt.job_id, "seats": seats,
                       "slots": pool.slots_per_node, "device": pool.device, "pool": pool.name})


def gang_submit(slurm_job_id: int) -> str | None:
    """sbatch the attempt's gang (the submit task; run again by slurm_poll while it stays SUBMITTING).
    Idempotent: the backend returns the job already carrying the attempt's tag. A refusal by Slurm
    (bad partition, account, limits) ends the attempt as a placement failure with Slurm's words."""
    sj = SlurmJob.objects.select_related("attempt__job", "pool").filter(
        pk=slurm_job_id, state=SlurmJob.State.SUBMITTING).first()
    if sj is None or sj.attempt.status != Attempt.Status.STARTING or sj.attempt.stop_reason:
        return None
    backend = backend_for(sj.pool)
    try:
        path = backend.put_file(backends.attempt_tag(sj.attempt.job_id, sj.attempt_id), AGENTS_FILE, _agents_file(sj))
        handle = backend.submit(_gang(sj, path))
    except backends.SubmitRefused as exc:
        with transaction.atomic():
            _placement_failed(sj, f"Slurm refused the job: {exc}", retry=False)
        return None
    except backends.BackendError as exc:
        log.warning("Slurm pool %s: submit of attempt %s failed, retried: %s", sj.pool.name, sj.attempt_id, exc)
        SlurmJob.objects.filter(pk=sj.pk).update(error=str(exc)[:500])
        return None
    with transaction.atomic():
        if SlurmJob.objects.filter(pk=sj.pk, state=SlurmJob.State.SUBMITTING).update(
                slurm_id=handle.id, state=SlurmJob.State.PENDING, submitted_at=timezone.now(), error=""):
            job_event(sj.attempt.job, "slurm_submitted", f"attempt {sj.attempt.number}: Slurm job {handle.id} "
                      f"submitted to pool {sj.pool.name}", attempt=sj.attempt, slurm_job=handle.id)
    return handle.id


def _placement_failed(sj: SlurmJob, message: str, *, retry: bool = True) -> None:
    """The Slurm job failed (or was refused) before every agent registered: the attempt ends as a
    `placement` failure with Slurm's reason; the job's restart policy applies unless Slurm refused
    the request itself (`retry` False: the same sbatch would be refused again)."""
    now = timezone.now()
    SlurmJob.objects.filter(pk=sj.pk).update(error=message[:500], ended_at=now)
    attempt = Attempt.objects.get(pk=sj.attempt_id)
    Attempt.objects.filter(pk=attempt.pk, stop_reason="").update(stop_reason="placement" if retry else "placement_refused")
    for alloc in attempt.allocations.filter(active=True).select_related("node"):
        Allocation.objects.filter(pk=alloc.pk).update(active=False, ended_at=now, result={
            "node": alloc.node.name, "exit_code": None, "error": message[:500]})
    attempt.refresh_from_db()
    attempt_maybe_finish(attempt)


# ---------------------------------------------------------------- the agents register

def seat_heartbeat_ok(node: Node, allocation: str) -> bool:
    """A seat's heartbeat counts only from the agents of the Slurm job holding it (its credential
    was minted for that allocation; `allocation` is the agent's SLURM_JOB_ID). Before sbatch's
    answer is recorded it is ignored quietly; a different job's id is a security event."""
    holder = SlurmJob.objects.filter(pk=node.holder_id).only("slurm_id").first() if node.holder_id else None
    if holder is None or not holder.slurm_id:
        return False
    if allocation != holder.slurm_id:
        security_event("allocation_mismatch", node.name, f"heartbeat from Slurm job {allocation[:32]!r}, the seat "
                                                          f"is held by Slurm job {holder.slurm_id}")
        return False
    return True


def seat_up(holder_id: int) -> bool:
    """After a heartbeat of a seat held by SlurmJob `holder_id`: when every seat of it has an agent
    with an address, send the attempt's launches (once: compare-and-set on launched_at). True if
    they went out now. Once launched, one query per heartbeat."""
    with transaction.atomic():
        sj = (SlurmJob.objects.select_related("attempt__job", "attempt__resumed_from")
              .filter(pk=holder_id, launched_at=None).first())
        if sj is None:
            return False
        seats = {n.name: n for n in Node.objects.filter(name__in=sj.seats, holder=sj)}
        if any(not (seats.get(s) and seats[s].address and seats[s].agent_id) for s in sj.seats):
            return False
        attempt = sj.attempt
        if attempt.status != Attempt.Status.STARTING or attempt.stop_reason:
            return False
        if not SlurmJob.objects.filter(pk=sj.pk, launched_at=None).update(
                launched_at=timezone.now(), state=SlurmJob.State.RUNNING):
            return False
        allocs = list(attempt.allocations.filter(active=True).select_related("node").order_by("node_rank"))
        host = allocs[0].node.address
        for alloc in allocs:
            payload = launch_payload(attempt.job, attempt, alloc, rdzv_host=host, nnodes=len(allocs),
                                     local_addr=alloc.node.address)
            transaction.on_commit(partial(dispatch.send_launch, alloc.node.name, payload))
        job_event(attempt.job, "slurm_running", f"attempt {attempt.number}: Slurm job {sj.slurm_id} running on "
                  + ", ".join(f"{a.node.name}={a.node.address}" for a in allocs) + "; launching",
                  attempt=attempt, slurm_job=sj.slurm_id, nodes=[a.node.address for a in allocs])
    return True


def seat_draining(node_name: str, why: str) -> bool:
    """A seat's agent got Slurm's SIGTERM (preemption, scancel, the time limit): the attempt is asked
    to checkpoint and stop (it ends `preempted` and the job goes back to Trainyard's queue, which
    submits a new Slurm job for the next attempt). True if the preemption was requested now."""
    with transaction.atomic():
        node = Node.objects.filter(name=node_name).exclude(holder=None).first()
        if node is None:
            return False
        attempt = Attempt.objects.select_related("job").get(slurm__pk=node.holder_id)
        return attempt_preempt(attempt, reason=f"Slurm took node {node_name} back: {why}"[:500])


# ---------------------------------------------------------------- status, ends, releases

def _pending_text(sj: SlurmJob, st: backends.HandleStatus) -> str:
    eta = ""
    if st.eta:
        eta = ", expected start " + datetime.fromtimestamp(st.eta, tz=dt_timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"Slurm job {sj.slurm_id} pending: {st.category or 'other'} ({st.reason or 'None'}){eta}"


def _release(sj: SlurmJob) -> None:
    """The attempt ended: revoke its seats' credentials and Redis users (only seats it still holds)."""
    seats = list(Node.objects.filter(holder=sj).values_list("name", flat=True))
    Node.objects.filter(holder=sj).update(holder=None, credential_salt="", credential_digest="", address="",
                                          agent_id="", last_heartbeat=None, **seat_shape(sj.pool))
    Node.objects.filter(name__in=seats, status=Node.Status.LOST).update(status=Node.Status.READY)
    SlurmJob.objects.filter(pk=sj.pk).update(released_at=timezone.now())
    if seats:
        transaction.on_commit(partial(dispatch.node_users_revoke, seats))
    transaction.on_commit(partial(dispatch.publish_cluster_changed, "nodes"))


def _write_off(sj: SlurmJob, st: backends.HandleStatus) -> None:
    """The Slurm job ended while the attempt still ran on it (a node failure, Slurm's own cancel or
    time limit, a kill after preemption): like lost nodes, every seat still active is written off."""
    now = timezone.now()
    attempt = Attempt.objects.select_related("job").get(pk=sj.attempt_id)
    job_event(attempt.job, "slurm_ended", f"Slurm job {sj.slurm_id} ended {st.state.value}"
              + (f" ({st.reason})" if st.reason else "") + " while its agents ran", attempt=attempt,
              slurm_job=sj.slurm_id, state=st.state.value, reason=st.reason)
    for alloc in attempt.allocations.filter(active=True).select_related("node"):
        Allocation.objects.filter(pk=alloc.pk).update(active=False, ended_at=now, result={
            "node": alloc.node.name, "node_lost": True, "exit_code": None,
            "error": f"Slurm job {sj.slurm_id} {st.state.value}: {st.reason}"[:500]})
        attempt_fence(attempt, alloc.node.name)
        attempt_stop(attempt, reason=f"node_lost:{alloc.node.name}")


def _apply(sj: SlurmJob, st: backends.HandleStatus | None, backend, now) -> None:
    attempt = sj.attempt
    handle = Handle(backend.name, sj.slurm_id) if sj.slurm_id else None
    if attempt.status == Attempt.Status.ENDED:
        if handle and st is not None and not st.state.ended and st.state != State.UNKNOWN:
            if sj.cancel_at is None:
                SlurmJob.objects.filter(pk=sj.pk).update(cancel_at=now + timedelta(seconds=STOP_GRACE_S))
                return
            if sj.cancel_at > now:
                return
            transaction.on_commit(partial(_cancel_quietly, backend, handle, 0.0))
        _release(sj)
        return
    if attempt.status == Attempt.Status.STOPPING and sj.launched_at is None:
        # stopped (cancel, preemption, timeout) while Slurm still pends: nothing of it runs anywhere
        if handle:
            transaction.on_commit(partial(_cancel_quietly, backend, handle, 0.0))
        SlurmJob.objects.filter(pk=sj.pk).update(state=SlurmJob.State.CANCELLED, ended_at=now)
        for alloc in attempt.allocations.filter(active=True).select_related("node"):
            Allocation.objects.filter(pk=alloc.pk).update(active=False, ended_at=now, result={
                "node": alloc.node.name, "exit_code": None, "stopped": True, "reason": "stopped before Slurm ran it"})
        attempt_maybe_finish(attempt)
        return
    if st is None:
        return
    fields = {"checked_at": now}
    if st.state == State.UNKNOWN:
        fields["unknown_since"] = sj.unknown_since or now
        if sj.launched_at is None and sj.unknown_since and (now - sj.unknown_since).total_seconds() > UNKNOWN_GIVE_UP_S:
            _placement_failed(sj, f"no answer from Slurm about job {sj.slurm_id} for {UNKNOWN_GIVE_UP_S:.0f} s "
                                  f"({st.reason})")
        SlurmJob.objects.filter(pk=sj.pk).update(**fields)
        return
    fields.update(unknown_since=None, state=st.state.value, reason=st.reason[:300], category=st.category,
                  slurm_nodes=list(st.nodes),
                  eta=datetime.fromtimestamp(st.eta, tz=dt_timezone.utc) if st.eta else None)
    SlurmJob.objects.filter(pk=sj.pk).update(**fields)
    if attempt.status == Attempt.Status.STOPPING and st.state == State.RUNNING and handle:
        _enforce_stop(sj, backend, handle, now)
    if st.state == State.PENDING:
        Job.objects.filter(pk=attempt.job_id, status=Job.Status.STARTING).update(
            status_reason=_pending_text(sj, st)[:500])
    elif st.state.ended:
        SlurmJob.objects.filter(pk=sj.pk).update(ended_at=now)
        if sj.launched_at is None:
            _placement_failed(sj, f"Slurm job {sj.slurm_id} {st.state.value} before its agents registered"
                                  + (f": {st.reason}" if st.reason else "")
                                  + (f" (exit {st.exit_code})" if st.exit_code not in (None, 0) else ""))
        elif attempt.allocations.filter(active=True).exists():
            _write_off(sj, st)


def _enforce_stop(sj: SlurmJob, backend, handle: Handle, now) -> None:
    """A stop (cancel, preemption, rollback) goes to the agents first, as on Trainyard's own nodes;
    Slurm enforces it when they do not finish it: after STOP_GRACE_S, `scancel --signal=TERM` to
    every step (the ranks' cooperative stop), and STOP_GRACE_S later `scancel`."""
    if sj.cancel_at is None:
        SlurmJob.objects.filter(pk=sj.pk).update(cancel_at=now + timedelta(seconds=STOP_GRACE_S))
    elif sj.cancel_at <= now and sj.signalled_at is None:
        transaction.on_commit(partial(_cancel_quietly, backend, handle, STOP_GRACE_S))
        SlurmJob.objects.filter(pk=sj.pk).update(signalled_at=now, cancel_at=now + timedelta(seconds=STOP_GRACE_S))
        job_event(sj.attempt.job, "slurm_signalled", f"attempt {sj.attempt.number}: still stopping after "
                  f"{STOP_GRACE_S:.0f} s; Slurm job {sj.slurm_id} sent SIGTERM (scancel --signal)",
                  attempt=sj.attempt, slurm_job=sj.slurm_id)
    elif sj.cancel_at <= now:
        transaction.on_commit(partial(_cancel_quietly, backend, handle, 0.0))


def _cancel_quietly(backend, handle: Handle, grace_s: float) -> None:
    try:
        backend.cancel(handle, grace_s)
    except backends.BackendError as exc:
        log.warning("scancel of Slurm job %s failed (retried on the next check): %s", handle.id, exc)


def slurm_poll() -> int:
    """One status pass over every Slurm job not yet released (beat, every few seconds): one batched
    status call per pool, then each row's consequence in its own transaction. Returns how many."""
    now = timezone.now()
    rows = list(SlurmJob.objects.filter(released_at=None).select_related("attempt__job", "pool"))
    by_pool: dict[int, list[SlurmJob]] = {}
    for sj in rows:
        by_pool.setdefault(sj.pool_id, []).append(sj)
    for group in by_pool.values():
        backend = backend_for(group[0].pool)
        handles = [Handle(backend.name, sj.slurm_id) for sj in group if sj.slurm_id]
        try:
            answers = backend.status(handles) if handles else {}
        except backends.BackendError as exc:
            answers = {h: backends.HandleStatus(State.UNKNOWN, reason=str(exc)[:200]) for h in handles}
        for sj in group:
            if (sj.state == SlurmJob.State.SUBMITTING and sj.attempt.status == Attempt.Status.STARTING
                    and (now - sj.attempt.created_at).total_seconds() > RESUBMIT_AFTER_S):
                gang_submit(sj.pk)
                continue
            st = answers.get(Handle(backend.name, sj.slurm_id)) if sj.slurm_id else None
            with transaction.atomic():
                _apply(sj, st, backend, now)
        _move_off_unhealthy(backend, group, answers)
    return len(rows)


def _move_off_unhealthy(backend, group: list[SlurmJob], answers: dict) -> None:
    """A running gang on a node Slurm has DOWN, draining or failing (an admin's DRAIN, a health
    check) is asked to checkpoint and stop, as a lost node would make it, but with a checkpoint of
    the current step: the next attempt's sbatch gets healthy nodes. One sinfo per pool per pass."""
    running = {}
    for sj in group:
        st = answers.get(Handle(backend.name, sj.slurm_id)) if sj.slurm_id else None
        if (st is not None and st.state == State.RUNNING and sj.launched_at is not None
                and sj.attempt.status in (Attempt.Status.STARTING, Attempt.Status.RUNNING) and not sj.attempt.stop_reason):
            running[sj.pk] = (sj, st.nodes)
    if not running:
        return
    try:
        bad = backend.unhealthy_nodes(sorted({n for _, nodes in running.values() for n in nodes}))
    except backends.BackendError as exc:
        log.warning("Slurm pool %s: node states unknown this pass: %s", backend.name, exc)
        return
    for sj, nodes in running.values():
        hit = next((n for n in nodes if n in bad), None)
        if hit is None:
            continue
        state, reason = bad[hit]
        with transaction.atomic():
            attempt = Attempt.objects.select_related("job").get(pk=sj.attempt_id)
            if attempt_preempt(attempt, reason=f"Slurm node {hit} is {state}" + (f": {reason}" if reason else "")):
                job_event(attempt.job, "slurm_node_unhealthy", f"attempt {attempt.number}: Slurm node {hit} is {state}"
                          + (f" ({reason})" if reason else "") + "; checkpointing to move to healthy nodes",
                          attempt=attempt, node=hit, state=state, reason=reason[:200])


class _LiveTags:
    """The tags of attempts whose Slurm job may live (not yet released). A tag not among those read
    first is looked up again when reconcile asks, after its squeue: a tick that committed an attempt
    (and so its sbatch) after the first read must not see its fresh Slurm job cancelled as an orphan."""

    def __init__(self):
        self.tags = {backends.attempt_tag(j, a) for a, j in SlurmJob.objects.filter(released_at=None)
                     .values_list("attempt_id", "attempt__job_id")}

    def __contains__(self, tag: object) -> bool:
        if tag in self.tags:
            return True
        parsed = backends.parse_tag(tag) if isinstance(tag, str) else None
        return parsed is not None and SlurmJob.objects.filter(
            attempt_id=parsed[1], attempt__job_id=parsed[0], released_at=None).exists()

    def __iter__(self):
        return iter(self.tags)


def slurm_reconcile() -> int:
    """Cancel our tagged Slurm jobs that no live attempt owns (left by a control plane that died
    between sbatch and recording the id, or after its database was restored); adopt the others.
    A failed answer cancels nothing. Returns how many were cancelled."""
    cancelled = 0
    live = _LiveTags()
    for pool in Pool.objects.filter(kind=Pool.Kind.SLURM):
        try:
            got = backend_for(pool).reconcile(live)
        except backends.BackendError as exc:
            log.warning("Slurm pool %s: reconcile skipped: %s", pool.name, exc)
            continue
        for tag, handle in got.cancelled:
            log.warning("Slurm pool %s: cancelled orphan Slurm job %s (%s): no live attempt", pool.name, handle.id, tag)
        cancelled += len(got.cancelled)
    return cancelled
