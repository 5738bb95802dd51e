"""A job's charts from the per-step rollup (issue 26): what the job socket and the relay send instead of
every rank's sample. Read from `MetricStep` (one row per (attempt, step), the cross-rank count/min/mean/max
of each standard field and the ranks of the extremes), so a frame's size depends on the number of steps
charted, never on the number of ranks.

A **step row** (the wire form, docs/architecture.md "WebSockets"):

    {"attempt": 7, "step": 1200, "ts": 1765000000.1, "ranks": 1024,
     "loss": [min, mean, max, n], "step_s": [...], ...   # each standard field some rank reported (n > 0)
     "by": {"step_s": [min_rank, max_rank], "loss": [...], "compute_s": [...]},
     "metrics": {"val_loss": [min, last, max]}}           # the user's own metrics, when logged

A bucket of the snapshot has the same form: `step` is its last step, `first` its first; for BAND_FIELDS
`min`/`max` span every step of the bucket (min of f_min, max of f_max: a spike survives, as in W&B); the
mean, `n`, `by`, `ts`, `ranks`, the other fields' min/max and the user metrics are those of its last
step. User metrics are the lowest reporting rank's values (MetricStep.extra) as `[v, v, v]`.

The **named ranks**: the slowest and the fastest few, by how often each was the step's `step_s_max_rank`
(slowest) or `step_s_min_rank` (fastest) over the last NAMED_RECENT_STEPS steps; a job of at most
SMALL_WORLD ranks names every rank. Their per-rank samples (MetricSample) are what the job page draws
as lines next to the band.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

import orjson
from django.db.models import BigIntegerField, Count, ExpressionWrapper, F, Max, Min, Value

from jobs.models import MetricSample, MetricStep
from jobs.models.telemetry import RANKED_FIELDS, REDUCED_FIELDS
from jobs.telemetry import rollup
from jobs.telemetry.selectors import lineage_filter
from jobs.telemetry.series import MAX_POINTS

NAMED_PER_SIDE = 3          # the slowest few and the fastest few
NAMED_RECENT_STEPS = 200    # ... counted over this many recent steps
SMALL_WORLD = 8             # a job of at most this many ranks names them all
NAMED_SAMPLE_STEPS = 500    # the named ranks' per-rank samples: the most recent this many steps (a small job)
NAMED_SAMPLE_BUDGET = 1500  # ... or this many samples shared by the named ranks of a big job
# The fields whose bucket carries the min and max over every step in it (the page draws them as bands).
BAND_FIELDS = ("loss", "step_s", "bytes_sent", "share")

def step_columns(fields=REDUCED_FIELDS) -> list[str]:
    """The MetricStep columns a step row is made of, for the standard fields `fields`."""
    return (["attempt_id", "step", "ts", "ranks", "extra"]
            + [f"{f}_{k}" for f in fields for k in ("min", "mean", "max", "n")]
            + [f"{f}_{k}_rank" for f in RANKED_FIELDS for k in ("min", "max")])


STEP_COLUMNS = step_columns()


def step_bucket(first: int, last: int, max_points: int):
    """The bucket of a step in [first, last] among max_points: (step - first) * n // (last - first + 1) in
    integer arithmetic, as jobs/telemetry/series.py buckets over step (whole steps; a run shorter than n
    steps gets one bucket per step)."""
    return ExpressionWrapper((F("step") - Value(first)) * Value(max_points) / Value(last - first + 1),
                             output_field=BigIntegerField())


# (field, its count, mean, min and max columns) and (field, its min and max rank columns): formatted
# once here, not per row and field (step_row runs for every step the relay publishes)
_FIELD_KEYS = {f: (f, f"{f}_n", f"{f}_mean", f"{f}_min", f"{f}_max") for f in REDUCED_FIELDS}
_RANK_KEYS = tuple((f, f"{f}_min_rank", f"{f}_max_rank") for f in RANKED_FIELDS)


def step_row(r: dict, *, lo: dict | None = None, hi: dict | None = None, first: int | None = None,
             fields=REDUCED_FIELDS) -> dict:
    """The wire form of one MetricStep row (a dict of step_columns(fields)); lo/hi: a bucket's min/max
    per field (those it has) instead of the step's own."""
    out = {"attempt": r["attempt_id"], "step": r["step"], "ts": r["ts"], "ranks": r["ranks"]}
    if first is not None and first != r["step"]:
        out["first"] = first
    for f in fields:
        _, kn, kmean, kmin, kmax = _FIELD_KEYS[f]
        n, mean = r[kn], r[kmean]
        if not n or mean is None:
            continue
        out[f] = [lo[f] if lo and f in lo else r[kmin], mean, hi[f] if hi and f in hi else r[kmax], n]
    by = {f: [r[kmin], r[kmax]] for f, kmin, kmax in _RANK_KEYS if r[kmax] is not None}
    if by:
        out["by"] = by
    metrics = _user_metrics(r["extra"])
    if metrics:
        out["metrics"] = metrics
    return out


def _lineage_steps(job_id: int, from_step: int | None = None):
    qs = MetricStep.objects.filter(job_id=job_id).filter(lineage_filter(job_id))
    return qs.filter(step__gte=from_step) if from_step is not None else qs


def reduced_series(job_id: int, *, from_step: int | None = None, max_points: int = MAX_POINTS) -> dict:
    """{"steps": [step rows, in step order, at most max_points], "bucketed": whether a row stands for
    several steps, "total_steps": steps summarised}. In the database: the first and the newest step (the
    (job, step) index; the newest row also says which fields and user metrics the job reports), then
    every row of a run spanning at most max_points steps, or one GROUP BY over step_bucket (the last
    and first step, the count, the min of f_min and max of f_max of each BAND_FIELDS field) and the rows
    at the buckets' last steps. Python holds ~max_points rows whatever the run's length or its ranks.

    Only BAND_FIELDS get a bucket-wide min/max: SQLite pays ~10 ms per aggregate over 100,000 steps, and
    the other fields are charted as means (throughput, breakdown); their min/max in a bucket row are its
    last step's, as are the user metrics' (a JSON lookup per row costs ~100 ms per metric there)."""
    qs = _lineage_steps(job_id, from_step)
    first = qs.order_by("step").values_list("step", flat=True).first()
    if first is None:
        return {"steps": [], "bucketed": False, "total_steps": 0}
    newest = qs.order_by("-step").values(*[f"{f}_n" for f in REDUCED_FIELDS], "step").first()
    last = newest["step"]
    fields = [f for f in REDUCED_FIELDS if newest[f"{f}_n"]]
    columns = step_columns(fields)
    if last - first + 1 <= max_points:
        rows = [step_row(r, fields=fields) for r in qs.order_by("step").values(*columns)]
        return {"steps": rows, "bucketed": False, "total_steps": len(rows)}
    banded = [f for f in fields if f in BAND_FIELDS]
    aggs = {"last": Max("step"), "first": Min("step"), "n": Count("id")}
    for i, f in enumerate(banded):
        aggs[f"lo{i}"], aggs[f"hi{i}"] = Min(f"{f}_min"), Max(f"{f}_max")
    groups = list(qs.annotate(b=step_bucket(first, last, max_points)).values("b").order_by("b").annotate(**aggs))
    by_last = {g["last"]: g for g in groups}
    rows = qs.filter(step__in=list(by_last)).order_by("step").values(*columns)
    out = []
    for r in rows:
        g = by_last[r["step"]]
        lo = {f: g[f"lo{i}"] for i, f in enumerate(banded)}
        hi = {f: g[f"hi{i}"] for i, f in enumerate(banded)}
        out.append(step_row(r, lo=lo, hi=hi, first=g["first"], fields=fields))
    return {"steps": out, "bucketed": True, "total_steps": sum(g["n"] for g in groups)}


def _top(counter: Counter, k: int) -> list[dict]:
    return [{"rank": r, "count": n} for r, n in sorted(counter.items(), key=lambda x: (-x[1], x[0]))[:k]]


def named_from(extremes: list[tuple[int | None, int | None]], world: int) -> dict:
    """The named ranks from recent steps' (step_s_max_rank, step_s_min_rank), newest last; `world`: the
    ranks of the newest step. {"slowest": [{"rank", "count"}], "fastest": [...], "all": every rank named,
    "window": steps counted}."""
    slow = Counter(mx for mx, _ in extremes if mx is not None)
    fast = Counter(mn for _, mn in extremes if mn is not None)
    return {"slowest": _top(slow, NAMED_PER_SIDE), "fastest": _top(fast, NAMED_PER_SIDE),
            "all": 0 < world <= SMALL_WORLD, "window": len(extremes)}


def named_ranks(job_id: int) -> dict:
    """The named ranks of a job (see named_from), from its last NAMED_RECENT_STEPS MetricStep rows."""
    recent = list(_lineage_steps(job_id).order_by("-step")
                  .values_list("step_s_max_rank", "step_s_min_rank", "ranks")[:NAMED_RECENT_STEPS])
    return named_from([(mx, mn) for mx, mn, _ in reversed(recent)], recent[0][2] if recent else 0)


def named_rank_set(named: dict) -> set[int] | None:
    """The ranks whose samples are sent: None for every rank (a small job)."""
    if named["all"]:
        return None
    return {x["rank"] for x in named["slowest"]} | {x["rank"] for x in named["fastest"]}


METRIC_VALUES = MetricSample.FIELDS + ("attempt_id", "extra")


def sample_dicts(qs) -> list[dict]:
    """MetricSample rows as the sockets send them ("attempt", "metrics": the user's own)."""
    rows = list(qs.values(*METRIC_VALUES))
    for r in rows:
        r["attempt"] = r.pop("attempt_id")
        r["metrics"] = r.pop("extra")
    return rows


def named_samples(job_id: int, named: dict, *, from_step: int | None = None, steps: int | None = None) -> list[dict]:
    """The named ranks' per-rank samples along the lineage over the most recent `steps` steps (from
    `from_step` on, if later), in (step, rank) order. Default: NAMED_SAMPLE_STEPS for a small job (every
    rank), else NAMED_SAMPLE_BUDGET samples shared by the named ranks (at least 100 steps)."""
    ranks = named_rank_set(named)
    if steps is None:
        steps = NAMED_SAMPLE_STEPS if ranks is None else min(
            NAMED_SAMPLE_STEPS, max(100, NAMED_SAMPLE_BUDGET // max(1, len(ranks))))
    recent = _lineage_steps(job_id, from_step).order_by("-step").values_list("step", flat=True)[steps - 1:steps]
    start = max([*recent, from_step or 0])
    qs = MetricSample.objects.filter(job_id=job_id, step__gte=start).filter(lineage_filter(job_id))
    if ranks is not None:
        qs = qs.filter(rank__in=sorted(ranks))
    return sample_dicts(qs.order_by("step", "rank", "attempt_id"))


def steps_of(keys: dict[int, set[int]]) -> list[dict]:
    """The MetricStep rows of the given attempt -> steps, in one SELECT, as step rows sorted by
    (job, step); each carries "job". One range per attempt on the unique (attempt, step) index, the
    steps not asked for dropped here: a round's steps are nearly contiguous, and Django compiling an
    IN list of thousands of steps parameter by parameter, then .values() making a dict of 60 columns
    per row, cost the relay more than reading the rows (bench/telemetry.py)."""
    if not keys:
        return []
    from django.db import connection

    cols = ["job_id", *STEP_COLUMNS]
    where = " OR ".join(["(attempt_id = %s AND step BETWEEN %s AND %s)"] * len(keys))
    params: list[int] = []
    for attempt_id, steps in keys.items():
        params += [attempt_id, min(steps), max(steps)]
    sql = (f"SELECT {', '.join(cols)} FROM {MetricStep._meta.db_table} WHERE {where} ORDER BY job_id, step")
    extra_field = MetricStep._meta.get_field("extra")
    out = []
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for values in cursor.fetchall():
            r = dict(zip(cols, values))
            if r["step"] not in keys[r["attempt_id"]]:
                continue
            if isinstance(r["extra"], str):  # SQLite's JSON text (PostgreSQL's jsonb arrives decoded)
                r["extra"] = extra_field.from_db_value(r["extra"], None, connection)
            row = step_row(r)
            row["job"] = r["job_id"]
            out.append(row)
    return out


_COMMITTED = rollup.step_columns()  # a rollup.reduce_rows row's columns (job_id first)


def steps_from(rows: list[tuple]) -> list[dict]:
    """steps_of's rows (each with "job"), from rollup.reduce_rows rows that are MetricStep's rows as
    stored (the relay's fast path knows them: nothing to read back). What step_row makes of each, built
    a column at a time: a row at a time cost ~10 us a step, most of a backlog round's fan-out."""
    if not rows:
        return []
    c = dict(zip(_COMMITTED, zip(*rows)))
    out = [{"attempt": a, "step": s, "ts": t, "ranks": n}
           for a, s, t, n in zip(c["attempt_id"], c["step"], c["ts"], c["ranks"])]
    for f in REDUCED_FIELDS:
        _, kn, kmean, kmin, kmax = _FIELD_KEYS[f]
        ns, means = c[kn], c[kmean]
        cells = map(list, zip(c[kmin], means, c[kmax], ns))
        if 0 not in ns and None not in means:
            for o, cell in zip(out, cells):
                o[f] = cell
        else:
            for o, cell, n, mean in zip(out, cells, ns, means):
                if n and mean is not None:
                    o[f] = cell
    ranked = [(f, c[kmin], c[kmax]) for f, kmin, kmax in _RANK_KEYS]
    for i, o in enumerate(out):
        by = {f: [lo[i], hi[i]] for f, lo, hi in ranked if hi[i] is not None}
        if by:
            o["by"] = by
    for o, extra, job in zip(out, c["extra"], c["job_id"]):
        if extra is not None:
            metrics = _user_metrics(orjson.loads(extra) if isinstance(extra, str) else extra)
            if metrics:
                o["metrics"] = metrics
        o["job"] = job
    return out


def _user_metrics(extra) -> dict | None:
    """A step row's "metrics": each numeric user metric as [v, v, v] (step_row's)."""
    if isinstance(extra, dict) and extra:
        return {name: [v, v, v] for name, v in extra.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return None


class NamedTracker:
    """The relay's view of each job's named ranks: the extremes of the last NAMED_RECENT_STEPS steps it
    published (a step sent again replaces its entry). Starts empty (a restarted relay names from the
    steps it sees next); jobs quiet the longest are forgotten past MAX_JOBS."""

    MAX_JOBS = 2000

    def __init__(self):
        self.jobs: OrderedDict[int, OrderedDict[tuple[int, int], tuple]] = OrderedDict()

    def update(self, job_id: int, rows: list[dict]) -> dict:
        recent = self.jobs.pop(job_id, None) or OrderedDict()
        self.jobs[job_id] = recent
        for r in rows:
            key = (r["attempt"], r["step"])
            recent.pop(key, None)
            by = r.get("by", {}).get("step_s") or [None, None]
            recent[key] = (by[1], by[0])
        while len(recent) > NAMED_RECENT_STEPS:
            recent.popitem(last=False)
        while len(self.jobs) > self.MAX_JOBS:
            self.jobs.popitem(last=False)
        world = rows[-1]["ranks"] if rows else 0
        return named_from(list(recent.values()), world)
