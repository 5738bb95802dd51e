"""The fleet's rows: nodes, their join requests, security events, the control plane's own clock."""
from __future__ import annotations

from django.db import models


class Node(models.Model):
    class Status(models.TextChoices):
        READY = "READY"
        DRAINING = "DRAINING"
        CORDONED = "CORDONED"
        QUARANTINED = "QUARANTINED"
        LOST = "LOST"

    name = models.CharField(max_length=64, unique=True)
    address = models.CharField(max_length=255)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.READY)
    slots = models.PositiveIntegerField()
    labels = models.JSONField(default=dict, blank=True)
    devices = models.JSONField(default=list, blank=True)
    # What the last heartbeat's `devices` advertise (jobs/scheduling/policy/eligibility.py): "cuda"
    # with gpu_count GPUs, the smallest of gpu_memory_bytes; "cpu"; "" before any device report.
    # Placement reads these, not the JSON (a cuda job runs only where gpu_count > 0).
    device_kind = models.CharField(max_length=8, blank=True, default="")
    gpu_count = models.PositiveIntegerField(default=0)
    gpu_memory_bytes = models.BigIntegerField(default=0, help_text="the smallest advertised GPU's total memory")
    cpu_percent = models.FloatField(null=True, blank=True)
    mem_percent = models.FloatField(null=True, blank=True)
    agent_id = models.CharField(max_length=64, blank=True, help_text="changes when the agent restarts")
    registered_at = models.DateTimeField(auto_now_add=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    # Set when the node was implicated in repeated failures; only an admin clears it. Kept apart from
    # `status` so a quarantined node that goes LOST and comes back is still quarantined.
    quarantined_at = models.DateTimeField(null=True, blank=True)
    quarantine_reason = models.CharField(max_length=500, blank=True)
    # DRAINING: "finish" lets running attempts end on their own, "preempt" checkpoints them away.
    drain_mode = models.CharField(max_length=16, blank=True)
    # Identity (issue 16): staff register a node (manage.py node_add, or approve its join request);
    # its credential is derived from the master key and this salt (trainyard.nodeauth) and only its
    # SHA-256 is kept. `slots_approved` caps what a heartbeat may offer (`slots` = the lower of the
    # two); `address` is the registered one, never a heartbeat's.
    credential_salt = models.CharField(max_length=64, blank=True)
    credential_digest = models.CharField(max_length=64, blank=True)
    slots_approved = models.PositiveIntegerField(null=True, blank=True)
    # A seat of a pool (jobs/models/pools.py): placed on like any node; `holder` is the Slurm job whose
    # allocation it stands for now (its credential is minted for it and revoked when it ends).
    pool = models.ForeignKey("jobs.Pool", null=True, blank=True, on_delete=models.PROTECT, related_name="seats")
    holder = models.ForeignKey("jobs.SlurmJob", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["status", "last_heartbeat"])]

    def __str__(self) -> str:
        return self.name


class NodeJoinRequest(models.Model):
    """A heartbeat from a node no staff member registered: refused, and shown here until staff
    approve it (admin action: registers the node and shows its credential once) or delete it."""

    name = models.CharField(max_length=64, unique=True)
    address = models.CharField(max_length=255, blank=True)
    slots = models.PositiveIntegerField(default=0)
    labels = models.JSONField(default=dict, blank=True)
    heartbeats = models.PositiveIntegerField(default=0)
    first_seen = models.DateTimeField(auto_now_add=True)
    last_seen = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-last_seen"]

    def __str__(self) -> str:
        return f"join request from {self.name}"


class SecurityEvent(models.Model):
    """A refused report: a bad signature, a node reporting for another node's allocation, a
    heartbeat under another node's name. One row per (kind, node), counted, so a flood of
    forgeries grows a counter, not the table."""

    kind = models.CharField(max_length=32)
    node = models.CharField(max_length=64)
    detail = models.CharField(max_length=500, blank=True)
    count = models.PositiveIntegerField(default=0)
    first_at = models.DateTimeField(auto_now_add=True)
    last_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-last_at"]
        constraints = [models.UniqueConstraint(fields=["kind", "node"], name="security_event_kind_node")]

    def __str__(self) -> str:
        return f"{self.kind} from {self.node} (x{self.count})"


class ControlPlaneClock(models.Model):
    """One row: when the node check last ran, and since when the control plane has been healthy
    (checking on schedule, the database writable). Nodes are judged LOST only over healthy time:
    after a stall (control worker or beat down, database locked) a node that went silent only
    because its heartbeats could not be applied gets a whole TRAINYARD_NODE_LOST_S again."""

    last_check_at = models.DateTimeField(null=True, blank=True)
    healthy_since = models.DateTimeField(null=True, blank=True)
    stalls = models.PositiveIntegerField(default=0, help_text="stalls seen (a gap between checks over the limit)")
    last_stall_s = models.FloatField(null=True, blank=True, help_text="the latest stall's length")
    last_stall_at = models.DateTimeField(null=True, blank=True, help_text="when the latest stall ended")

    def __str__(self) -> str:
        return f"control plane healthy since {self.healthy_since}"
