"""From an event to its deliveries. A writer hands an event over after its commit (jobs.core.dispatch
.send_notify, by task name, onto the notifications' own queue); `notify_fanout` (run by that queue's
worker) resolves what it names, finds the subscriptions that hear it (policy.events.hears) and
creates one Delivery each in one transaction, whose tries are sent after commit."""
from __future__ import annotations

import json
import logging
from functools import partial

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction

from jobs.core import dispatch
from jobs.models import Delivery, Job, Node, QuotaChange, Subscription
from jobs.notify.policy import events as policy

log = logging.getLogger(__name__)
KEEP_DELIVERIES = 200
"""Deliveries kept per subscription (the log its owner reads); older ones go as new ones come."""


def notify_event(event: str, *, job: Job | None = None, team: Group | None = None, user=None,
                 data: dict | None = None) -> None:
    """Announce `event` (one of policy.events.EVENTS: e.g. `experiment.ended`) about `job` and/or
    belonging to `user` and `team` (default: the job's owner and team), with JSON `data` (an
    experiment: {"experiment": id, "name", "status", "best": {...}}; "text" overrides the line people
    read). Call it inside the writer's transaction: it is sent only after commit, never raising there."""
    if event not in policy.EVENTS:
        raise ValueError(f"unknown notification event {event!r}")
    data = dict(data or {})
    json.dumps(data)  # a TypeError here, in the caller, not in the worker
    transaction.on_commit(partial(dispatch.send_notify, event, job=job.pk if job else None,
                                  team=team.pk if team else None, user=user.pk if user else None, data=data))


def _job_row(job: Job) -> dict:
    link = f"{settings.TRAINYARD_PUBLIC_URL}/jobs/{job.pk}/" if settings.TRAINYARD_PUBLIC_URL else ""
    return {"id": job.pk, "name": job.name, "status": job.status, "owner": job.owner.get_username(),
            "team": job.team.name if job.team_id else None, "url": link}


def _job_event(message: dict) -> policy.Event | None:
    job = Job.objects.select_related("owner", "team").filter(pk=message.get("job")).first()
    if job is None:
        return None
    kind, text = str(message.get("kind", "")), str(message.get("message", ""))[:1000]
    row = _job_row(job)
    detail = {"kind": kind, "message": text}
    if message.get("failure_class"):
        detail["failure_class"] = str(message["failure_class"])
    body = {"job": {**row, **detail}}
    return policy.Event(message["event"], policy.job_event_text(row, kind, text, detail), job.owner_id, job.team_id,
                        body)


def _node_event(message: dict) -> policy.Event | None:
    node = Node.objects.filter(name=message.get("node")).first()
    if node is None:
        return None
    reason = str(message.get("reason", ""))[:500]
    what = "lost" if message["event"] == "node.lost" else "quarantined"
    return policy.Event(message["event"], f"node {node.name} {what}: {reason}", None, None,
                        {"node": {"name": node.name, "status": node.status, "address": node.address, "reason": reason}})


def _quota_event(message: dict) -> policy.Event | None:
    change = QuotaChange.objects.filter(pk=message.get("quota_change")).first()
    if change is None:
        return None
    old, new = change.old or {}, change.new or {}
    text = f"quota of {change.subject}: max_slots {old.get('max_slots', '-')} -> {new.get('max_slots', '-')}"
    if old.get("device_hours") != new.get("device_hours"):
        text += f", device_hours {old.get('device_hours', '-')} -> {new.get('device_hours')}"
    return policy.Event("quota.changed", text, change.user_id, change.team_id,
                        {"quota": {"subject": change.subject, "old": change.old, "new": change.new}})


def _other_event(message: dict) -> policy.Event:
    data = message.get("data") if isinstance(message.get("data"), dict) else {}
    job = Job.objects.select_related("owner", "team").filter(pk=message.get("job")).first() if message.get("job") else None
    owner = message.get("user") or (job.owner_id if job else None)
    team = message.get("team") or (job.team_id if job else None)
    body = {"data": data, **({"job": _job_row(job)} if job else {})}
    if team and not Group.objects.filter(pk=team).exists():
        team = None
    if owner and not get_user_model().objects.filter(pk=owner).exists():
        owner = None
    return policy.Event(message["event"], policy.other_text(message["event"], data), owner, team, body)


def resolve_event(message: dict) -> policy.Event | None:
    """The event a writer's message names (None when what it names is gone)."""
    name = message.get("event")
    if name not in policy.EVENTS:
        log.warning("unknown notification event %r dropped", str(name)[:60])
        return None
    if "kind" in message:
        return _job_event(message)
    if name in policy.STAFF_EVENTS:
        return _node_event(message)
    if name == "quota.changed" and "quota_change" in message:
        return _quota_event(message)
    return _other_event(message)


def _subscriber(sub: Subscription) -> policy.Subscriber:
    return policy.Subscriber(sub.user_id, sub.user.is_staff, frozenset(g.pk for g in sub.user.groups.all()),
                             sub.team_id, frozenset(sub.events))


def notify_fanout(message: dict) -> list[int]:
    """One pending Delivery per active subscription that hears the event; their first tries are
    sent after commit. Returns the deliveries' ids."""
    event = resolve_event(message)
    if event is None:
        return []
    subs = Subscription.objects.filter(active=True, user__is_active=True).select_related("user").prefetch_related("user__groups")
    hearing = [s for s in subs if policy.hears(_subscriber(s), event)]
    ids = []
    with transaction.atomic():
        for sub in hearing:
            d = Delivery.objects.create(subscription=sub, event=event.name, text=event.text[:500], body=event.body)
            ids.append(d.pk)
            old = Delivery.objects.filter(subscription=sub).order_by("-id").values_list("id", flat=True)[KEEP_DELIVERIES:]
            Delivery.objects.filter(pk__in=list(old)).delete()
            transaction.on_commit(partial(dispatch.send_delivery, d.pk))
    return ids
