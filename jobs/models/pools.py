"""Pools of machines another scheduler owns (issue 27): a Slurm cluster Trainyard uses through its
launch backend (trainyard/backends.py, trainyard/slurm.py). A pool has `max_nodes` seats: Node rows
the scheduler places gangs on like any node, each one standing for a Slurm node allocated to the
attempt it holds; a seat's credential is minted for that one allocation and revoked when it ends."""
from __future__ import annotations

from django.core.validators import RegexValidator
from django.db import models

from trainyard.spec_resources import POOL_NAME

MAX_POOL_NODES = 256


class Pool(models.Model):
    class Kind(models.TextChoices):
        SLURM = "slurm"

    name = models.CharField(max_length=32, unique=True, validators=[RegexValidator(POOL_NAME)],
                            help_text="what jobs name in resources.pool; seats are <name>-0, <name>-1, ...")
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.SLURM)
    enabled = models.BooleanField(default=True, help_text="off: nothing new is submitted to it")
    max_nodes = models.PositiveIntegerField(default=2, help_text="the most nodes Trainyard holds in it at once")
    slots_per_node = models.PositiveIntegerField(default=1, help_text="training processes each allocated node runs")
    device = models.CharField(max_length=8, default="cpu", help_text="cpu or cuda")
    gpu_memory_gb = models.FloatField(null=True, blank=True, help_text="cuda: each GPU's memory (GB)")
    settings = models.JSONField(default=dict, help_text="trainyard.slurm.SlurmSettings: access, partition, "
                                                        "account, QOS, priority bands, time limit")
    # How the ephemeral agent starts on an allocated node (workers/slurm_agent.py); none of it secret.
    agent_python = models.CharField(max_length=500, blank=True,
                                    help_text="the Python with Trainyard installed on the compute nodes "
                                              "(empty: TRAINYARD_SLURM_AGENT_PYTHON)")
    agent_code_dir = models.CharField(max_length=500, blank=True, help_text="PYTHONPATH for it (empty: none)")
    agent_run_dir = models.CharField(max_length=500, blank=True,
                                     help_text="the agents' run directory on the nodes (empty: TRAINYARD_RUN_DIR)")
    agent_env = models.JSONField(default=dict, blank=True,
                                 help_text="more environment for the agents (NCCL_SOCKET_IFNAME, sandbox settings)")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.kind} pool {self.name}"


class SlurmJob(models.Model):
    """One attempt's Slurm job: its id once sbatch answered, what squeue/sacct last said, and when
    its agents' launches went out (the launch timeout counts from then, not while Slurm pends)."""

    class State(models.TextChoices):
        SUBMITTING = "submitting"
        PENDING = "pending"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        PREEMPTED = "preempted"
        CANCELLED = "cancelled"
        UNKNOWN = "unknown"

    attempt = models.OneToOneField("jobs.Attempt", on_delete=models.CASCADE, related_name="slurm")
    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="slurm_jobs")
    slurm_id = models.CharField(max_length=32, blank=True, db_index=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.SUBMITTING)
    reason = models.CharField(max_length=300, blank=True, help_text="Slurm's pending or end reason")
    category = models.CharField(max_length=16, blank=True, help_text="resources|priority|limits|held|dependency|other")
    eta = models.DateTimeField(null=True, blank=True, help_text="squeue --start's estimate while pending")
    seats = models.JSONField(default=list, help_text="the seats (Node names) in node-rank order")
    slurm_nodes = models.JSONField(default=list, help_text="the Slurm nodes allocated")
    submitted_at = models.DateTimeField(null=True, blank=True)
    launched_at = models.DateTimeField(null=True, blank=True, help_text="every seat's agent registered; launches sent")
    checked_at = models.DateTimeField(null=True, blank=True)
    unknown_since = models.DateTimeField(null=True, blank=True, help_text="no answer about it since")
    cancel_at = models.DateTimeField(null=True, blank=True, help_text="scancel (the kill) due after the grace")
    signalled_at = models.DateTimeField(null=True, blank=True,
                                        help_text="scancel --signal sent: a stop the agents did not finish in time")
    ended_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True, help_text="its seats' credentials revoked")
    error = models.CharField(max_length=500, blank=True)

    class Meta:
        indexes = [models.Index(fields=["released_at"])]

    def __str__(self) -> str:
        return f"slurm job {self.slurm_id or '?'} of attempt {self.attempt_id}"
