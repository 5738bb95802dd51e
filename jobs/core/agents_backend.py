"""Trainyard's own node agents as a launch backend (trainyard/backends.py): the first implementation
of the interface, which the Slurm backend (trainyard/slurm.py) is the second of.

The agents are registered machines the scheduler places onto itself, so a gang arrives already
placed: `submit` sends each node's sealed Launch to its queue (attempt_start, after commit); status
is what the agents' reports wrote; `cancel` and `signal` are the Stop command and the preemption key;
`reconcile` stops what agents still run for attempts that ended (the heartbeat's orphans do the same
per node). The handle's id is the attempt's tag."""
from __future__ import annotations

from typing import Container, Sequence

from trainyard.backends import Capabilities, Gang, Handle, HandleStatus, Reconciled, State, parse_tag

from jobs.core import dispatch

NAME = "agents"
_SIGNALS = {"checkpoint": "checkpoint requested", "preempt": "preemption requested"}


def _attempt(handle: Handle):
    from jobs.models import Attempt

    ids = parse_tag(handle.id)
    return Attempt.objects.filter(pk=ids[1], job_id=ids[0]).first() if ids else None


class AgentsBackend:
    name = NAME
    capabilities = Capabilities(native_gang=False, requeue=False, suspend=False, elastic=False)

    def submit(self, gang: Gang) -> Handle:
        """Send each placed node its Launch (agents ignore a launch they already have: idempotent)."""
        for node, payload in gang.launches:
            dispatch.send_launch(node, dict(payload))
        return Handle(NAME, gang.tag)

    def status(self, handles: Sequence[Handle]) -> dict[Handle, HandleStatus]:
        from jobs.models import Attempt

        out = {}
        for handle in handles:
            attempt = _attempt(handle)
            if attempt is None:
                out[handle] = HandleStatus(State.UNKNOWN, reason="no such attempt", source="database")
                continue
            nodes = tuple(attempt.allocations.filter(active=True).values_list("node__name", flat=True))
            if attempt.status == Attempt.Status.ENDED:
                state = {"succeeded": State.SUCCEEDED, "cancelled": State.CANCELLED, "preempted": State.PREEMPTED
                         }.get(attempt.outcome, State.FAILED)
                out[handle] = HandleStatus(state, reason=attempt.outcome, source="database")
            elif attempt.status == Attempt.Status.STARTING and not attempt.allocations.exclude(ranks=[]).exists():
                out[handle] = HandleStatus(State.PENDING, reason="launching", category="resources", nodes=nodes,
                                           source="database")
            else:
                out[handle] = HandleStatus(State.RUNNING, nodes=nodes, source="database")
        return out

    def cancel(self, handle: Handle, grace_s: float) -> None:
        """grace_s > 0: ask the ranks to checkpoint and exit first (the preemption key); then the Stop."""
        attempt = _attempt(handle)
        if attempt is None:
            return
        if grace_s > 0:
            dispatch.request_preempt(attempt.pk, "cancel", grace_s)
        for node in attempt.allocations.filter(active=True).values_list("node__name", flat=True):
            dispatch.send_stop(node, attempt.job_id, attempt.pk, "cancel")

    def signal(self, handle: Handle, sig: str) -> None:
        if sig not in _SIGNALS:
            raise ValueError(f"the agents take {', '.join(_SIGNALS)}, not {sig!r}")
        attempt = _attempt(handle)
        if attempt is not None:
            from django.conf import settings

            dispatch.request_preempt(attempt.pk, _SIGNALS[sig], settings.TRAINYARD_PREEMPT_GRACE_S)

    def reconcile(self, live_tags: Container[str]) -> Reconciled:
        """Stop what agents still run for attempts that are not live (ended with a node that never
        reported back); the attempts that are live are adopted as they are."""
        from jobs.models import Allocation
        from trainyard.backends import attempt_tag

        adopted, cancelled = [], []
        rows = (Allocation.objects.filter(active=True, node__pool__isnull=True)
                .values_list("attempt_id", "attempt__job_id", "node__name"))
        for attempt_id, job_id, node in rows:
            tag = attempt_tag(job_id, attempt_id)
            if tag in live_tags:
                adopted.append((tag, Handle(NAME, tag)))
            else:
                dispatch.send_stop(node, job_id, attempt_id, "orphan")
                cancelled.append((tag, Handle(NAME, tag)))
        return Reconciled(adopted=tuple(dict.fromkeys(adopted)), cancelled=tuple(dict.fromkeys(cancelled)))


AGENTS = AgentsBackend()
