"""Notifications (issue 25, jobs/notify/): subscriptions by email or webhook, and each delivery with
its tries (the delivery log a hook's owner reads)."""
from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import Group
from django.db import models


class Subscription(models.Model):
    """A user's own (team null) or, made by a member, a team's subscription to events, by email (the
    user's address; for a team, each member's) or webhook (a signed JSON POST to `url`)."""

    class Channel(models.TextChoices):
        EMAIL = "email"
        WEBHOOK = "webhook"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notify_subscriptions",
                             help_text="who made it (a team's: one of its members)")
    team = models.ForeignKey(Group, null=True, blank=True, on_delete=models.CASCADE,
                             related_name="notify_subscriptions")
    channel = models.CharField(max_length=10, choices=Channel.choices)
    events = models.JSONField(default=list)
    active = models.BooleanField(default=True)
    url = models.CharField(max_length=2000, blank=True)
    payload_format = models.CharField(max_length=10, default="json", help_text="json | slack ({\"text\": ...})")
    secret_salt = models.CharField(max_length=64, blank=True,
                                   help_text="the hook's secret is HMAC(TRAINYARD_WEBHOOK_KEY, salt): never stored")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        permissions = [("subscribe_team", "May subscribe their own teams to notifications")]

    def __str__(self) -> str:
        return f"{self.channel} {self.url or self.user} ({', '.join(self.events)})"


class Delivery(models.Model):
    """One event for one subscription: pending until it is delivered or its tries are spent."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"

    subscription = models.ForeignKey(Subscription, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=40)
    text = models.CharField(max_length=500)
    body = models.JSONField(default=dict, help_text="the event's details (the JSON payload's fields)")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    tries = models.PositiveIntegerField(default=0)
    next_try_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["subscription", "-id"], name="delivery_sub_newest")]


class DeliveryAttempt(models.Model):
    """One try of a delivery: when, how long, the HTTP status or the error."""

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    duration_s = models.FloatField()
    status_code = models.PositiveIntegerField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    address = models.CharField(max_length=64, blank=True, help_text="the checked address connected to")

    class Meta:
        ordering = ["number"]
