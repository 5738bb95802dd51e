"""What a job socket sends for its charts (issue 26): the reduced steps along the job's lineage, bucketed in
the database to at most ~1,500 points whatever the run's length or number of ranks, the named ranks and their
recent per-rank samples (jobs/telemetry/reduced.py has the row format).

`metric_window` is the pre-issue-26 window (every rank at each chosen step): no socket sends it any more;
bench/ws_snapshot.py measures it side by side with the reduced snapshot.
"""
from __future__ import annotations
from django.db.models import Count, ExpressionWrapper, F, IntegerField, Max, Q, Window
from django.db.models.functions import DenseRank
from jobs.telemetry import reduced, selectors
from jobs.telemetry.series import MAX_POINTS
from jobs.models import MetricSample

SNAPSHOT_POINTS = MAX_POINTS  # points per curve in a snapshot or catch-up window


METRIC_VALUES = MetricSample.FIELDS + ("attempt_id", "extra")


def _metric_dicts(qs) -> list[dict]:
    rows = list(qs.values(*METRIC_VALUES))
    for r in rows:
        r["attempt"] = r.pop("attempt_id")
        r["metrics"] = r.pop("extra")  # the user's own metrics, as the relay's live samples carry them
    return rows


def metric_window(job_id: int, *, from_step: int | None = None, max_points: int = 4000) -> tuple[list[dict], bool]:
    """Samples for a live chart: from `from_step` on (default: everything), at most max_points rows,
    and whether some steps were left out.

    Downsampled in the database (issue 15): one aggregate counts the rows and the distinct steps,
    then only every k-th step (by its rank among the distinct steps, so uneven reporting intervals
    and restarts thin out evenly; the same steps for every rank, so charts stay aligned) plus the
    newest step are fetched. Before, every connect read the whole history into Python to drop
    most of it: 200,000 samples cost 183 MB and ~9 s per connect; now Python holds at most
    ~max_points rows whatever the job's length, in 2 queries."""
    qs = MetricSample.objects.filter(job_id=job_id).filter(selectors.lineage_filter(job_id))
    if from_step is not None:
        qs = qs.filter(step__gte=from_step)
    agg = qs.aggregate(rows=Count("id"), steps=Count("step", distinct=True), last=Max("step"))
    if agg["rows"] <= max_points:
        return _metric_dicts(qs.order_by("step", "rank", "attempt_id")), False
    ranks = -(-agg["rows"] // max(1, agg["steps"]))  # rows per step (ceil)
    # every k-th step: steps / k kept steps of `ranks` rows each, plus the newest, stay within max_points
    stride = max(1, -(-agg["steps"] * ranks // max(1, max_points - ranks)))
    picked = (qs.annotate(step_index=Window(DenseRank(), order_by=F("step").asc()))
              .annotate(offset=ExpressionWrapper((F("step_index") - 1) % stride, output_field=IntegerField()))
              .filter(Q(offset=0) | Q(step=agg["last"])))
    return _metric_dicts(picked.order_by("step", "rank", "attempt_id")), True


def chart_telemetry(job_id: int, *, from_step: int | None = None, max_points: int = SNAPSHOT_POINTS) -> dict:
    """The charts' part of a snapshot (from_step None) or of a catch-up `window` (from `from_step` on):
    {"steps": bucketed step rows, "bucketed", "total_steps", "named": the named ranks, "samples": their
    per-rank samples over the recent steps, "downsampled": the samples are not the whole series}. ~6 queries (the lineage's attempts are read by each)."""
    series = reduced.reduced_series(job_id, from_step=from_step, max_points=max_points)
    named = reduced.named_ranks(job_id)
    samples = reduced.named_samples(job_id, named, from_step=from_step) if series["steps"] else []
    # downsampled: the samples are not every step of the series (buckets, or only the recent steps')
    first = series["steps"][0].get("first", series["steps"][0]["step"]) if series["steps"] else None
    downsampled = series["bucketed"] or bool(samples and samples[0]["step"] > first)
    return {**series, "named": named, "samples": samples, "downsampled": downsampled}
