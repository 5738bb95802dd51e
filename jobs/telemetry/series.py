"""Bucketed series of one metric of a job (issue 25, section 2; issue 26): at most `max_points` buckets
over step or time, each `{x, min, max, last}`, computed in the database.

A metric is either a standard field of the sample (a MetricSample column: the built-in trainer's
`loss`, `step_s`, `samples_per_s`, ...) or one of the user's own (`run.log(step, val_loss=...)`, kept in
`extra` under a name matching ingest.USER_METRIC_NAME; a name of a standard field never lands in
`extra`: the SDK puts it in its column).

What is read (issue 26): by default the per-step rows (MetricStep, one per (attempt, step), kept for the
job's life, written by the relay's rollup) along the job's lineage (selectors.lineage_filter: each step
once after restarts and rollbacks). A standard field's bucket `min` is the least `<f>_min`, `max` the
largest `<f>_max` (so one rank's spike at one step survives any bucketing), `last` the `<f>_mean` at the
bucket's last step (the mean over ranks there). A user metric is read from MetricStep.extra: the
metrics of the lowest rank that logged any at that step (usually rank 0), so min/max/last are over
that rank's values. `samples` counts the per-rank samples summarised (the sum of `<f>_n`; for a user
metric, the steps that have it). With `rank=`, one rank's MetricSample rows (the drill-down; per-rank
rows are kept only for a recent window and thinned before it: retention).

Buckets: over `step`, bucket (step - lo) * max_points // (hi - lo + 1) (whole steps: a job with fewer
steps than max_points gets one bucket per step, i.e. its exact series; a longer one max_points
when it reported every step); over `time` (epoch seconds: a step's `ts` is its latest rank's sample
time), into max_points equal spans. `x` is the bucket's last step (or ts). Queries: the first and
the last step with the metric (the (job, step) index), their ts, one GROUP BY over the bucket
expression and one read of the value at the buckets' last steps. Python holds at most ~max_points rows
whatever the job's length: bench/series.py and bench/charts.py measure it (SQLite and PostgreSQL).
"""
from __future__ import annotations

import json
import re

from django.db.models import (Avg, BigIntegerField, Count, ExpressionWrapper, F, FloatField, Func, Max, Min, Sum,
                              Value)
from django.db.models.expressions import RawSQL
from django.db.models.functions import Greatest, Least

from jobs.models import MetricSample, MetricStep
from jobs.models.telemetry import RANKED_FIELDS
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


def _samples(job_id: int, metric: str, rank: int):
    """One rank's samples (the drill-down) with the metric as `v`."""
    qs = MetricSample.objects.filter(job_id=job_id, rank=rank).filter(lineage_filter(job_id))
    return qs.annotate(v=metric_value(metric)).filter(v__isnull=False)


class _Reading:
    """How one metric is read from a queryset: its rows, and the expressions of a row's least value,
    largest value, mean and count (what a bucket aggregates). A user metric also keeps its rows
    before the metric is read (`rows`) and the metric's expression (`value`): the bucketing reads
    it once per row (_user_metric_buckets)."""

    def __init__(self, qs, lo, hi, mean, n, rows=None, value=None):
        self.qs, self.lo, self.hi, self.mean, self.n = qs, lo, hi, mean, n
        self.rows, self.value = rows, value


def _reading(job_id: int, metric: str, rank: int | None) -> _Reading:
    if rank is not None:
        return _Reading(_samples(job_id, metric, rank), "v", "v", "v", None)
    qs = MetricStep.objects.filter(job_id=job_id).filter(lineage_filter(job_id))
    if metric in BUILTIN_METRICS:
        return _Reading(qs.filter(**{f"{metric}_mean__isnull": False}), f"{metric}_min", f"{metric}_max",
                        f"{metric}_mean", f"{metric}_n")
    return _Reading(qs.annotate(v=UserMetric(metric)).filter(v__isnull=False), "v", "v", "v", None,
                    rows=qs, value=UserMetric(metric))


def _step_bucket(first: int, last: int, n: int):
    """(step - first) * n // (last - first + 1), in integer arithmetic: in [0, n - 1], and every
    bucket holds a step once the span is at least n (whole steps of ceil(span / n) would leave as
    few as n / 2 buckets)."""
    return ExpressionWrapper((F("step") - Value(first)) * Value(n) / Value(last - first + 1),
                             output_field=BigIntegerField())


def _time_bucket(lo: float, hi: float, n: int):
    width = (hi - lo) / n or 1.0
    # ts == hi lands on index n exactly: Least folds it into the last bucket.
    return Greatest(Least(_FloorNonNegative((F("ts") - Value(lo)) / Value(width)),
                          Value(n - 1), output_field=BigIntegerField()),
                    Value(0), output_field=BigIntegerField())


def _step_list(steps: list[int]):
    """`steps` as one parameter of a subquery (json_each on SQLite, unnest on PostgreSQL): Django
    compiles an IN of 1,500 values parameter by parameter, which cost a third of a chart read."""
    from django.db import connection

    if connection.vendor == "postgresql":
        return RawSQL("SELECT unnest(%s::bigint[])", ([int(s) for s in steps],))
    if connection.vendor == "sqlite":
        return RawSQL("SELECT value FROM json_each(%s)", (json.dumps([int(s) for s in steps]),))
    return steps


def _means_at(reading: _Reading, steps: list[int]) -> dict[int, float]:
    """{step: the metric's mean over ranks there} at the given steps (a step twice along the lineage,
    never written by the relay, would average its rows weighted by their counts)."""
    qs = reading.qs.filter(step__in=_step_list(steps)).values("step").order_by("step")
    if reading.n is None:
        return dict(qs.annotate(mean=Avg(reading.mean)).values_list("step", "mean"))
    rows = qs.annotate(total=Sum(F(reading.mean) * F(reading.n), output_field=FloatField()), count=Sum(reading.n))
    return {r["step"]: r["total"] / r["count"] for r in rows if r["count"]}


def job_series(job_id: int, metric: str, *, x: str = "step", max_points: int = MAX_POINTS,
               rank: int | None = None) -> dict:
    """{"buckets": [{x, min, max, last}, ...] in x order (at most max_points), "samples": how many
    per-rank samples they summarise, "first_ts": the first step's ts or None}. Default: the per-step
    rows (MetricStep, every rank reduced); `rank`: that rank's own samples only (MetricSample)."""
    if x not in X_AXES:
        raise ValueError(f"x must be one of {X_AXES}, got {x!r}")
    if max_points < 1:
        raise ValueError("max_points must be at least 1")
    reading = _reading(job_id, metric, rank)
    qs = reading.qs
    # The bounds from the first and the last step with the metric: the (job, step) index (MetricStep's,
    # or MetricSample's (job, rank, step)) finds them without a scan. Along a lineage a later step is a
    # later sample (an attempt resumes after the one it replaces), so the time bounds are the extreme
    # ts at those two steps; a clock a little off is clamped into the first or last bucket.
    first = qs.order_by("step").values_list("step", flat=True).first()
    if first is None:
        return {"buckets": [], "samples": 0, "first_ts": None}
    last = qs.order_by("-step").values_list("step", flat=True).first()
    ts = qs.filter(step__in=[first, last]).aggregate(lo=Min("ts"), hi=Max("ts"))
    bucket = (_step_bucket(first, last, max_points) if x == "step"
              else _time_bucket(ts["lo"], ts["hi"], max_points))
    if reading.rows is not None:
        rows = _user_metric_buckets(reading, bucket, x)
    else:
        aggregates = {"lo_v": Min(reading.lo), "hi_v": Max(reading.hi), "last_step": Max("step"),
                      "n": Count("id") if reading.n is None else Sum(reading.n)}
        if x == "time":  # over step the bucket's x is its last step: one aggregate less per row
            aggregates["last_ts"] = Max("ts")
        rows = list(qs.annotate(b=bucket).values("b").order_by("b").annotate(**aggregates))
    means = _means_at(reading, [r["last_step"] for r in rows])
    key = "last_step" if x == "step" else "last_ts"
    buckets = [{"x": r[key], "min": r["lo_v"], "max": r["hi_v"], "last": means.get(r["last_step"])} for r in rows]
    return {"buckets": buckets, "samples": sum(r["n"] for r in rows), "first_ts": ts["lo"]}


def _user_metric_buckets(reading: _Reading, bucket, x: str) -> list[dict]:
    """The bucket rows of a user metric ({b, lo_v, hi_v, last_step, n[, last_ts]}, in b order), its
    JSON value extracted once per row. The ORM's GROUP BY repeats the expression in the WHERE and in
    MIN and MAX, and neither database shares them: three JSON lookups a row, ~40% of a chart read of a
    100,000-step job on PostgreSQL (bench/charts.py). Here the rows with `b` and `v` are a derived
    table that the planner may not merge into the outer query (OFFSET 0: neither PostgreSQL nor
    SQLite flattens a subquery with a LIMIT/OFFSET into an aggregate), filtered and grouped outside.
    The inner query is the ORM's, with its parameters; nothing is spliced in."""
    from django.db import connections

    inner = reading.rows.annotate(b=bucket, v=reading.value).values("step", "ts", "b", "v").order_by()
    sql, params = inner.query.sql_with_params()
    connection = connections[inner.db]
    offset = " OFFSET 0" if connection.vendor == "postgresql" else " LIMIT -1 OFFSET 0"
    last_ts = ", MAX(s.ts)" if x == "time" else ""
    with connection.cursor() as cur:
        cur.execute(f"SELECT s.b, MIN(s.v), MAX(s.v), MAX(s.step), COUNT(*){last_ts} FROM ({sql}{offset}) s "
                    "WHERE s.v IS NOT NULL GROUP BY s.b ORDER BY s.b", params)
        names = ("b", "lo_v", "hi_v", "last_step", "n", "last_ts")
        return [dict(zip(names, row)) for row in cur.fetchall()]


# ---------------------------------------------------------------- the per-rank view (issue 26)

RANK_WINDOW_STEPS = 2000  # the default window: the per-rank rows kept at full resolution (retention)
MAX_RANK_WINDOW_STEPS = 10_000_000
RANKS_LISTED = 5  # the slowest and the fastest ranks named


def job_rank_view(job_id: int, metric: str, *, steps: int = RANK_WINDOW_STEPS, max_points: int = MAX_POINTS,
                  top: int = RANKS_LISTED) -> dict:
    """How the ranks of a job spread over its last `steps` steps (along its lineage), for one of
    RANKED_FIELDS (step_s, loss, compute_s):

    - `band`: at most max_points buckets over step, each {x (its last step), min (the least value of any
      rank), mean (the mean over ranks, weighted by each step's count), max (the largest of any rank)},
      from MetricStep. The band's centre is the mean, not the median: a median is not mergeable
      across relay rounds (the ranks of one step may arrive in several, and each is reduced once),
      a count-weighted mean is.
    - `slowest` / `fastest`: the `top` ranks that were most often the step's `<f>_max_rank` /
      `<f>_min_rank` in the window (for loss: highest / lowest), each {rank, steps (how often), share
      (of the window's steps with the metric), mean (the rank's own mean over the window from its
      MetricSample rows, None when retention kept none)}.
    - `window`: {from, to, steps} the steps read (`steps`: how many had the metric).
    """
    if metric not in RANKED_FIELDS:
        raise ValueError(f"metric must be one of {RANKED_FIELDS}, got {metric!r}")
    lineage = lineage_filter(job_id)
    qs = (MetricStep.objects.filter(job_id=job_id).filter(lineage)
          .filter(**{f"{metric}_mean__isnull": False}))
    last = qs.order_by("-step").values_list("step", flat=True).first()
    if last is None:
        return {"window": {"from": None, "to": None, "steps": 0}, "band": [], "slowest": [], "fastest": []}
    qs = qs.filter(step__gt=last - steps)
    first = qs.order_by("step").values_list("step", flat=True).first()
    mean, n = F(f"{metric}_mean"), F(f"{metric}_n")
    rows = list(qs.annotate(b=_step_bucket(first, last, max_points)).values("b").order_by("b")
                .annotate(lo=Min(f"{metric}_min"), hi=Max(f"{metric}_max"), last_step=Max("step"),
                          total=Sum(mean * n, output_field=FloatField()), count=Sum(n), rows=Count("id")))
    band = [{"x": r["last_step"], "min": r["lo"], "mean": r["total"] / r["count"] if r["count"] else None,
             "max": r["hi"]} for r in rows]
    window_steps = sum(r["rows"] for r in rows)

    def most_often(column: str) -> list[dict]:
        ranked = list(qs.filter(**{f"{column}__isnull": False}).values(column).order_by()
                      .annotate(times=Count("id")).order_by("-times", column)[:top])
        return [{"rank": r[column], "steps": r["times"], "share": r["times"] / window_steps} for r in ranked]

    slowest, fastest = most_often(f"{metric}_max_rank"), most_often(f"{metric}_min_rank")
    named = sorted({r["rank"] for r in slowest + fastest})
    own = dict(MetricSample.objects.filter(job_id=job_id, rank__in=named, step__gte=first, step__lte=last)
               .filter(lineage).filter(**{f"{metric}__isnull": False})
               .values("rank").order_by("rank").annotate(m=Avg(metric)).values_list("rank", "m")) if named else {}
    for r in slowest + fastest:
        r["mean"] = own.get(r["rank"])
    return {"window": {"from": first, "to": last, "steps": window_steps}, "band": band,
            "slowest": slowest, "fastest": fastest}


def job_metric_names(job_ids: list[int]) -> dict[int, list[str]]:
    """{job id: the metric names it reported, sorted}: the standard fields any rank reported at some
    step, and every key of the user metrics its per-step rows hold (MetricStep.extra: what the series
    reads). One aggregate per job (MAX of each field's count) and one DISTINCT over the JSON keys for
    all of them (json_each on SQLite, jsonb_object_keys on PostgreSQL): scans of the jobs' per-step
    rows in the database, nothing loaded."""
    from django.db import connection

    out: dict[int, set[str]] = {pk: set() for pk in job_ids}
    if not job_ids:
        return {}
    counts = (MetricStep.objects.filter(job_id__in=job_ids).values("job_id").order_by("job_id")
              .annotate(**{f"n_{f}": Max(f"{f}_n") for f in BUILTIN_METRICS}))
    for row in counts:
        out[row["job_id"]].update(f for f in BUILTIN_METRICS if row[f"n_{f}"])
    table = MetricStep._meta.db_table
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
