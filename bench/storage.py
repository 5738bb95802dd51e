"""Telemetry storage per job, before and after issue 26 (the per-step rollup + retention), on a simulated
1,024-rank, 100,000-step job. Prints one JSON object; stops by itself (~5 min on SQLite, 2 shared cores).

    python bench/storage.py                # SQLite (a fresh, migrated database in a temporary directory)
    python bench/storage.py --postgres     # the same on a PostgreSQL server it starts (tests/postgres.py)
    python bench/storage.py --quick        # smaller samples, for a smoke run (~1 min)

- before (today's path until issue 26: every per-rank MetricSample row kept, with the old schema's
  (job, step) index, created here): 102.4M rows cannot be written in minutes, so `--sample-steps` steps
  (1,000) of all 1,024 ranks are written, their bytes on disk per row measured and the job's total
  EXTRAPOLATED to 100,000 steps (labelled `extrapolated`).
- after: the job as the relay writes it and retention leaves it: 100,000 MetricStep rows, and the per-rank
  rows of the steps retention keeps at the site defaults (the 2,000-step window, the thinned grid, and
  the neighbourhoods of the job's events). Only those per-rank rows are WRITTEN (not 102.4M written and
  purged); the set of kept steps is the purge's own rule (jobs.telemetry.retention.kept_steps_rule over
  the events stored for the job).
- demo: that the real purge leaves exactly that set, at a smaller scale: `--demo-ranks` x `--demo-steps`
  (64 x 20,000) written through jobs.telemetry.ingest.telemetry_ingest in relay-sized rounds, with events,
  then telemetry_purge(); every rank's stored steps are compared with kept_steps_rule's. Meanwhile a
  second job's relay rounds (64 samples each) run in a process of their own (as the relay does): their
  latency during the purge next to without it, and the purge's batches (count, longest).

Rows are generated step-major (each step, every rank), as the relay's rounds write them, with the fields
the built-in trainer reports. Bytes on disk: SQLite, the pages of each table's and index's b-tree (the
dbstat table: pages x page size, free space inside pages included), and the file's used pages
(page_count - freelist_count) x page_size; the demo's database is also VACUUMed after the purge (this
bench only) and its file measured. PostgreSQL: pg_total_relation_size (heap + indexes + TOAST) after
VACUUM (ANALYZE), and for the demo after the purge before and after VACUUM FULL.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from storage_db import (SAMPLE_COLS, clear, sample_rows, settle, sizes, step_columns,  # noqa: E402  (bench/ is sys.path[0])
                        step_rows, write)

GB = 1e9
OLD_INDEX = "bench_metric_job_step_old_idx"
# the simulated job's events (kind, data): two restarts, a rollback, stragglers flagged now and then
EVENTS_100K = ([("restart", {"resume_step": 25_000}), ("resumed", {"step": 25_000}),
                ("restart", {"resume_step": 61_000}), ("resumed", {"step": 61_000}),
                ("rollback", {"step": 80_000}), ("continued", {"step": 80_000})]
               + [("straggler", {"since_step": s, "rank": 17 * i}) for i, s in
                  enumerate((4_200, 9_900, 33_333, 47_000, 52_500, 70_100, 88_800, 93_000))])


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def scaled_events(steps: int) -> list[tuple[str, dict]]:
    out = []
    for kind, data in EVENTS_100K:
        key = next(iter(k for k in data if "step" in k))
        out.append((kind, {**data, key: data[key] * steps // 100_000}))
    return out


def setup_django(workdir: Path, postgres: bool):
    os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
    os.environ["TRAINYARD_VAR_DIR"] = str(workdir / "var")
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")
    server = None
    if postgres:
        from tests.postgres import PostgresServer

        server = PostgresServer().start()
        os.environ["DATABASE_URL"] = server.create_database("bench")
    else:
        os.environ["DATABASE_URL"] = ""
        os.environ["TRAINYARD_DB"] = str(workdir / "db.sqlite3")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return server


def new_job(name: str, top: int, ranks: int):
    from django.contrib.auth import get_user_model

    from jobs.models import Attempt, Job

    user = get_user_model().objects.get_or_create(username="bench")[0]
    job = Job.objects.create(name=name, owner=user, spec={"name": name}, plan={}, slots=ranks, step=top,
                             status=Job.Status.RUNNING)
    return job, Attempt.objects.create(job=job, number=1, status="RUNNING")


# --- the cases -----------------------------------------------------------------------------------

def before(ranks: int, steps: int, sample_steps: int) -> dict:
    from django.db import connection

    from jobs.models import MetricSample

    table = MetricSample._meta.db_table
    with connection.cursor() as cur:  # the index issue 26 dropped: every per-rank row was in it too
        cur.execute(f"CREATE INDEX {OLD_INDEX} ON {table} (job_id, step)")
    job, attempt = new_job("before", sample_steps, ranks)
    t0 = time.monotonic()
    n = write(table, SAMPLE_COLS, sample_rows(job.pk, attempt.pk, ranks, range(1, sample_steps + 1),
                                              random.Random(1)))
    settle()
    took = time.monotonic() - t0
    measured = sizes()["metric_sample"]
    per_row = measured["bytes"] / n
    total_rows = ranks * steps
    with connection.cursor() as cur:
        cur.execute(f"DROP INDEX {OLD_INDEX}")
    say(f"before: {n} rows, {measured['bytes'] / 1e6:.1f} MB, {per_row:.1f} B/row ({took:.0f} s)")
    return {
        "what": "every per-rank MetricSample row kept, indexes unique(attempt, rank, step), (job, rank, step) and "
                "the old (job, step); no MetricStep",
        "rows_measured": n, "ranks": ranks, "steps_measured": sample_steps, "bytes_measured": measured["bytes"],
        "bytes_measured_parts": measured["parts"], "bytes_per_row": round(per_row, 1),
        "extrapolated": True, "rows": total_rows, "bytes": round(per_row * total_rows),
        "bytes_per_step": round(per_row * ranks), "gb": round(per_row * total_rows / GB, 2),
        "write_s": round(took, 1),
    }


def kept_steps(job_id: int, top: int) -> tuple[list[int], dict]:
    from jobs.telemetry import retention

    policy = retention.effective(retention.site_row())
    marks = retention.neighbourhoods(retention.event_steps(job_id))
    kept = retention.kept_steps_rule(top, policy, marks)
    steps = [s for s in range(1, top + 1) if kept(s)]
    window = top - policy.rank_window_steps
    k = retention.thinning_stride(top, policy.rank_window_steps, policy.rank_sampled_per_rank)
    grid = [s for s in steps if s <= window and k and s % k == 0]
    return steps, {"window": sum(1 for s in steps if s > window), "grid": len(grid), "stride": k,
                   "event_neighbourhoods_only": len(steps) - len(grid) - sum(1 for s in steps if s > window),
                   "total": len(steps), "neighbourhoods": marks}


def add_events(job, attempt, events) -> None:
    from jobs.models import JobEvent

    for kind, data in events:
        JobEvent.objects.create(job=job, attempt=attempt, kind=kind, data=data, message=kind)


def after(ranks: int, steps: int) -> dict:
    from jobs.models import MetricSample, MetricStep
    from jobs.telemetry import retention

    job, attempt = new_job("after", steps, ranks)
    add_events(job, attempt, scaled_events(steps))
    keep, counts = kept_steps(job.pk, steps)
    t0 = time.monotonic()
    n_steps = write(MetricStep._meta.db_table, step_columns(),
                    step_rows(job.pk, attempt.pk, ranks, range(1, steps + 1), random.Random(2)))
    n_rank = write(MetricSample._meta.db_table, SAMPLE_COLS,
                   sample_rows(job.pk, attempt.pk, ranks, keep, random.Random(3)))
    settle()
    took = time.monotonic() - t0
    s = sizes()
    total = s["metric_sample"]["bytes"] + s["metric_step"]["bytes"]
    say(f"after: {n_steps} MetricStep rows {s['metric_step']['bytes'] / 1e6:.1f} MB, {n_rank} per-rank rows "
        f"{s['metric_sample']['bytes'] / 1e6:.1f} MB ({took:.0f} s)")
    return {
        "what": "MetricStep for every step + the per-rank rows retention keeps at the site defaults "
                f"(window {retention.DEFAULTS['rank_window_steps']}, about {retention.DEFAULTS['rank_sampled_per_rank']}"
                f" thinned steps per rank, +-{retention.EVENT_NEIGHBOURHOOD_STEPS} steps around each event)",
        "written": "only the per-rank rows of the kept steps (not 102.4M written then purged: see demo)",
        "events": [f"{k} {d}" for k, d in scaled_events(steps)],
        "kept_steps_per_rank": counts,
        "metric_step_rows": n_steps, "metric_step_bytes": s["metric_step"]["bytes"],
        "metric_step_bytes_per_row": round(s["metric_step"]["bytes"] / n_steps, 1),
        "metric_step_parts": s["metric_step"]["parts"],
        "rank_rows": n_rank, "rank_bytes": s["metric_sample"]["bytes"],
        "rank_bytes_per_row": round(s["metric_sample"]["bytes"] / n_rank, 1),
        "rank_parts": s["metric_sample"]["parts"],
        "bytes": total, "bytes_per_step": round(total / steps), "gb": round(total / GB, 3),
        "database": {k: v for k, v in s.items() if k.startswith("database")},
        "write_s": round(took, 1),
    }


def ingest_job(ranks: int, steps: int):
    """A job of `ranks` x `steps` samples written through telemetry_ingest in rounds of ~1,024 samples."""
    from jobs.telemetry import ingest

    job, attempt = new_job("demo", 0, ranks)
    add_events(job, attempt, scaled_events(steps))
    cols = ("rank", "step", "ts", "loss", "samples_per_s", "tokens_per_s", "step_s", "data_s", "compute_s",
            "comm_s", "optim_s", "bytes_sent", "mem_bytes")
    per_round = max(1, 1024 // ranks) * ranks
    batch = []
    for row in sample_rows(job.pk, attempt.pk, ranks, range(1, steps + 1), random.Random(4)):
        batch.append({"attempt": attempt.pk, **dict(zip(cols, row[2:15]))})
        if len(batch) >= per_round:
            ingest.telemetry_ingest(batch, events=[])
            batch = []
    if batch:
        ingest.telemetry_ingest(batch, events=[])
    return job, per_round


class RelayRounds:
    """A second job's relay rounds (64 samples each, every 10 ms) in a process of their own, as the relay is
    (a thread here would share this process's GIL with the purge): each round's seconds."""

    def __init__(self):
        self.job, self.attempt = new_job("relay", 0, 64)
        self.step = 0

    def run(self, during) -> tuple[list[float], object]:
        import subprocess

        with tempfile.TemporaryDirectory() as tmp:
            ready, stop = Path(tmp) / "ready", Path(tmp) / "stop"
            child = subprocess.Popen([sys.executable, __file__, "--relay-rounds", str(self.attempt.pk),
                                      str(self.step), str(ready), str(stop)], stdout=subprocess.PIPE, text=True)
            try:
                while not ready.exists() and child.poll() is None:
                    time.sleep(0.05)
                result = during()
            finally:
                stop.touch()
                out, _ = child.communicate(timeout=120)
        rounds = json.loads(out.strip().splitlines()[-1])
        self.step += len(rounds)
        return rounds, result

    @staticmethod
    def summary(rounds: list[float]) -> dict:
        xs = sorted(rounds)

        def pct(q):
            return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else None
        return {"rounds": len(xs), "p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)}


def relay_rounds_child(attempt_id: int, step: int, ready: str, stop: str) -> None:
    """The child of RelayRounds.run (the parent's environment names the database): rounds until `stop`
    exists, then their seconds as one JSON line."""
    import django

    django.setup()
    from jobs.telemetry import ingest

    rounds: list[float] = []
    Path(ready).touch()
    while not os.path.exists(stop):
        step += 1
        t = time.monotonic()
        ingest.telemetry_ingest([{"attempt": attempt_id, "rank": r, "step": step, "ts": 1.0, "loss": 1.0,
                                  "step_s": 0.3} for r in range(64)], events=[])
        rounds.append(time.monotonic() - t)
        time.sleep(0.01)
    print(json.dumps(rounds))


def demo_sizes(before_sizes: dict) -> tuple[dict, str]:
    from django.db import connection

    from jobs.models import MetricSample

    out = {"before_purge": before_sizes, "after_purge": sizes()}
    with connection.cursor() as cur:
        if connection.vendor == "sqlite":
            cur.execute("VACUUM")
            out["after_vacuum"] = sizes()
            return out, ("after_purge: b-tree pages and used pages before VACUUM (freed pages on the freelist); "
                         "after_vacuum: after VACUUM (this bench only; the service never VACUUMs)")
        cur.execute(f"VACUUM FULL {MetricSample._meta.db_table}")
    out["after_vacuum_full"] = sizes()
    return out, ("after_purge: before any VACUUM (dead tuples' space stays in the files until autovacuum reuses "
                 "it); after_vacuum_full: rewritten (this bench only)")


def demo(ranks: int, steps: int) -> dict:
    """The real path at a smaller scale: telemetry_ingest, then telemetry_purge while a relay's rounds go on;
    the purge must leave exactly kept_steps_rule's steps for every rank."""
    from django.core.cache import cache

    from jobs.models import MetricSample, MetricStep
    from jobs.telemetry import retention

    t0 = time.monotonic()
    job, per_round = ingest_job(ranks, steps)
    ingest_s = time.monotonic() - t0
    written = MetricSample.objects.filter(job=job).count()
    say(f"demo: {written} samples through telemetry_ingest in {ingest_s:.0f} s")
    before_sizes = sizes()
    relay = RelayRounds()
    alone, _ = relay.run(lambda: time.sleep(3))
    t0 = time.monotonic()
    during, result = relay.run(lambda: retention.telemetry_purge(budget_s=float("inf")))
    purge_s = time.monotonic() - t0
    job.refresh_from_db()
    keep, counts = kept_steps(job.pk, job.step)
    got: dict[int, set[int]] = {}
    for rank, step in MetricSample.objects.filter(job=job).values_list("rank", "step").iterator(chunk_size=20000):
        got.setdefault(rank, set()).add(step)
    exact = sorted(got) == list(range(ranks)) and all(got[r] == set(keep) for r in range(ranks))
    again = retention.telemetry_purge(budget_s=float("inf"))  # the watermark: nothing to scan
    cache.clear()
    full = retention.telemetry_purge(budget_s=float("inf"))  # no watermark: a full pass finds nothing either
    say(f"demo: purge removed {result.rank_rows_thinned} rows in {purge_s:.1f} s, exact={exact}")
    out_sizes, size_note = demo_sizes(before_sizes)
    counts.pop("neighbourhoods")
    return {
        "what": f"{ranks} ranks x {steps} steps through telemetry_ingest (rounds of ~{per_round} samples), "
                "then telemetry_purge at the site defaults",
        "events": [f"{k} {d}" for k, d in scaled_events(steps)],
        "samples_written": written, "ingest_s": round(ingest_s, 1),
        "rows_after_purge": sum(len(v) for v in got.values()), "rows_removed": result.rank_rows_thinned,
        "kept_steps_per_rank": counts, "exactly_the_rule_for_every_rank": exact,
        "metric_step_rows": MetricStep.objects.filter(job=job).count(),
        "purge_s": round(purge_s, 2), "purge_rows_per_s": round(result.rank_rows_thinned / purge_s),
        "batches": result.batches, "batch_rows_max": retention.BATCH_ROWS,
        "max_batch_ms": round(result.max_batch_s * 1000, 1),
        "second_purge": {"rows_removed": again.rank_rows_thinned, "s": again.seconds},
        "full_pass_without_watermark": {"rows_removed": full.rank_rows_thinned, "s": full.seconds},
        "relay_round_ms": {"alone": relay.summary(alone), "during_purge": relay.summary(during)},
        "sizes": out_sizes, "sizes_note": size_note,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--postgres", action="store_true")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--sample-steps", type=int, default=1000, help="steps of the 'before' sample")
    ap.add_argument("--demo-ranks", type=int, default=64)
    ap.add_argument("--demo-steps", type=int, default=20_000)
    ap.add_argument("--quick", action="store_true", help="smaller: 256 ranks, 200 before steps, 16 x 8,000 demo")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.sample_steps, args.demo_ranks, args.demo_steps = 256, 200, 16, 8000
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trainyard-storage-") as tmp:
        server = setup_django(Path(tmp), args.postgres)
        try:
            from django.db import connection

            from jobs.telemetry import retention

            retention.site_row()  # the defaults
            out = {"database": connection.vendor, "job": {"ranks": args.ranks, "steps": args.steps}}
            if server is not None:
                out["server"] = str(server.bin)
                out["settings"] = "tests/postgres.py's server (fsync off): sizes, not write speed"
            out["demo"] = demo(args.demo_ranks, args.demo_steps)
            clear()
            b = before(args.ranks, args.steps, args.sample_steps)
            clear()
            a = after(args.ranks, args.steps)
            out["before"], out["after"] = b, a
            out["before_over_after"] = round(b["bytes"] / a["bytes"], 1)
            out["goal_whole_job_under_2gb"] = a["bytes"] < 2 * GB
            out["side_by_side"] = {"before_gb_extrapolated": b["gb"], "after_gb": a["gb"],
                                   "before_bytes_per_step": b["bytes_per_step"], "after_bytes_per_step": a["bytes_per_step"],
                                   "ratio": out["before_over_after"]}
            out["sizes_method"] = ("SQLite: dbstat b-tree pages x page size per table and index (free space inside "
                                   "pages counted; no VACUUM: before/after were only appended to)" if connection.vendor
                                   == "sqlite" else "PostgreSQL: pg_total_relation_size after VACUUM ANALYZE")
            out["seconds"] = round(time.monotonic() - started, 1)
            print(json.dumps(out, indent=1, default=str))
        finally:
            from django.db import connections

            connections.close_all()
            if server is not None:
                server.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--relay-rounds"]:
        relay_rounds_child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        main()
