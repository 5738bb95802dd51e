"""A job's charts from the per-step rollup (issue 26): what the job socket and the relay send instead of
every rank's sample. Read from `MetricStep` (one row per (attempt, step), the cross-rank count/min/mean/max
of each standard field and the ranks of the extremes), so a frame's size depends on the number of steps
charted, never on the number of ranks.

A **step row** (the wire form, docs/architecture.md "WebSockets"):

    {"attempt": 7, "step": 1200, "ts": 1765000000.1, "ranks": 1024,
     "loss": [min, mean, max, n], "step_s": [...], ...   # each standard field some rank reported (n > 0)
     "by": {"step_s": [min_rank, max_rank], "loss": [...], "compute_s": [...]},
     "metrics": {"val_loss": [min, last, max]}}           # the user's own metrics, when logged

A bucket of the snapshot has the same form: `step` is its last step, `min`/`max` span every step of the
bucket (min of f_min, max of f_max: a spike survives, as in W&B), the mean, `n`, `by`, `ts` and `ranks`
are those of its last step, and `first` is its first step. A live step is a bucket of one step. User
metrics are the lowest reporting rank's values (MetricStep.extra): `[v, v, v]` for one step, the bucket's
min, last and max of that value otherwise.

The **named ranks**: the slowest and the fastest few, by how often each was the step's `step_s_max_rank`
(slowest) or `step_s_min_rank` (fastest) over the last NAMED_RECENT_STEPS steps; a job of at most
SMALL_WORLD ranks names every rank. Their per-rank samples (MetricSample) are what the job page draws
as lines next to the band.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from django.db.models import BigIntegerField, Count, ExpressionWrapper, F, Max, Min, Q, Value

from jobs.models import MetricSample, MetricStep
from jobs.models.telemetry import RANKED_FIELDS, REDUCED_FIELDS
from jobs.telemetry.selectors import lineage_filter
from jobs.telemetry.series import MAX_POINTS, UserMetric

NAMED_PER_SIDE = 3          # the slowest few and the fastest few
NAMED_RECENT_STEPS = 200    # ... counted over this many recent steps
SMALL_WORLD = 8             # a job of at most this many ranks names them all
NAMED_SAMPLE_STEPS = 500    # the named ranks' per-rank samples: the most recent this many steps
MAX_USER_METRICS = 32       # as ingest.user_metrics allows per sample

STEP_COLUMNS = (["attempt_id", "step", "ts", "ranks", "extra"]
                + [f"{f}_{k}" for f in REDUCED_FIELDS for k in ("min", "mean", "max", "n")]
                + [f"{f}_{k}_rank" for f in RANKED_FIELDS for k in ("min", "max")])


def step_bucket(first: int, last: int, max_points: int):
    """The bucket of a step in [first, last] among max_points: (step - first) * n // (last - first + 1) in
    integer arithmetic, as jobs/telemetry/series.py buckets over step (whole steps; a run shorter than n
    steps gets one bucket per step)."""
    return ExpressionWrapper((F("step") - Value(first)) * Value(max_points) / Value(last - first + 1),
                             output_field=BigIntegerField())


def step_row(r: dict, *, lo: dict | None = None, hi: dict | None = None, first: int | None = None) -> dict:
    """The wire form of one MetricStep row (a dict of STEP_COLUMNS); lo/hi: a bucket's min/max per
    field (and per user metric, "m:<name>") instead of the step's own."""
    out = {"attempt": r["attempt_id"], "step": r["step"], "ts": r["ts"], "ranks": r["ranks"]}
    if first is not None and first != r["step"]:
        out["first"] = first
    for f in REDUCED_FIELDS:
        n = r[f"{f}_n"]
        if not n or r[f"{f}_mean"] is None:
            continue
        out[f] = [lo[f] if lo else r[f"{f}_min"], r[f"{f}_mean"], hi[f] if hi else r[f"{f}_max"], n]
    by = {f: [r[f"{f}_min_rank"], r[f"{f}_max_rank"]] for f in RANKED_FIELDS if r[f"{f}_max_rank"] is not None}
    if by:
        out["by"] = by
    extra = r["extra"]
    if isinstance(extra, dict) and extra:
        metrics = {}
        for name, v in extra.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                lo_v = lo.get(f"m:{name}") if lo else None
                hi_v = hi.get(f"m:{name}") if hi else None
                metrics[name] = [v if lo_v is None else min(lo_v, v), v, v if hi_v is None else max(hi_v, v)]
        if metrics:
            out["metrics"] = metrics
    return out


def _lineage_steps(job_id: int, from_step: int | None = None):
    qs = MetricStep.objects.filter(job_id=job_id).filter(lineage_filter(job_id))
    return qs.filter(step__gte=from_step) if from_step is not None else qs


def reduced_series(job_id: int, *, from_step: int | None = None, max_points: int = MAX_POINTS) -> dict:
    """{"steps": [step rows, in step order, at most max_points], "bucketed": whether a row stands for
    several steps, "total_steps": steps summarised}. In the database: the bounds and the count (one
    aggregate), then either every row (a run of at most max_points steps) or one GROUP BY over
    step_bucket (min of each f_min, max of each f_max, the last step) and the rows at the buckets'
    last steps. Python holds ~max_points rows whatever the run's length or its number of ranks."""
    qs = _lineage_steps(job_id, from_step)
    agg = qs.aggregate(n=Count("id"), lo=Min("step"), hi=Max("step"))
    if not agg["n"]:
        return {"steps": [], "bucketed": False, "total_steps": 0}
    if agg["n"] <= max_points:
        rows = qs.order_by("step").values(*STEP_COLUMNS)
        return {"steps": [step_row(r) for r in rows], "bucketed": False, "total_steps": agg["n"]}
    # The user metrics' names from the newest row (its lowest rank's): their min/max go in the GROUP BY.
    newest = qs.order_by("-step").values_list("extra", flat=True).first()
    names = sorted(k for k, v in newest.items() if isinstance(v, (int, float)))[:MAX_USER_METRICS] \
        if isinstance(newest, dict) else []
    aggs = {"last": Max("step"), "first": Min("step")}
    for i, f in enumerate(REDUCED_FIELDS):
        aggs[f"lo{i}"], aggs[f"hi{i}"] = Min(f"{f}_min"), Max(f"{f}_max")
    for i, name in enumerate(names):
        aggs[f"mlo{i}"], aggs[f"mhi{i}"] = Min(UserMetric(name)), Max(UserMetric(name))
    groups = list(qs.annotate(b=step_bucket(agg["lo"], agg["hi"], max_points)).values("b").order_by("b")
                  .annotate(**aggs))
    by_last = {g["last"]: g for g in groups}
    rows = qs.filter(step__in=list(by_last)).order_by("step").values(*STEP_COLUMNS)
    out = []
    for r in rows:
        g = by_last[r["step"]]
        lo = {f: g[f"lo{i}"] for i, f in enumerate(REDUCED_FIELDS)}
        hi = {f: g[f"hi{i}"] for i, f in enumerate(REDUCED_FIELDS)}
        for i, name in enumerate(names):
            lo[f"m:{name}"], hi[f"m:{name}"] = g[f"mlo{i}"], g[f"mhi{i}"]
        out.append(step_row(r, lo=lo, hi=hi, first=g["first"]))
    return {"steps": out, "bucketed": True, "total_steps": agg["n"]}


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


def named_samples(job_id: int, named: dict, *, from_step: int | None = None,
                  steps: int = NAMED_SAMPLE_STEPS) -> list[dict]:
    """The named ranks' per-rank samples along the lineage over the most recent `steps` steps (from
    `from_step` on, if later), in (step, rank) order."""
    recent = _lineage_steps(job_id, from_step).order_by("-step").values_list("step", flat=True)[steps - 1:steps]
    start = max([*recent, from_step or 0])
    qs = MetricSample.objects.filter(job_id=job_id, step__gte=start).filter(lineage_filter(job_id))
    ranks = named_rank_set(named)
    if ranks is not None:
        qs = qs.filter(rank__in=sorted(ranks))
    return sample_dicts(qs.order_by("step", "rank", "attempt_id"))


def steps_of(keys: dict[int, set[int]]) -> list[dict]:
    """The MetricStep rows of the given attempt -> steps, in one SELECT, as step rows sorted by
    (job, step); each carries "job"."""
    q = Q()
    for attempt_id, steps in keys.items():
        q |= Q(attempt_id=attempt_id, step__in=sorted(steps))
    if not keys:
        return []
    out = []
    for r in MetricStep.objects.filter(q).order_by("job_id", "step").values("job_id", *STEP_COLUMNS):
        row = step_row(r)
        row["job"] = r["job_id"]
        out.append(row)
    return out


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
