"""The notifications' reads: a user's own subscriptions and a hook's delivery log (owner only)."""
from __future__ import annotations

from django.db.models import QuerySet

from jobs.core.errors import NotFound
from jobs.models import Delivery, Subscription


def subscriptions_of(user, *, channel: str | None = None) -> QuerySet[Subscription]:
    qs = Subscription.objects.filter(user=user).select_related("team")
    return qs.filter(channel=channel) if channel else qs


def subscription_of(user, pk, *, channel: str | None = None) -> Subscription:
    sub = subscriptions_of(user, channel=channel).filter(pk=pk).first()
    if sub is None:
        raise NotFound("no such subscription")
    return sub


def deliveries_of(sub: Subscription) -> QuerySet[Delivery]:
    return Delivery.objects.filter(subscription=sub).prefetch_related("attempts").order_by("-id")
