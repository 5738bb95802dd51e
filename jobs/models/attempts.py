"""A job's runs: attempts and their allocations, checkpoints, the timeline's events."""
from __future__ import annotations

from django.conf import settings
from django.db import models

from jobs.models.fleet import Node
from jobs.models.runs import Job
from trainyard import attemptauth


class Checkpoint(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    attempt = models.ForeignKey("Attempt", null=True, on_delete=models.SET_NULL, related_name="checkpoints")
    step = models.PositiveBigIntegerField()
    path = models.CharField(max_length=1000)
    size_bytes = models.BigIntegerField(default=0)
    blocking_s = models.FloatField(default=0)
    save_s = models.FloatField(default=0)
    superseded = models.BooleanField(default=False)
    pinned = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    deleted_at = models.DateTimeField(null=True, blank=True, help_text="files removed by retention")

    class Meta:
        ordering = ["-step", "-id"]
        indexes = [models.Index(fields=["job", "-step"])]
        constraints = [models.UniqueConstraint(fields=["job", "path"], name="checkpoint_path_unique")]


class Attempt(models.Model):
    class Status(models.TextChoices):
        STARTING = "STARTING"
        RUNNING = "RUNNING"
        STOPPING = "STOPPING"
        ENDED = "ENDED"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.STARTING)
    # succeeded | failed:<class> | preempted | rolled_back | cancelled | lost
    outcome = models.CharField(max_length=64, null=True, blank=True)
    stop_reason = models.CharField(max_length=64, blank=True, help_text="why the control plane stopped it")
    failure = models.JSONField(default=dict, blank=True, help_text="evidence behind a failed outcome")
    resumed_from = models.ForeignKey(Checkpoint, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    resumed_from_step = models.PositiveBigIntegerField(null=True, blank=True)
    # Progress as the relay committed it: the hang detector's evidence.
    last_step = models.PositiveBigIntegerField(default=0)
    # Set when the control plane wrote the attempt off with a node it lost (jobs/fleet/services/nodes.py):
    # the last step it had accepted. Nothing of the attempt beyond it is taken in: its ranks may
    # still run behind a partition, and their later samples and checkpoints belong to no line.
    fenced_step = models.PositiveBigIntegerField(null=True, blank=True)
    last_progress_at = models.DateTimeField(null=True, blank=True)
    stragglers = models.JSONField(default=list, blank=True, help_text="[{rank, node, ratio, ...}] flagged now")
    rank_plans = models.JSONField(default=dict, blank=True,
                                  help_text='{"<rank>": {coords, role, param_bytes, optim_bytes}} as the runtime reported them')
    profile = models.JSONField(default=dict, blank=True,
                               help_text="what bounds its step and the recommended change (jobs/policy/profiling.py)")  # as its migration (0007) says: now jobs/attempts/policy/profiling.py
    preempt_requested_at = models.DateTimeField(null=True, blank=True)
    preempt_reason = models.CharField(max_length=500, blank=True)
    preempt_for = models.PositiveIntegerField(null=True, blank=True, help_text="the queued job its slots go to")
    # With the master key, derives the attempt's bus password, manifest-proof key and rendezvous
    # token (trainyard/attemptauth.py); not a secret on its own.
    bus_salt = models.CharField(max_length=64, default=attemptauth.new_salt, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "number"]
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="attempt_number_unique")]
        indexes = [models.Index(fields=["status"])]


class Allocation(models.Model):
    """One node's share of an attempt. `active` holds the node's slots until its processes exit."""

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="allocations")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="allocations")
    node_rank = models.PositiveIntegerField()
    slot_ids = models.JSONField(help_text="slot indices on the node, e.g. [0, 1]")
    ranks = models.JSONField(default=list, blank=True, help_text="[{rank, local_rank, pid}] reported by the agent")
    active = models.BooleanField(default=True)
    result = models.JSONField(null=True, blank=True, help_text="the agent's exit report")
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["attempt", "node_rank"]
        constraints = [
            models.UniqueConstraint(fields=["attempt", "node"], name="allocation_node_unique"),
            models.UniqueConstraint(fields=["attempt", "node_rank"], name="allocation_rank_unique"),
        ]
        indexes = [models.Index(fields=["node", "active"])]

    @property
    def nproc(self) -> int:
        return len(self.slot_ids)


class JobEvent(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    attempt = models.ForeignKey(Attempt, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    kind = models.CharField(max_length=64)
    message = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["job", "id"])]
