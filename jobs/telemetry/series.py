"""Bucketed series of one metric of a job (issue 25, section 2): at most `max_points` buckets over step
or time, each `{x, min, max, last}`, computed in the database.

A metric is either a standard field of the sample (a MetricSample column: the built-in trainer's
`loss`, `step_s`, `samples_per_s`, ...) or one of the user's own (`run.log(step, val_loss=...)`, kept in
MetricSample.extra under a name matching ingest.USER_METRIC_NAME; a name of a standard field never
lands in `extra`: the SDK puts it in its column). Samples are read along the job's lineage
(selectors.lineage_filter: each step once per rank after restarts and rollbacks).

Buckets: over `step`, bucket (step - lo) * max_points // (hi - lo + 1) (whole steps: a job with fewer
steps than max_points gets one bucket per step, i.e. its exact series; a longer one max_points
when it reported every step);
over `time` (the sample's `ts`, epoch seconds), into max_points equal spans. Each bucket's `min`
and `max` are over every rank's sample in it, `x` is its last sample's step (or ts), and `last` is
the mean over ranks of the metric at the bucket's last step. Queries: the first and the last step
with the metric (the (job, step) index), their ts, one GROUP BY over the bucket expression (min, max,
last step, last ts, count) and one AVG at those last steps. Python holds at most ~max_points rows
whatever the job's length: bench/series.py measures 1,000,000 samples (SQLite and PostgreSQL).
"""
from __future__ import annotations

import re

from django.db.models import (Avg, BigIntegerField, Count, ExpressionWrapper, F, FloatField, Func, Max, Min,
                              Value)
from django.db.models.functions import Greatest, Least

from jobs.models import MetricSample
from jobs.telemetry.selectors import lineage_filter

MAX_POINTS = 1500
# The standard fields a chart can plot (rank, step and ts are coordinates, not metrics).
BUILTIN_METRICS = tuple(f for f in MetricSample.FIELDS if f not in ("rank", "step", "ts"))
# What ingest accepts as a user metric's name (jobs/telemetry/ingest.py USER_METRIC_NAME).
METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]{0,63}")
X_AXES = ("step", "time")


class _FloorNonNegative(Func):
    """floor(x) for x >= 0. PostgreSQL's FLOOR is native; on SQLite, Django's FLOOR is a Python
    function called per row, while CAST(x AS INTEGER) truncates, which is the floor of a
    non-negative number."""

    function = "FLOOR"
    output_field = BigIntegerField()

    def as_sqlite(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="CAST(%(expressions)s AS INTEGER)", **extra)


class UserMetric(Func):
    """extra[name] as a number, with one JSON lookup: ("extra" ->> name)::double precision on PostgreSQL,
    JSON_EXTRACT("extra", '$."name"') on SQLite. Django's KeyTextTransform costs three there (a CASE
    over JSON_TYPE to tell JSON null/true/false from numbers: never stored, ingest keeps finite
    numbers only), i.e. ~2.5x the time of a bucketing query over 1M samples (bench/series.py). The
    name is a parameter, never spliced into the SQL (and valid_metric_name allows no quote)."""

    output_field = FloatField()

    def __init__(self, name: str):
        super().__init__(F("extra"))
        self.metric = name

    def as_sql(self, compiler, connection, **extra):
        sql, params = compiler.compile(self.source_expressions[0])
        return f"(({sql} ->> %s)::double precision)", (*params, self.metric)

    def as_sqlite(self, compiler, connection, **extra):
        sql, params = compiler.compile(self.source_expressions[0])
        return f"JSON_EXTRACT({sql}, %s)", (*params, f'$."{self.metric}"')


def metric_value(name: str):
    """The metric as an expression: its column, or its value in `extra`."""
    return F(name) if name in BUILTIN_METRICS else UserMetric(name)


def valid_metric_name(name: str) -> bool:
    return name in BUILTIN_METRICS or bool(METRIC_NAME.fullmatch(name))


def _samples(job_id: int, metric: str, rank: int | None):
    qs = MetricSample.objects.filter(job_id=job_id).filter(lineage_filter(job_id))
    if rank is not None:
        qs = qs.filter(rank=rank)
    return qs.annotate(v=metric_value(metric)).filter(v__isnull=False)


def job_series(job_id: int, metric: str, *, x: str = "step", max_points: int = MAX_POINTS,
               rank: int | None = None) -> dict:
    """{"buckets": [{x, min, max, last}, ...] in x order (at most max_points), "samples": how many
    samples they summarise, "first_ts": the first such sample's ts or None}. `rank`: one rank's
    samples only (default: every rank's)."""
    if x not in X_AXES:
        raise ValueError(f"x must be one of {X_AXES}, got {x!r}")
    if max_points < 1:
        raise ValueError("max_points must be at least 1")
    qs = _samples(job_id, metric, rank)
    # The bounds from the first and the last step with the metric: the (job, step) index finds them
    # without a scan. Along a lineage a later step is a later sample (an attempt resumes after the
    # one it replaces), so the time bounds are the extreme ts at those two steps; a rank's clock
    # a little off is clamped into the first or last bucket.
    first = qs.order_by("step").values_list("step", flat=True).first()
    if first is None:
        return {"buckets": [], "samples": 0, "first_ts": None}
    last = qs.order_by("-step").values_list("step", flat=True).first()
    ts = qs.filter(step__in=[first, last]).aggregate(lo=Min("ts"), hi=Max("ts"))
    if x == "step":
        # integer arithmetic: (step - lo) * n // span is in [0, n - 1], and every bucket holds a step
        # once span >= n (whole steps of ceil(span / n) would leave as few as n / 2 buckets)
        bucket = ExpressionWrapper((F("step") - Value(first)) * Value(max_points) / Value(last - first + 1),
                                   output_field=BigIntegerField())
    else:
        width = (ts["hi"] - ts["lo"]) / max_points or 1.0
        # ts == hi lands on index max_points exactly: Least folds it into the last bucket.
        bucket = Greatest(Least(_FloorNonNegative((F("ts") - Value(ts["lo"])) / Value(width)),
                                Value(max_points - 1), output_field=BigIntegerField()),
                          Value(0), output_field=BigIntegerField())
    rows = list(qs.annotate(b=bucket).values("b").order_by("b")
                .annotate(lo_v=Min("v"), hi_v=Max("v"), last_step=Max("step"), last_ts=Max("ts"), n=Count("id")))
    means = dict(qs.filter(step__in=[r["last_step"] for r in rows]).values("step").order_by("step")
                 .annotate(mean=Avg("v")).values_list("step", "mean"))
    key = "last_step" if x == "step" else "last_ts"
    buckets = [{"x": r[key], "min": r["lo_v"], "max": r["hi_v"], "last": means.get(r["last_step"])} for r in rows]
    return {"buckets": buckets, "samples": sum(r["n"] for r in rows), "first_ts": ts["lo"]}


def job_metric_names(job_ids: list[int]) -> dict[int, list[str]]:
    """{job id: the metric names it reported, sorted}: the standard fields any of its samples has a
    value for, and every key of its samples' user metrics. One aggregate per job (COUNT of each
    column skips NULLs) and one DISTINCT over the JSON keys for all of them (json_each on SQLite,
    jsonb_object_keys on PostgreSQL): scans of the jobs' rows in the database, nothing loaded."""
    from django.db import connection

    out: dict[int, set[str]] = {pk: set() for pk in job_ids}
    if not job_ids:
        return {}
    counts = (MetricSample.objects.filter(job_id__in=job_ids).values("job_id").order_by("job_id")
              .annotate(**{f"n_{f}": Count(f) for f in BUILTIN_METRICS}))
    for row in counts:
        out[row["job_id"]].update(f for f in BUILTIN_METRICS if row[f"n_{f}"])
    table = MetricSample._meta.db_table
    marks = ", ".join(["%s"] * len(job_ids))
    if connection.vendor == "postgresql":
        sql = (f"SELECT DISTINCT job_id, jsonb_object_keys(extra) FROM {table} "
               f"WHERE job_id IN ({marks}) AND extra IS NOT NULL AND jsonb_typeof(extra) = 'object'")
    else:
        sql = (f"SELECT DISTINCT m.job_id, j.key FROM {table} m, json_each(m.extra) j "
               f"WHERE m.job_id IN ({marks}) AND m.extra IS NOT NULL")
    with connection.cursor() as cur:
        cur.execute(sql, list(job_ids))
        for job_id, name in cur.fetchall():
            if isinstance(name, str) and METRIC_NAME.fullmatch(name):
                out[job_id].add(name)
    return {pk: sorted(names) for pk, names in out.items()}

