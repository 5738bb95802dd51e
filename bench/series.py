"""Bucketed series (jobs/telemetry/series.py) against loading every sample, side by side, on one job of
1,000,000 samples (2 ranks x 500,000 steps; `loss` every sample, the user metric `acc` every sample,
`val_loss` every 50th step on rank 0). Prints one JSON object.

    python bench/series.py                      # SQLite, 1M samples (~2 min on 2 shared cores)
    python bench/series.py --samples 200000     # quicker
    python bench/series.py --postgres           # the same on a PostgreSQL server it starts (tests/postgres.py)

A fresh database in a temporary directory, migrated by Django; the job and its attempt as ORM rows;
the samples written with the relay's own statements (jobs/telemetry/rollup.py: staged by executemany,
inserted into MetricSample and reduced into the per-step rows, MetricStep), batch by batch. For each case:
`bucketed_ms` (job_series: the buckets computed in the database from the per-step rows, 1,500 points)
and `load_all_ms` (every per-rank sample of the job's lineage read into Python and bucketed there the
same way), the median of
`--repeat` runs each, and `ratio` = load_all / bucketed. Also the metric-names query's time.
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


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def setup_django(workdir: Path, postgres: bool):
    os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
    os.environ["TRAINYARD_VAR_DIR"] = str(workdir / "var")
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")
    server = None
    if postgres:
        from tests.postgres import PostgresServer

        server = PostgresServer().start()  # its own directory: under root the server runs as nobody
        os.environ["DATABASE_URL"] = server.create_database("bench")
    else:
        os.environ["DATABASE_URL"] = ""
        os.environ["TRAINYARD_DB"] = str(workdir / "db.sqlite3")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return server


def fill(n: int) -> int:
    from django.contrib.auth import get_user_model
    from django.db import connection, transaction

    from jobs.models import Attempt, Job

    user = get_user_model().objects.create_user("bench")
    job = Job.objects.create(name="series-bench", owner=user, spec={"name": "series-bench"}, plan={}, slots=2)
    attempt = Attempt.objects.create(job=job, number=1)
    from jobs.telemetry import rollup

    # the relay's own statements (jobs/telemetry/rollup.py): each batch staged, inserted into
    # MetricSample and reduced into MetricStep (issue 26: what series read), in one transaction
    sql = rollup.ingest_sql(connection.vendor)
    at = {c: i for i, c in enumerate(rollup.STAGE_COLUMNS)}
    marks = ", ".join(["%s"] * len(rollup.STAGE_COLUMNS))
    rnd = random.Random(0)
    t0 = time.time() - n
    batch = []
    steps = n // 2
    started = time.monotonic()

    def flush():
        with transaction.atomic(), connection.cursor() as cur:
            for ddl in rollup.stage_ddl(connection.vendor):
                cur.execute(ddl)
            cur.executemany(f"INSERT INTO {rollup.STAGE} VALUES ({marks})", batch)
            for statement in sql:
                cur.execute(statement)

    for step in range(steps):
        for rank in (0, 1):
            extra = {"acc": rnd.random()}
            if rank == 0 and step % 50 == 0:
                extra["val_loss"] = 3.0 - step / steps + rnd.uniform(-0.1, 0.1)
            row = [None] * len(rollup.STAGE_COLUMNS)
            row[at["job_id"]], row[at["attempt_id"]], row[at["rank"]], row[at["step"]] = job.pk, attempt.pk, rank, step
            row[at["ts"]] = t0 + step * 2 + rank * 0.01
            row[at["loss"]] = 4.0 - step / steps + rnd.uniform(-0.5, 0.5)
            row[at["extra"]] = json.dumps(extra)
            batch.append(tuple(row))
        if len(batch) >= 20000 or step == steps - 1:
            flush()
            batch = []
    with connection.cursor() as cur:
        cur.execute("ANALYZE")
    say(f"inserted {2 * steps} samples (and reduced them per step) in {time.monotonic() - started:.1f} s")
    return job.pk


def load_all(job_id: int, metric: str, x: str, max_points: int) -> list[dict]:
    """The naive way: every sample along the lineage into Python, then the same buckets."""
    import math

    from django.db.models import Max

    from jobs.models import MetricSample
    from jobs.telemetry.selectors import lineage_filter

    qs = MetricSample.objects.filter(job_id=job_id).filter(lineage_filter(job_id))
    # a step's ts is its latest rank's; a user metric is the lowest rank's that logged any (issue 26)
    step_ts = dict(qs.values("step").order_by("step").annotate(t=Max("ts")).values_list("step", "t"))
    if metric == "loss":
        pts = [(s, step_ts[s], v) for s, v in qs.values_list("step", "loss") if v is not None]
    else:
        pts, seen = [], set()
        for s, e in qs.order_by("step", "rank").values_list("step", "extra"):
            if e and s not in seen:
                seen.add(s)
                if metric in e:
                    pts.append((s, step_ts[s], e[metric]))
    if not pts:
        return []
    i = 0 if x == "step" else 1
    lo, hi = min(p[i] for p in pts), max(p[i] for p in pts)
    if x == "step":
        span = hi - lo + 1
        key = lambda p: (p[0] - lo) * max_points // span  # noqa: E731
    else:
        width = (hi - lo) / max_points or 1.0
        key = lambda p: min(math.floor((p[1] - lo) / width), max_points - 1)  # noqa: E731
    groups: dict[int, list] = {}
    for p in pts:
        groups.setdefault(key(p), []).append(p)
    by_step: dict[int, list[float]] = {}
    for p in pts:
        by_step.setdefault(p[0], []).append(p[2])
    out = []
    for b in sorted(groups):
        g = groups[b]
        last = max(p[0] for p in g)
        out.append({"x": last if x == "step" else max(p[1] for p in g), "min": min(p[2] for p in g),
                    "max": max(p[2] for p in g), "last": sum(by_step[last]) / len(by_step[last])})
    return out


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--points", type=int, default=1500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--postgres", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="series-bench-") as tmp:
        server = setup_django(Path(tmp), args.postgres)
        try:
            from django.db import connection

            from jobs.telemetry import series

            job_id = fill(args.samples)
            cases = []
            for metric, x in (("loss", "step"), ("loss", "time"), ("acc", "step"), ("val_loss", "step")):
                say(f"{metric} over {x} ...")
                b_ms, got = timed(lambda m=metric, a=x: series.job_series(job_id, m, x=a, max_points=args.points),
                                  args.repeat)
                a_ms, want = timed(lambda m=metric, a=x: load_all(job_id, m, a, args.points), args.repeat)
                agree = len(got["buckets"]) == len(want) and all(
                    abs(g["last"] - w["last"]) < 1e-9 and g["min"] == w["min"] and g["max"] == w["max"]
                    for g, w in zip(got["buckets"], want))
                cases.append({"metric": metric, "x": x, "samples": got["samples"], "buckets": len(got["buckets"]),
                              "bucketed_ms": round(b_ms, 1), "load_all_ms": round(a_ms, 1),
                              "ratio": round(a_ms / b_ms, 1), "same_buckets": agree})
            names_ms, names = timed(lambda: series.job_metric_names([job_id]), args.repeat)
            print(json.dumps({"database": connection.vendor, "samples": args.samples, "points": args.points,
                              "repeat": args.repeat, "cases": cases,
                              "metric_names_ms": round(names_ms, 1), "metric_names": names[job_id]}, indent=1))
        finally:
            if server is not None:
                from django.db import connections

                connections.close_all()
                server.stop()


if __name__ == "__main__":
    main()
