"""A job: what a user submitted, its status and its plan."""
from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import Group
from django.db import models

from trainyard import status as job_status


class Job(models.Model):
    # The names come from trainyard/status.py (shared with the CLI and the pages' JavaScript); each
    # choice's value is its name and its label the name in title case, as the migrations record them.
    Status = models.TextChoices("Status", [(s, s) for s in job_status.STATUSES], module=__name__, qualname="Job.Status")

    ACTIVE = tuple(map(Status, job_status.ACTIVE))
    TERMINAL = tuple(map(Status, job_status.TERMINAL))
    PRIORITIES = {"low": 0, "normal": 1, "high": 2}

    name = models.CharField(max_length=200)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    team = models.ForeignKey(Group, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    spec = models.JSONField()
    plan = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    status_reason = models.CharField(max_length=500, blank=True)
    priority = models.SmallIntegerField(default=1)
    slots = models.PositiveIntegerField(help_text="processes the job needs at once (nodes x procs_per_node)")
    step = models.PositiveBigIntegerField(default=0)
    restarts = models.PositiveIntegerField(default=0)
    cancel_requested = models.BooleanField(default=False)
    # Nodes the next attempt should not use (the node that failed to join a rendezvous, ...);
    # ignored when the job could not fit without them.
    avoid_nodes = models.JSONField(default=list, blank=True)
    predicted_s = models.FloatField(null=True, blank=True, help_text="predicted run time (jobs/policy/predictor.py)")  # as its migration (0003) says: now jobs/planning/policy/predictor.py
    predicted_start_at = models.DateTimeField(null=True, blank=True, help_text="ETA while queued")
    borrowing = models.BooleanField(default=False, help_text="runs beyond its team's quota on idle capacity")
    # Elastic jobs (resources.nodes {min, max}): the node count of each attempt as it started,
    # [{"at": ISO time, "attempt": n, "nodes": k, "reason": why}], and whether the next start is
    # a restart at once on whatever is free (it was stopped to resize, or lost a node).
    node_history = models.JSONField(default=list, blank=True)
    elastic_restart = models.BooleanField(default=False)
    adaptations = models.JSONField(default=list, blank=True,
                                   help_text="adapt auto: each automatic plan change, oldest first (jobs/attempts/services/adapt.py)")
    note = models.TextField(blank=True, default="", help_text="free text by the owner or team (trainyard/tags.py)")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["status", "-priority", "id"], name="job_queue_idx"),
            models.Index(fields=["owner", "-id"], name="job_owner_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.pk}:{self.name}"

    @property
    def total_steps(self) -> int:
        return int(self.spec.get("train", {}).get("steps", 0))


class JobTag(models.Model):
    """One tag of a job (trainyard/tags.py), a row rather than a JSON list so that the job list's tag
    filter is an indexed lookup on SQLite as on PostgreSQL (a JSONField `__contains` is not
    supported on SQLite). Written only by jobs/runs/services.py (submit, job_annotate)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="tags")
    name = models.CharField(max_length=40)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["job", "name"], name="jobtag_job_name_unique")]
        # the filter: "jobs with tag x" walks this index (name, then job)
        indexes = [models.Index(fields=["name", "job"], name="jobtag_name_job_idx")]

    def __str__(self) -> str:
        return f"{self.job_id}:{self.name}"
