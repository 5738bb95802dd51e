"""The relay's rows: one metric sample per (attempt, rank, step)."""
from __future__ import annotations

from django.db import models

from jobs.models.attempts import Attempt
from jobs.models.runs import Job


class MetricSample(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metrics")
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="metrics")
    rank = models.PositiveIntegerField()
    step = models.PositiveBigIntegerField()
    ts = models.FloatField()
    loss = models.FloatField(null=True)
    samples_per_s = models.FloatField(null=True)
    tokens_per_s = models.FloatField(null=True)
    step_s = models.FloatField(null=True)
    data_s = models.FloatField(null=True)
    compute_s = models.FloatField(null=True)
    comm_s = models.FloatField(null=True)
    optim_s = models.FloatField(null=True)
    bytes_sent = models.BigIntegerField(null=True)
    mem_bytes = models.BigIntegerField(null=True)
    compression_ratio = models.FloatField(null=True, help_text="dense bytes / bytes sent this step")
    share = models.FloatField(null=True, help_text="this rank's fraction of the global batch (balancing)")
    extra = models.JSONField(null=True, blank=True, help_text="the user's own metrics this step: {name: float}")

    FIELDS = ("rank", "step", "ts", "loss", "samples_per_s", "tokens_per_s", "step_s", "data_s",
              "compute_s", "comm_s", "optim_s", "bytes_sent", "mem_bytes", "compression_ratio", "share")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["attempt", "rank", "step"], name="metric_attempt_rank_step_unique")
        ]
        indexes = [models.Index(fields=["job", "step"], name="metric_job_step_idx"),
                   models.Index(fields=["job", "rank", "step"], name="metric_job_rank_step_idx")]
