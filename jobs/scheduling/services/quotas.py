"""Quotas: create or change them (all or nothing) and audit every change.

The scheduler reads quotas at its next tick (jobs/selectors.quotas_snapshot), so every change
requests one.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

from django.db import transaction

from jobs.core import dispatch
from jobs.core.errors import QuotaError
from jobs.models import Quota, QuotaChange

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser

log = logging.getLogger(__name__)


QUOTA_KEYS = {"team", "user", "max_slots", "device_hours"}


def quotas_update(*, actor: AbstractUser, entries: dict | list) -> list[Quota]:
    """Create or change quotas, all or nothing, each change in the audit log (QuotaChange). Entries:
    {"team": name} or {"user": name}, "max_slots": int >= 0, "device_hours": number > 0 or null
    (kept as is when absent). Raises QuotaError with per-entry field errors ("0.max_slots")."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list) or not entries:
        raise QuotaError({"quotas": ["send a quota object or a non-empty list of them"]})
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
        raise QuotaError(errors)
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
            quota_audit(quota, actor=actor, old=old)
            out.append(quota)
        transaction.on_commit(dispatch.request_tick)
        transaction.on_commit(partial(dispatch.publish_cluster_changed, "quotas"))
    return out


def quota_audit(quota: Quota, *, actor: AbstractUser, old: dict | None) -> None:
    """Record a quota change (the API, the quota page and the Django admin all come here) and let
    the scheduler see it at its next tick."""
    new = {"max_slots": quota.max_slots, "device_hours": quota.device_hours}
    if new == old:
        return
    subject = f"team:{quota.team.name}" if quota.team_id else f"user:{quota.user.get_username()}"
    change = QuotaChange.objects.create(team=quota.team, user=quota.user, subject=subject, old=old, new=new, actor=actor)
    transaction.on_commit(partial(dispatch.send_notify, "quota.changed", quota_change=change.pk))
    log.info("quota %s: %s -> %s by %s", subject, old, new, actor)
    transaction.on_commit(dispatch.request_tick)
    transaction.on_commit(partial(dispatch.publish_cluster_changed, "quotas"))
