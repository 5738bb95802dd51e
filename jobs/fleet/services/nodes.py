"""Nodes: heartbeats (the registered address and approved slots win), quarantine, lost nodes judged over healthy control-plane time, drain/cordon/clear.
"""
from __future__ import annotations

from typing import TYPE_CHECKING
import logging
from datetime import timedelta
from functools import partial
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from trainyard.launch import Heartbeat
from jobs.core import dispatch
from jobs.core.errors import NodeActionError
from jobs.models import Allocation, Attempt, ControlPlaneClock, Job, Node
from jobs.attempts.policy import diagnosis
from jobs.fleet.policy import gpu_health
from jobs.fleet.policy.devices import summarize_devices
from jobs.attempts.services.attempts import attempt_fence, attempt_preempt, attempt_stop
from jobs.attempts.services.events import job_event, lifecycle
from jobs.fleet.services.identity import join_requested, security_event
from jobs.fleet.services.slurm import seat_heartbeat_ok


if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser


log = logging.getLogger(__name__)


def node_heartbeat(beat: Heartbeat, *, signer: str | None = None) -> tuple[Node | None, list[int]]:
    """Apply a registered node's heartbeat (validated at the edge, its signature already checked by
    identity.report_open; `signer` is the node that signed it). Returns the node and the attempts
    the agent runs that the control plane no longer expects there (the caller tells the agent to
    stop them); (None, []) when refused: an unregistered node (a join request for staff) or a
    heartbeat under another node's name.

    A heartbeat never moves a node's registered address (a forged one became the next job's
    rendezvous host) and never offers more slots than staff approved (it may offer fewer)."""
    if not isinstance(beat, Heartbeat):
        raise TypeError("node_heartbeat takes a validated trainyard.launch.Heartbeat")
    name = beat.name
    if signer is not None and signer != name:
        security_event("name_mismatch", signer, f"heartbeat signed by {signer} names node {name[:64]}")
        return None, []
    now = timezone.now()
    kind, gpus, gpu_memory = summarize_devices(beat.devices)
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(name=name).first()
        if node is None:
            join_requested(name, beat)
            return None, []
        if node.pool_id is not None and not seat_heartbeat_ok(node, beat.allocation):
            return None, []  # a pool's seat: only the agents of the Slurm job holding it
        cap = node.slots_approved if node.slots_approved is not None else node.slots
        fields = {
            "slots": min(beat.slots, cap), "devices": beat.devices, "device_kind": kind, "gpu_count": gpus,
            "gpu_memory_bytes": gpu_memory, "cpu_percent": beat.cpu_percent, "mem_percent": beat.mem_percent,
            "agent_id": beat.agent_id, "last_heartbeat": now,
        }
        if not node.address:
            fields["address"] = beat.address  # registered without one: the first signed heartbeat's
        elif beat.address != node.address:
            security_event("address_mismatch", name, f"heartbeat says {beat.address[:100]}, registered "
                                                      f"{node.address}: kept {node.address}")
        if beat.slots > cap:
            security_event("slots_over_approved", name, f"heartbeat offers {beat.slots} slots, staff approved "
                                                         f"{cap}: {cap} kept")
        if not node.labels:
            fields["labels"] = beat.labels  # staff's labels, when given at registration, win
        before = node.devices
        was_lost = node.status == Node.Status.LOST
        Node.objects.filter(pk=node.pk).update(**fields)
        if was_lost:
            back = (Node.Status.QUARANTINED if node.quarantined_at else
                    Node.Status.CORDONED if node.drain_mode == "cordon" else
                    Node.Status.DRAINING if node.drain_mode else Node.Status.READY)
            Node.objects.filter(pk=node.pk, status=Node.Status.LOST).update(status=back)
            transaction.on_commit(partial(lifecycle.info, "node %s is back (%s)", name, back))
        node.refresh_from_db()
        if _new_gpu_faults(before, beat.devices) and node_maybe_quarantine(name):
            node.refresh_from_db()
        transaction.on_commit(partial(dispatch.publish_cluster_changed, "nodes"))
        running = set(beat.attempts)
        expected = set(Allocation.objects.filter(node=node, active=True).values_list("attempt_id", flat=True))
        return node, sorted(running - expected)


def node_maybe_quarantine(name: str, *, job: Job | None = None, attempt: Attempt | None = None) -> bool:
    """Quarantine a node implicated in TRAINYARD_QUARANTINE_FAILURES faults within the window: the
    attempt failures blamed on it plus the GPU faults (Xid, uncorrected ECC) its agent reported
    (jobs/fleet/policy/gpu_health.py). Called when an attempt fails on the node and when a heartbeat
    brings a GPU fault. True if it quarantined the node now."""
    window = settings.TRAINYARD_QUARANTINE_WINDOW_S
    cutoff = timezone.now() - timedelta(seconds=window)
    node = Node.objects.filter(name=name).only("devices", "quarantined_at").first()
    if node is None or node.quarantined_at is not None:
        return False
    recent = Attempt.objects.filter(ended_at__gte=cutoff, status=Attempt.Status.ENDED).exclude(failure={})
    hits = [a for a in recent.only("id", "failure")
            if a.failure.get("node") == name and a.failure.get("class") in diagnosis.NODE_FAULT_CLASSES]
    faults = gpu_health.gpu_faults(node.devices, since=cutoff.timestamp())
    if not gpu_health.quarantine_due(len(hits), faults, settings.TRAINYARD_QUARANTINE_FAILURES):
        return False
    parts = ([f"attempts {', '.join(str(a.pk) for a in hits)}"] if hits else []) + [f.text() for f in faults]
    reason = f"implicated in {len(hits) + len(faults)} failures within {window / 60:.0f} min (" + "; ".join(parts) + ")"
    if not Node.objects.filter(name=name, quarantined_at__isnull=True).update(
            quarantined_at=timezone.now(), quarantine_reason=reason[:500]):
        return False
    Node.objects.filter(name=name).exclude(status=Node.Status.LOST).update(status=Node.Status.QUARANTINED)
    log.warning("node %s quarantined: %s", name, reason)
    transaction.on_commit(partial(dispatch.send_notify, "node.quarantined", node=name, reason=reason[:500]))
    if job is not None:
        job_event(job, "node_quarantined", f"node {name} quarantined: {reason}; an admin clears it on the nodes page",
                  attempt=attempt, node=name, failures=[a.pk for a in hits], gpu_faults=[f.text() for f in faults])
    transaction.on_commit(partial(dispatch.publish_cluster_changed, "nodes"))
    return True


def quarantine_if_blamed(attempt: Attempt) -> None:
    """After an attempt ended through a node's report or loss: quarantine the node its failure blames,
    if that node is now implicated in enough faults (node_maybe_quarantine)."""
    attempt.refresh_from_db(fields=["status", "failure"])
    failure = attempt.failure or {}
    if (attempt.status == Attempt.Status.ENDED and failure.get("node")
            and failure.get("class") in diagnosis.NODE_FAULT_CLASSES):
        node_maybe_quarantine(failure["node"], job=attempt.job, attempt=attempt)


def _new_gpu_faults(before: list, after: list) -> bool:
    """The heartbeat brings a GPU fault (Xid, uncorrected ECC) the previous one did not carry."""
    since = timezone.now().timestamp() - settings.TRAINYARD_QUARANTINE_WINDOW_S
    return bool(set(gpu_health.gpu_faults(after, since=since)) - set(gpu_health.gpu_faults(before, since=since)))


def control_plane_clock() -> ControlPlaneClock:
    """Record this node check on the control plane's clock (call inside the check's transaction)
    and return it; its `last_check_at` is the check's "now", read once the clock's row is locked
    (a wait on a locked database or on another check is part of the gap). A gap over
    TRAINYARD_CONTROL_STALL_S since the previous check, or no previous check, starts a new healthy
    stretch: while the worker, beat or database stalled, heartbeats could not be applied, so that
    time counts against no node."""
    clock = ControlPlaneClock.objects.select_for_update().filter(pk=1).first()
    if clock is None:
        clock = ControlPlaneClock(pk=1)
    now = timezone.now()
    gap = (now - clock.last_check_at).total_seconds() if clock.last_check_at else None
    if gap is None or gap > settings.TRAINYARD_CONTROL_STALL_S:
        clock.healthy_since = now
        if gap is not None:
            clock.stalls += 1
            clock.last_stall_s, clock.last_stall_at = round(gap, 3), now
            log.warning("control plane stalled for %.1f s (no node check ran): node silence is judged "
                        "from now on, not over the stall", gap)
    clock.last_check_at = now
    clock.save()
    return clock


def nodes_check() -> list[str]:
    """Write off nodes that stopped heartbeating and attempts stuck in launch, counting only the
    time the control plane was healthy (control_plane_clock)."""
    lost: list[str] = []
    with transaction.atomic():
        clock = control_plane_clock()
        now, healthy_since = clock.last_check_at, clock.healthy_since
        # Silent for LOST_S of healthy time: its last heartbeat and the healthy stretch's start both
        # before the cutoff (after a stall every node has a whole LOST_S to be heard from again).
        cutoff = now - timedelta(seconds=settings.TRAINYARD_NODE_LOST_S)
        silent = Node.objects.exclude(status=Node.Status.LOST).filter(last_heartbeat__lt=cutoff)
        for node in silent if healthy_since < cutoff else ():
            Node.objects.filter(pk=node.pk).update(status=Node.Status.LOST)
            lost.append(node.name)
            transaction.on_commit(partial(log.warning, "node %s lost: no heartbeat since %s (TRAINYARD_NODE_LOST_S %g)",
                                          node.name, node.last_heartbeat.isoformat(timespec="seconds"),
                                          settings.TRAINYARD_NODE_LOST_S))
            transaction.on_commit(partial(dispatch.send_notify, "node.lost", node=node.name,
                                          reason=f"no heartbeat since {node.last_heartbeat.isoformat(timespec='seconds')}"))
            for alloc in Allocation.objects.filter(node=node, active=True).select_related("attempt"):
                Allocation.objects.filter(pk=alloc.pk).update(
                    active=False, ended_at=now, result={"node": node.name, "node_lost": True, "exit_code": None})
                attempt_fence(alloc.attempt, node.name)
                attempt_stop(alloc.attempt, reason=f"node_lost:{node.name}")
                quarantine_if_blamed(alloc.attempt)
        launch_cutoff = now - timedelta(seconds=settings.TRAINYARD_LAUNCH_TIMEOUT_S)
        # an attempt on a Slurm pool counts from its launch (its agents registered), not while Slurm pends
        stuck = Attempt.objects.filter(Q(slurm__isnull=True) | Q(slurm__launched_at__lt=launch_cutoff),
                                       status=Attempt.Status.STARTING, created_at__lt=launch_cutoff)
        for attempt in stuck if healthy_since < launch_cutoff else ():  # the same rule for launches
            attempt_stop(attempt, reason="launch_timeout")
            quarantine_if_blamed(attempt)
    return lost


def node_clear(node: Node, *, user: AbstractUser) -> Node:
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


def node_set_schedulable(node: Node, *, user: AbstractUser, action: str, mode: str | None = None) -> Node:
    """Staff controls (the API checks): `cordon` (no new work, running work continues), `drain`
    (no new work; mode "finish" lets running attempts end, "preempt" checkpoints them away so they
    resume elsewhere) and `uncordon` (takes work again). Raises NodeActionError for bad input."""
    if action not in NODE_ACTIONS:
        raise NodeActionError({"action": [f"must be one of {', '.join(NODE_ACTIONS)}"]})
    if action == "drain" and mode not in DRAIN_MODES:
        raise NodeActionError({"mode": ["must be \"finish\" (running jobs finish) or \"preempt\" (running jobs "
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
                attempt_preempt(alloc.attempt, reason=f"node {node.name} is being drained by {who}")
        transaction.on_commit(partial(dispatch.publish_cluster_changed, "nodes"))
        transaction.on_commit(dispatch.request_tick)
    node.refresh_from_db()
    return node
