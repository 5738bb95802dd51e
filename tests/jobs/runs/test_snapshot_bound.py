"""Issue 15: a job socket's snapshot costs the same whatever the job's length. The window is
downsampled in the database; Python never holds the whole history (before: 200,000 samples cost
183 MB and ~9 s per connect). Since issue 26 the snapshot is bucketed reduced steps (MetricStep) and
the named ranks' recent samples; metric_window (the old per-rank window) is kept for bench/ws_snapshot.py."""
from __future__ import annotations

import time
import tracemalloc

import pytest
from django.db import connection

from jobs.runs import payloads as runs_payloads
from jobs.telemetry import payloads as telemetry_payloads
from jobs import services
from jobs.models import MetricSample
from tests.jobs.telemetry.test_reduced import write_steps

pytestmark = pytest.mark.django_db

STEPS, RANKS = 30_000, 2


@pytest.fixture
def long_job(user, nodes):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "long", "train": {"steps": STEPS}}))
    services.schedule_tick()
    attempt = job.attempts.get()
    # every 3rd step reported (an uneven stride must thin out evenly too), then the last one
    steps = [*range(0, 3 * STEPS, 3)]
    # one executemany, not bulk_create: 60,000 model instances would cost ~12 s of setup
    table = MetricSample._meta.db_table
    with connection.cursor() as cur:
        cur.executemany(f"INSERT INTO {table} (job_id, attempt_id, rank, step, ts, loss, step_s) "
                        f"VALUES (%s, %s, %s, %s, %s, %s, %s)",
                        [(job.pk, attempt.pk, r, s, 1.0 + s, 1.0 / (1 + s), 0.1) for s in steps for r in range(RANKS)])
    write_steps(job, attempt, steps, ranks=RANKS)  # their rollup, as the relay writes it
    return job, steps


def test_the_snapshot_is_bounded_in_rows_queries_and_memory(long_job, django_assert_max_num_queries):
    job, steps = long_job
    with django_assert_max_num_queries(3):  # the lineage's attempts, the count, the picked rows
        telemetry_payloads.metric_window(job.pk, max_points=4000)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        snap = runs_payloads.job_snapshot(job.pk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    elapsed = time.monotonic() - t0
    print(f"job_snapshot: peak {peak / 1e6:.1f} MB, {elapsed:.2f} s")
    rows, samples = snap["steps"], snap["samples"]
    assert peak < 12_000_000, f"{peak / 1e6:.1f} MB held for {STEPS * RANKS} samples"
    assert elapsed < 5, elapsed
    assert snap["bucketed"] and snap["downsampled"] and 750 <= len(rows) <= 1500, len(rows)
    assert rows[0]["first"] == 0 and rows[-1]["step"] == steps[-1]  # the first and the newest step
    assert snap["total_steps"] == STEPS
    # a small job names every rank: their samples over the most recent steps, every rank at each step
    assert snap["named"]["all"] and len(samples) == RANKS * 500
    assert {s["step"] for s in samples} == set(steps[-500:])
    assert set(samples[0]) >= {"rank", "step", "ts", "loss", "step_s", "attempt", "metrics"}


def test_a_catch_up_window_is_bounded_too(long_job):
    job, steps = long_job
    from_step = steps[len(steps) // 2]
    window, downsampled = telemetry_payloads.metric_window(job.pk, from_step=from_step, max_points=1000)
    assert downsampled and 500 <= len(window) <= 1000
    assert min(s["step"] for s in window) == from_step and max(s["step"] for s in window) == steps[-1]


def test_a_short_job_is_sent_whole(user, nodes):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "short"}))
    services.schedule_tick()
    attempt = job.attempts.get()
    MetricSample.objects.bulk_create(MetricSample(job=job, attempt=attempt, rank=r, step=s, ts=1.0)
                                     for s in range(100) for r in range(2))
    window, downsampled = telemetry_payloads.metric_window(job.pk, max_points=4000)
    assert not downsampled and len(window) == 200
