"""The chart reads at scale (issue 26): a simulated 1,024-rank, 100,000-step job as the relay leaves it
after retention, and the chart API calls against it, side by side with the per-rank query charts
ran before the per-step rows. Prints one JSON object. Not run in CI.

    python bench/charts.py                       # SQLite (~2-3 min on 2 shared cores)
    python bench/charts.py --postgres            # the same on a PostgreSQL server it starts (tests/postgres.py)
    python bench/charts.py --steps 20000 --old-steps 250,500   # quicker

The database: fresh, in a temporary directory, migrated by Django; the job and its attempt as ORM rows;
then, written straight into the tables (executemany on SQLite, COPY on PostgreSQL: what is measured is
the reads, not the relay):
- `steps` MetricStep rows (one per step: loss, step_s, compute_s, samples_per_s reduced over 1,024
  ranks with their counts, min/mean/max and the ranks of the extremes; the user metric `acc` every
  step and `val_loss` every 100th in `extra`); a one-rank loss spike every 7,919 steps;
- per-rank MetricSample rows for the last `--window` steps (2,000: retention's full-resolution window)
  and every 100th step before it (retention's thinning), 1,024 ranks each.

New path (`new`): the series endpoint (GET /api/v1/jobs/<id>/series/ through Django's test Client,
logged in as the owner: URL routing, auth, access check, the query, JSON) for loss and step_s over
step, loss over time and the user metric acc, and the ranks endpoint (GET /api/v1/jobs/<id>/ranks/ for
step_s, the default 2,000-step window), `--repeat` calls each: p50 and p99 (ms). Goal: under 100 ms.

Old path (`old`): the per-rank series query charts used before issue 26 (job_series over every rank's
MetricSample rows: a GROUP BY over all of them, an AVG at the buckets' last steps; `old_job_series`
below, a copy of it), through the same endpoint, on jobs of 1,024 ranks x N full per-rank steps for N
in `--old-steps`, with the (job, step) index it used re-created for it (its best case). 102,400,000
per-rank rows cannot be generated here, so its figure at `steps` is EXTRAPOLATED: a least-squares line
through (rows, ms), evaluated at 1,024 x steps rows (`extrapolated_ms`), and `ratio_extrapolated` =
that / the new p50 for the same metric.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from series import say, setup_django  # noqa: E402  (the same Django setup, SQLite or a PostgreSQL it starts)

RANKS = 1024
THIN_EVERY = 100


def write_rows(table: str, cols: list[str], rows) -> int:
    """Rows straight into a table: COPY on PostgreSQL, executemany on SQLite, in batches."""
    from django.db import connection, transaction

    n, batch = 0, []

    def flush():
        with transaction.atomic(), connection.cursor() as cur:
            if connection.vendor == "postgresql":
                with cur.cursor.copy(f"COPY {table} ({', '.join(cols)}) FROM STDIN") as copy:
                    for r in batch:
                        copy.write_row(r)
            else:
                marks = ", ".join(["?"] * len(cols))
                cur.cursor.executemany(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({marks})", batch)

    for r in rows:
        batch.append(r)
        if len(batch) >= 50_000:
            flush()
            n += len(batch)
            batch = []
    if batch:
        flush()
        n += len(batch)
    return n


def new_job(name: str):
    from django.contrib.auth import get_user_model

    from jobs.models import Attempt, Job

    user, _ = get_user_model().objects.get_or_create(username="bench")
    job = Job.objects.create(name=name, owner=user, spec={"name": name}, plan={}, slots=RANKS)
    return job, Attempt.objects.create(job=job, number=1)


def loss_at(step: int, steps: int) -> float:
    return 4.0 - 3.0 * step / steps


def step_rows(job_id: int, attempt_id: int, steps: int, t0: float):
    """MetricStep rows as the rollup writes them for 1,024 ranks."""
    from jobs.models import MetricStep
    from jobs.models.telemetry import RANKED_FIELDS, REDUCED_FIELDS

    cols = [f.column for f in MetricStep._meta.concrete_fields if f.column != "id"]
    rnd = random.Random(1)
    filled = {"loss", "step_s", "compute_s", "samples_per_s"}

    def gen():
        for s in range(steps):
            mean = loss_at(s, steps)
            spike = 40.0 if s % 7919 == 0 else 0.0
            vals = {"loss": (mean - 0.3, mean, mean + 0.3 + spike), "step_s": (0.19, 0.2 + rnd.uniform(0, 0.01), 0.26),
                    "compute_s": (0.09, 0.1, 0.14), "samples_per_s": (30.0, 32.0, 34.0)}
            slow = 777 if s % 3 else rnd.randrange(RANKS)
            extra = {"acc": rnd.random()}
            if s % 100 == 0:
                extra["val_loss"] = mean + rnd.uniform(-0.1, 0.1)
            row = {"job_id": job_id, "attempt_id": attempt_id, "step": s, "ts": t0 + s * 0.2, "ranks": RANKS,
                   "extra": json.dumps(extra), "extra_rank": 0}
            for f in REDUCED_FIELDS:
                lo, mid, hi = vals.get(f, (None, None, None))
                row.update({f"{f}_n": RANKS if f in filled else 0, f"{f}_min": lo, f"{f}_mean": mid, f"{f}_max": hi})
            for f in RANKED_FIELDS:
                row[f"{f}_min_rank"] = 3 if s % 10 else rnd.randrange(RANKS)
                row[f"{f}_max_rank"] = slow
            yield tuple(row[c] for c in cols)

    return MetricStep._meta.db_table, cols, gen()


def sample_rows(job_id: int, attempt_id: int, steps, total_steps: int, t0: float):
    """Every rank's MetricSample row at each of `steps`."""
    from jobs.models import MetricSample

    cols = ["job_id", "attempt_id", "rank", "step", "ts", "loss", "step_s", "compute_s", "samples_per_s"]
    offset = [random.Random(r).uniform(-0.3, 0.3) for r in range(RANKS)]

    def gen():
        for s in steps:
            mean, ts = loss_at(s, total_steps), t0 + s * 0.2
            for r in range(RANKS):
                o = offset[r]
                yield (job_id, attempt_id, r, s, ts + r * 1e-5, mean + o, 0.2 + (0.06 if r == 777 else o / 30),
                       0.1 + o / 20, 32.0 + o)

    return MetricSample._meta.db_table, cols, gen()


def old_job_series(job_id: int, metric: str, *, x: str = "step", max_points: int = 1500, rank=None) -> dict:
    """The series query before issue 26 (jobs/telemetry/series.py at 333dbbb): every rank's samples."""
    from django.db.models import Avg, BigIntegerField, Count, ExpressionWrapper, F, Max, Min, Value
    from django.db.models.functions import Greatest, Least

    from jobs.models import MetricSample
    from jobs.telemetry.selectors import lineage_filter
    from jobs.telemetry.series import _FloorNonNegative, metric_value

    qs = MetricSample.objects.filter(job_id=job_id).filter(lineage_filter(job_id))
    if rank is not None:
        qs = qs.filter(rank=rank)
    qs = qs.annotate(v=metric_value(metric)).filter(v__isnull=False)
    first = qs.order_by("step").values_list("step", flat=True).first()
    if first is None:
        return {"buckets": [], "samples": 0, "first_ts": None}
    last = qs.order_by("-step").values_list("step", flat=True).first()
    ts = qs.filter(step__in=[first, last]).aggregate(lo=Min("ts"), hi=Max("ts"))
    if x == "step":
        bucket = ExpressionWrapper((F("step") - Value(first)) * Value(max_points) / Value(last - first + 1),
                                   output_field=BigIntegerField())
    else:
        width = (ts["hi"] - ts["lo"]) / max_points or 1.0
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


def calls(client, url: str, repeat: int) -> tuple[dict, dict]:
    times, body = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        r = client.get(url)
        times.append((time.perf_counter() - t) * 1000)
        assert r.status_code == 200, (url, r.status_code, r.content[:300])
        body = r.json()
    times.sort()
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    return {"p50_ms": round(statistics.median(times), 1), "p99_ms": round(p99, 1), "calls": repeat}, body


def fit(points: list[tuple[int, float]], at: int) -> float:
    """Least-squares line through (rows, ms), at `at` rows."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / (sum((x - mx) ** 2 for x in xs) or 1)
    return my + slope * (at - mx)


def generate(args, old_steps: list[int]):
    """The simulated job (per-step rows, per-rank rows as retention keeps them) and the old-path jobs
    (full per-rank rows): (job, per-step rows, per-rank rows, [(steps, rows, job)], seconds)."""
    from django.db import connection

    if connection.vendor == "sqlite":
        with connection.cursor() as cur:  # generation only: nothing here must survive a crash
            cur.execute("PRAGMA synchronous = OFF")
            cur.execute("PRAGMA journal_mode = MEMORY")
            cur.execute("PRAGMA cache_size = -400000")
    t0 = time.time() - args.steps
    started = time.monotonic()
    job, attempt = new_job("charts-bench")
    n_steps = write_rows(*step_rows(job.pk, attempt.pk, args.steps, t0))
    kept = [s for s in range(args.steps) if s >= args.steps - args.window or s % THIN_EVERY == 0]
    n_samples = write_rows(*sample_rows(job.pk, attempt.pk, kept, args.steps, t0))
    say(f"{n_steps} per-step rows and {n_samples} per-rank rows in {time.monotonic() - started:.0f} s")
    olds = []
    for n in old_steps:
        j, a = new_job(f"old-{n}")
        rows = write_rows(*sample_rows(j.pk, a.pk, range(n), n, t0))
        olds.append((n, rows, j))
    with connection.cursor() as cur:
        cur.execute("ANALYZE")
    generation_s = round(time.monotonic() - started, 1)
    say(f"generated in {generation_s} s")
    return job, n_steps, n_samples, olds, generation_s


def measure_new(client, job, repeat: int) -> dict[str, dict]:
    """p50/p99 of today's chart calls: the series (over step, time, a user metric) and the ranks view."""
    new: dict[str, dict] = {}
    for name, query in (("loss", "metric=loss"), ("step_s", "metric=step_s"),
                        ("loss_time", "metric=loss&x=time"), ("acc", "metric=acc")):
        say(f"new: series {query} ...")
        new[f"series_{name}"], body = calls(client, f"/api/v1/jobs/{job.pk}/series/?{query}&buckets=1500", repeat)
        new[f"series_{name}"]["buckets"] = len(body["buckets"])
        if name == "loss":
            new["series_loss"]["spikes_kept"] = sum(1 for b in body["buckets"] if b["max"] > 10)
    say("new: ranks step_s ...")
    new["ranks_step_s"], body = calls(client, f"/api/v1/jobs/{job.pk}/ranks/?metric=step_s", repeat)
    new["ranks_step_s"].update(band=len(body["band"]), slowest=[r["rank"] for r in body["slowest"]][:3],
                               slowest_mean=body["slowest"][0]["mean"])
    return new


def measure_old(client, olds, args, new: dict[str, dict]) -> dict[str, dict]:
    """The old per-rank series query at the old-path jobs' sizes, its growth, and its figure
    extrapolated (linearly in rows) to the simulated job's size."""
    from django.db import connection

    from jobs.models import MetricSample
    from jobs.telemetry import series

    table = MetricSample._meta.db_table
    with connection.cursor() as cur:
        # the index the old path read its bounds through (dropped by issue 26's migration), only
        # now: the new path must not find it (the ranks endpoint's per-rank means would use it)
        cur.execute(f"CREATE INDEX bench_metric_job_step ON {table} (job_id, step)")
        cur.execute("ANALYZE")
    old: dict[str, dict] = {}
    real = series.job_series
    series.job_series = old_job_series  # the endpoint as it was: the per-rank query
    try:
        for metric in ("loss", "step_s"):
            measured = []
            for n, rows, j in olds:
                say(f"old: series {metric} at {RANKS} x {n} ...")
                stats, _ = calls(client, f"/api/v1/jobs/{j.pk}/series/?metric={metric}&buckets=1500", args.old_repeat)
                measured.append({"steps": n, "rows": rows, **stats})
            at = RANKS * args.steps
            if len(measured) < 2:  # a line needs two sizes: the measured figure only
                old[f"series_{metric}"] = {"measured": measured, "note": "one size: give --old-steps two or more"}
                continue
            est = fit([(m["rows"], m["p50_ms"]) for m in measured], at)
            first, lastm = measured[0], measured[-1]
            old[f"series_{metric}"] = {
                "measured": measured,
                "growth": f"x{lastm['p50_ms'] / first['p50_ms']:.2f} from {first['steps']} to "
                          f"{lastm['steps']} steps (x{lastm['rows'] / first['rows']:.0f} rows)",
                "ms_per_million_rows": round((lastm["p50_ms"] - first["p50_ms"])
                                             / ((lastm["rows"] - first["rows"]) / 1e6), 1),
                "extrapolated_rows": at,
                "extrapolated_ms": round(est, 0),
                "ratio_extrapolated": round(est / new[f"series_{metric}"]["p50_ms"], 0),
                "note": f"EXTRAPOLATED to {args.steps} steps x {RANKS} ranks (linear in rows); not measured",
            }
    finally:
        series.job_series = real
    return old


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--window", type=int, default=2000)
    ap.add_argument("--old-steps", default="250,500,1000",
                    help="full per-rank steps of the old-path jobs (500,1000,2000 adds ~2 min of generation)")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--old-repeat", type=int, default=3)
    ap.add_argument("--postgres", action="store_true")
    args = ap.parse_args(argv)
    old_steps = [int(x) for x in args.old_steps.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="charts-bench-") as tmp:
        server = setup_django(Path(tmp), args.postgres)
        try:
            from django.conf import settings
            from django.db import connection
            from django.test import Client

            job, n_steps, n_samples, olds, generation_s = generate(args, old_steps)
            settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
            client = Client()
            client.force_login(job.owner)
            new = measure_new(client, job, args.repeat)
            old = measure_old(client, olds, args, new)
            print(json.dumps({
                "database": connection.vendor, "ranks": RANKS, "steps": args.steps, "per_step_rows": n_steps,
                "per_rank_rows": n_samples, "per_rank_window": args.window, "thinned_every": THIN_EVERY,
                "generation_s": generation_s, "goal_ms": 100, "new": new, "old": old,
                "goal_met": all(v["p50_ms"] < 100 for v in new.values()),
                "load_average": [round(x, 1) for x in os.getloadavg()], "cpus": os.cpu_count(),
            }, indent=1))
        finally:
            if server is not None:
                from django.db import connections

                connections.close_all()
                server.stop()


if __name__ == "__main__":
    main()
