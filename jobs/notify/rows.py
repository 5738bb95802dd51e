"""Subscriptions and deliveries as the API returns them and the page shows them (plain dicts)."""
from __future__ import annotations

from jobs.models import Delivery, Subscription


def _iso(t) -> str | None:
    return t.isoformat() if t else None


def subscription_row(sub: Subscription) -> dict:
    row = {"id": sub.id, "channel": sub.channel, "events": list(sub.events), "active": sub.active,
           "team": sub.team.name if sub.team_id else None, "created_at": _iso(sub.created_at)}
    if sub.channel == Subscription.Channel.WEBHOOK:
        row.update(url=sub.url, format=sub.payload_format)
    return row


def delivery_row(d: Delivery) -> dict:
    return {"id": d.id, "event": d.event, "text": d.text, "status": d.status, "tries": d.tries,
            "next_try_at": _iso(d.next_try_at), "last_status_code": d.last_status_code, "last_error": d.last_error,
            "created_at": _iso(d.created_at), "finished_at": _iso(d.finished_at),
            "attempts": [{"number": a.number, "started_at": _iso(a.started_at), "duration_s": a.duration_s,
                          "status_code": a.status_code, "error": a.error, "address": a.address}
                         for a in d.attempts.all()]}
