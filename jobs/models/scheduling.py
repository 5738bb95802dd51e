"""Quotas, their audit trail, and the scheduler's lock."""
from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import Group
from django.db import models


class Quota(models.Model):
    team = models.OneToOneField(Group, null=True, blank=True, on_delete=models.CASCADE, related_name="quota")
    user = models.OneToOneField(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE,
                                related_name="quota")
    max_slots = models.PositiveIntegerField()
    device_hours = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(team__isnull=False, user__isnull=True) | models.Q(team__isnull=True, user__isnull=False)),
                name="quota_team_xor_user",
            )
        ]


class QuotaChange(models.Model):
    """The quota audit log: who changed what, when (API, quota page and Django admin alike)."""

    team = models.ForeignKey(Group, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="+")
    subject = models.CharField(max_length=200, help_text="team:<name> or user:<name>, kept if the row goes")
    old = models.JSONField(null=True, blank=True)
    new = models.JSONField(null=True, blank=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]


class SchedulerLock(models.Model):
    """A single row locked (SELECT ... FOR UPDATE) to serialize scheduling ticks on PostgreSQL;
    on SQLite the IMMEDIATE transaction that touches it already serializes writers."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    ticks = models.BigIntegerField(default=0)
