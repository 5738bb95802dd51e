"""The relay's rows: one metric sample per (attempt, rank, step) (kept for a recent window: retention), one
reduced row per (attempt, step) (kept for the job's life), and the retention settings."""
from __future__ import annotations

from django.db import models
from django.db.models.functions import Coalesce

from jobs.models.attempts import Attempt
from jobs.models.runs import Job


class MetricSample(models.Model):
    # No single-column FK indexes: (job, rank, step) and the unique (attempt, rank, step) lead with
    # them, and each index more cost the relay ~1 us a sample (issue 26)
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metrics", db_index=False)
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="metrics", db_index=False)
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
        # (job, step) reads go to MetricStep; the per-rank rows are read by rank (drill-down) or attempt
        indexes = [models.Index(fields=["job", "rank", "step"], name="metric_job_rank_step_idx")]


# The standard fields reduced across ranks (everything of MetricSample.FIELDS but the coordinates).
REDUCED_FIELDS = ("loss", "samples_per_s", "tokens_per_s", "step_s", "data_s", "compute_s", "comm_s", "optim_s",
                  "bytes_sent", "mem_bytes", "compression_ratio", "share")
# ... and those whose slowest/fastest (or highest/lowest) rank is kept by name.
RANKED_FIELDS = ("step_s", "loss", "compute_s")


def _reduced_columns() -> dict[str, models.Field]:
    cols: dict[str, models.Field] = {}
    for f in REDUCED_FIELDS:
        cols[f"{f}_n"] = models.PositiveIntegerField(default=0, help_text=f"ranks that reported {f}")
        cols[f"{f}_min"] = models.FloatField(null=True)
        cols[f"{f}_mean"] = models.FloatField(null=True)
        cols[f"{f}_max"] = models.FloatField(null=True)
    for f in RANKED_FIELDS:
        cols[f"{f}_min_rank"] = models.PositiveIntegerField(null=True, help_text=f"the rank with the lowest {f}")
        cols[f"{f}_max_rank"] = models.PositiveIntegerField(null=True, help_text=f"the rank with the highest {f}")
    return cols


class MetricStep(models.Model):
    """One row per (attempt, step): the cross-rank reductions of each standard field (count, min, mean,
    max; for step_s, loss and compute_s also the ranks of the min and the max), kept for the job's life
    (issue 26). What charts, the API's default, straggler detection, the knowledge base and predictions
    read; the per-rank MetricSample rows behind it are kept only for a recent window (retention).

    Written by the relay in the same transaction as the per-rank rows, from the rows that were new
    (jobs/telemetry/ingest.py): a replayed sample changes nothing, samples of one step arriving in
    several rounds merge (counts add, means weighted, min/max and their ranks kept)."""

    # (job, step) and the unique (attempt, step) serve the FKs' lookups
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metric_steps", db_index=False)
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="metric_steps", db_index=False)
    step = models.PositiveBigIntegerField()
    ts = models.FloatField(help_text="the latest rank's sample time of this step")
    ranks = models.PositiveIntegerField(help_text="ranks that reported this step")
    extra = models.JSONField(null=True, blank=True,
                             help_text="the user's own metrics of the lowest rank that logged any at this step")
    extra_rank = models.PositiveIntegerField(null=True)
    # + <field>_n, _min, _mean, _max for each of REDUCED_FIELDS and <field>_min_rank, _max_rank for each of
    # RANKED_FIELDS (added below: 54 columns written out by hand would only hide a typo)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["attempt", "step"], name="metricstep_attempt_step_unique")]
        indexes = [models.Index(fields=["job", "step"], name="metricstep_job_step_idx")]


for _name, _field in _reduced_columns().items():
    MetricStep.add_to_class(_name, _field)


class RetentionPolicy(models.Model):
    """How long telemetry is kept (issue 26): the site's row (team empty) and optionally one per team,
    whose set fields override the site's. Applied by the periodic purge (jobs/telemetry/retention.py)."""

    team = models.OneToOneField("auth.Group", null=True, blank=True, on_delete=models.CASCADE,
                                related_name="retention")
    rank_window_steps = models.PositiveIntegerField(
        null=True, blank=True, help_text="per-rank samples kept at full resolution for the last N steps (site: 2000)")
    rank_sampled_per_rank = models.PositiveIntegerField(
        null=True, blank=True, help_text="older per-rank samples thinned to at most about N steps per rank (site: 1000)")
    rank_days = models.FloatField(null=True, blank=True,
                                  help_text="days after a job ends that its per-rank samples are kept (empty: forever)")
    reduced_days = models.FloatField(null=True, blank=True,
                                     help_text="days after a job ends that its per-step rows are kept (empty: forever)")
    logs_days = models.FloatField(null=True, blank=True,
                                  help_text="days after a job ends that its kept log files are kept (empty: forever)")
    finished_jobs_days = models.FloatField(
        null=True, blank=True, help_text="days after a job ends that the job itself is deleted (empty: forever)")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        # one row per team, and one site row (team empty)
        constraints = [models.UniqueConstraint(Coalesce(models.F("team"), models.Value(0)),
                                               name="retention_one_per_team")]
