"""A job's metric window for its charts: every rank at each chosen step, downsampled to a bounded number of points.
"""
from __future__ import annotations
from django.db.models import Count, ExpressionWrapper, F, IntegerField, Max, Q, Window
from django.db.models.functions import DenseRank
from jobs.telemetry import selectors
from jobs.models import MetricSample


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
