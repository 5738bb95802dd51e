"""Experiments (issue 25): a JobSpec template and a search; each trial is an ordinary Job.

The search's whole state is these rows: the Optuna study is rebuilt from the Trial rows on every
pass (jobs/experiments/searcher.py), so a restarted control worker loses and repeats nothing.
"""
from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import Group
from django.db import models

from jobs.models.runs import Job


class Experiment(models.Model):
    class Status(models.TextChoices):
        RUNNING = "running"
        SUCCEEDED = "succeeded"   # every trial ended and at least one finished
        FAILED = "failed"         # every trial ended and none finished
        STOPPED = "stopped"       # stopped by a person

    TERMINAL = (Status.SUCCEEDED, Status.FAILED, Status.STOPPED)

    name = models.CharField(max_length=200)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="experiments")
    team = models.ForeignKey(Group, null=True, blank=True, on_delete=models.SET_NULL, related_name="experiments")
    spec = models.JSONField(help_text="the JobSpec template, as submitted")
    search = models.JSONField(help_text="the search block, every default filled in (trainyard/search.py)")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RUNNING)
    status_reason = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["status", "id"], name="experiment_status_idx"),
                   models.Index(fields=["owner", "-id"], name="experiment_owner_idx")]

    def __str__(self) -> str:
        return f"{self.pk}:{self.name}"


class Trial(models.Model):
    class Status(models.TextChoices):
        RUNNING = "running"              # its job is queued, starting or running
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        CANCELLED = "cancelled"
        EARLY_STOPPED = "early_stopped"  # stopped by ASHA at a rung, with a checkpoint; can be continued

    ENDED = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.EARLY_STOPPED)

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="trials")
    number = models.PositiveIntegerField(help_text="0, 1, ...: the Optuna trial number")
    job = models.OneToOneField(Job, null=True, on_delete=models.SET_NULL, related_name="trial")
    values = models.JSONField(help_text="{dotted path: value} set into the template")
    params = models.JSONField(default=dict, help_text="the sampler's own values (a choice's index)")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RUNNING)
    status_reason = models.CharField(max_length=500, blank=True)
    metric = models.FloatField(null=True, blank=True, help_text="the best value of the search's metric so far")
    steps = models.PositiveBigIntegerField(default=0, help_text="the last step the metric was read at")
    rung = models.IntegerField(null=True, blank=True, help_text="the highest ASHA rung reached (0 = min_steps)")
    rung_values = models.JSONField(default=dict, blank=True, help_text='{"<rung>": metric at that rung}')
    continued = models.BooleanField(default=False, help_text="continued by a person after an early stop: "
                                                             "ASHA no longer stops it")
    created_at = models.DateTimeField(auto_now_add=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["experiment", "number"]
        constraints = [models.UniqueConstraint(fields=["experiment", "number"], name="trial_experiment_number_unique")]

    def __str__(self) -> str:
        return f"{self.experiment_id}#{self.number}"


class ExperimentEvent(models.Model):
    """The experiment's timeline (as JobEvent is a job's)."""

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=32)
    message = models.CharField(max_length=1000)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
