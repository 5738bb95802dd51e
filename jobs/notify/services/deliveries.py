"""One try of a delivery (run by the notifications' worker, jobs.tasks.notify_deliver): a webhook's
signed JSON POST to its URL checked again now (DNS may have changed since the hook was made), or an
email through Django's mail backend; the try logged (DeliveryAttempt: status, error, duration), and
the next one sent with backoff (policy.retry) or the delivery closed."""
from __future__ import annotations

import json
import time
from datetime import timedelta
from functools import partial

from django.conf import settings
from django.core.mail import EmailMessage, get_connection
from django.db import transaction
from django.utils import timezone

from jobs.core import dispatch
from jobs.models import Delivery, DeliveryAttempt, Subscription
from jobs.notify import transport
from jobs.notify.policy import events as policy, retry
from jobs.notify.policy.targets import TargetError, parse_url
from jobs.notify.services.subscriptions import hook_secret, sign, webhook_check_url

USER_AGENT = "Trainyard-Webhook/1"


def delivery_body(d: Delivery) -> bytes:
    """The exact bytes POSTed (the same on every try: the signature and a receiver's dedup hold)."""
    event = policy.Event(d.event, d.text, None, None, d.body)
    doc = policy.payload(event, fmt=d.subscription.payload_format, delivery=d.pk,
                         created_at=d.created_at.isoformat(timespec="seconds"))
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _webhook(d: Delivery) -> tuple[int | None, str, str]:
    sub = d.subscription
    try:
        address = webhook_check_url(sub.url)
    except TargetError as exc:
        return None, f"refused: {exc}"[:500], ""
    body = delivery_body(d)
    headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT, "X-Trainyard-Event": d.event,
               "X-Trainyard-Delivery": str(d.pk), "X-Trainyard-Signature": sign(body, hook_secret(sub.secret_salt))}
    timeout = settings.TRAINYARD_WEBHOOK_TIMEOUT_S
    status, error = transport.post(parse_url(sub.url), address, body, headers, timeout_s=timeout,
                                   deadline_s=3 * timeout)
    return status, error, address


def _recipients(sub: Subscription) -> list[str]:
    if sub.team_id is None:
        return [sub.user.email] if sub.user.email and sub.user.is_active else []
    return sorted(set(sub.team.user_set.filter(is_active=True).exclude(email="").values_list("email", flat=True)))


def _email(d: Delivery) -> tuple[int | None, str]:
    """(250, "") once the mail backend took it; (None, why) otherwise."""
    to = _recipients(d.subscription)
    if not to:
        return None, "no recipient has an email address"
    job = d.body.get("job") or {}
    subject, text = policy.email_message(policy.Event(d.event, d.text, None, None, d.body), link=job.get("url", ""))
    try:  # one message per address: a team's members do not see each other's addresses
        with get_connection(fail_silently=False) as connection:
            connection.send_messages([EmailMessage(subject, text, settings.DEFAULT_FROM_EMAIL, [a]) for a in to])
    except Exception as exc:  # smtplib's and the socket's errors alike: logged on the try, retried
        return None, f"{type(exc).__name__}: {exc}"[:500]
    return 250, ""


def _record(d: Delivery, *, started, duration_s: float, status: int | None, error: str, address: str,
            final: bool) -> str:
    """Log the try and decide what comes next, in one transaction; the next try is sent after commit."""
    ok = status == 250 if d.subscription.channel == Subscription.Channel.EMAIL else retry.succeeded(status)
    with transaction.atomic():
        row = Delivery.objects.select_for_update().filter(pk=d.pk, status=Delivery.Status.PENDING).first()
        if row is None:
            return "gone"
        row.tries += 1
        DeliveryAttempt.objects.create(delivery=row, number=row.tries, started_at=started, duration_s=round(duration_s, 4),
                                       status_code=status, error=error[:500], address=address)
        row.last_status_code, row.last_error = status, error[:500]
        delay = None if ok or final or not retry.retryable(status) else retry.next_delay(
            row.tries, max_tries=settings.TRAINYARD_WEBHOOK_TRIES, base_s=settings.TRAINYARD_WEBHOOK_BACKOFF_S)
        if ok or delay is None:
            row.status = Delivery.Status.DELIVERED if ok else Delivery.Status.FAILED
            row.finished_at, row.next_try_at = timezone.now(), None
        else:
            row.next_try_at = timezone.now() + timedelta(seconds=delay)
            transaction.on_commit(partial(dispatch.send_delivery, row.pk, countdown=delay))
        row.save()
    return row.status


def delivery_try(delivery_id: int) -> str:
    """Try a pending delivery once; its status after ("gone" if it was not pending)."""
    d = Delivery.objects.select_related("subscription__user", "subscription__team").filter(
        pk=delivery_id, status=Delivery.Status.PENDING).first()
    if d is None:
        return "gone"
    started, t0 = timezone.now(), time.monotonic()
    address, final = "", False
    if not d.subscription.active:  # switched off since: closed, not retried
        status, error, final = None, "subscription inactive", True
    elif d.subscription.channel == Subscription.Channel.WEBHOOK:
        status, error, address = _webhook(d)
    else:
        status, error = _email(d)
        final = error.startswith("no recipient")
    return _record(d, started=started, duration_s=time.monotonic() - t0, status=status, error=error, address=address,
                   final=final)
