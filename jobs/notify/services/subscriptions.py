"""Subscriptions: create (a webhook's secret returned once), change, delete. Every check before the
one transaction that writes, so a refused request leaves nothing behind."""
from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import TYPE_CHECKING

from django.conf import settings
from django.contrib.auth.models import Group
from django.db import transaction

from jobs.core.dbtext import text_problem
from jobs.core.errors import InvalidInput, NotFound
from jobs.models import Subscription
from jobs.notify import transport
from jobs.notify.policy import events as policy
from jobs.notify.policy.targets import TargetError, parse_allow, parse_url, pick_address

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser


def hook_secret(salt: str) -> str:
    """A hook's secret, derived from TRAINYARD_WEBHOOK_KEY and its salt (the database keeps only the salt)."""
    return hmac.new(settings.TRAINYARD_WEBHOOK_KEY.encode(), f"trainyard-webhook\0{salt}".encode(),
                    hashlib.sha256).hexdigest()


def sign(body: bytes, secret: str) -> str:
    """The X-Trainyard-Signature header's value for `body`."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def webhook_check_url(url) -> str:
    """The URL if a webhook may POST there now (form, allow-list, the host's addresses); else
    TargetError saying why. Called at create and before every delivery."""
    target = parse_url(url)
    return pick_address(target, transport.resolve(target), parse_allow(settings.TRAINYARD_WEBHOOK_ALLOW))


def _team(user: AbstractUser, name, errors: dict) -> Group | None:
    if name in (None, ""):
        return None
    # no team's name has a NUL (PostgreSQL could not compare one: a 500)
    team = Group.objects.filter(name=name).first() if isinstance(name, str) and not text_problem(name) else None
    if team is None or not user.groups.filter(pk=team.pk).exists():
        errors["team"] = [f"you are not a member of a team named {str(name)[:100]!r}"]
    elif not (user.is_staff or user.has_perm("jobs.subscribe_team")):
        errors["team"] = ["subscribing a team needs the permission jobs.subscribe_team (ask staff)"]
    return team


def _events(user: AbstractUser, events, *, team: bool, errors: dict) -> list[str]:
    try:
        return policy.check_events(events, staff=user.is_staff, team=team)
    except ValueError as exc:
        errors["events"] = [str(exc)]
        return []


def _format(fmt, errors: dict) -> str:
    if fmt not in policy.FORMATS:
        errors["format"] = [f"one of {', '.join(policy.FORMATS)}"]
    return fmt


def webhook_create(*, user: AbstractUser, url, events, team=None, fmt="json") -> tuple[Subscription, str]:
    """A webhook and its secret: the only time the secret leaves the server."""
    errors: dict[str, list[str]] = {}
    try:
        webhook_check_url(url)
    except TargetError as exc:
        errors["url"] = [str(exc)]
    group = _team(user, team, errors)
    names = _events(user, events, team=group is not None or team not in (None, ""), errors=errors)
    _format(fmt, errors)
    if errors:
        raise InvalidInput(errors)
    salt = secrets.token_hex(16)
    with transaction.atomic():
        hook = Subscription.objects.create(user=user, team=group, channel=Subscription.Channel.WEBHOOK, url=url,
                                           events=names, payload_format=fmt, secret_salt=salt)
    return hook, hook_secret(salt)


def email_subscribe(*, user: AbstractUser, events, team=None) -> Subscription:
    errors: dict[str, list[str]] = {}
    group = _team(user, team, errors)
    names = _events(user, events, team=group is not None or team not in (None, ""), errors=errors)
    if group is None and not errors.get("team") and not user.email:
        errors["email"] = ["your account has no email address"]
    if errors:
        raise InvalidInput(errors)
    with transaction.atomic():
        return Subscription.objects.create(user=user, team=group, channel=Subscription.Channel.EMAIL, events=names)


def subscription_update(sub: Subscription, *, user: AbstractUser, changes: dict) -> Subscription:
    """Change `events`, `active` or (a webhook's) `format`; anything else is a field error."""
    if sub.user_id != user.pk:
        raise NotFound("no such subscription")
    errors: dict[str, list[str]] = {}
    allowed = {"events", "active"} | ({"format"} if sub.channel == Subscription.Channel.WEBHOOK else set())
    for key in sorted(set(changes) - allowed):
        errors[key] = [f"cannot be changed (only {', '.join(sorted(allowed))}); delete and create instead"]
    fields = {}
    if "events" in changes:
        fields["events"] = _events(user, changes["events"], team=sub.team_id is not None, errors=errors)
    if "active" in changes:
        if not isinstance(changes["active"], bool):
            errors["active"] = ["true or false"]
        fields["active"] = changes["active"]
    if "format" in changes:
        fields["payload_format"] = _format(changes["format"], errors)
    if errors:
        raise InvalidInput(errors)
    with transaction.atomic():
        Subscription.objects.filter(pk=sub.pk).update(**fields)
    sub.refresh_from_db()
    return sub


def subscription_delete(sub: Subscription, *, user: AbstractUser) -> None:
    if sub.user_id != user.pk:
        raise NotFound("no such subscription")
    with transaction.atomic():
        sub.delete()
