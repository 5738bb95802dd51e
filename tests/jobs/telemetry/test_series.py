"""Bucketed series (jobs/telemetry/series.py) and their API (jobs/telemetry/api_series.py): at most
max_points buckets {x, min, max, last}, checked against a plain-Python reading of the same definition
over samples stored through the relay's ingest; visibility, 400s and the job cap of the API.

Runs on SQLite here and on PostgreSQL with `-p tests.postgres --postgres` (make test-postgres)."""
from __future__ import annotations

import math
import random

import pytest

from jobs import services
from jobs.models import Job, MetricSample
from jobs.telemetry import api_series, series

pytestmark = pytest.mark.django_db

T0 = 1764471234.0


def submit(user, name="x"):
    """A one-slot job started on the test nodes (4 slots: up to four at once)."""
    spec = {"name": name, "resources": {"nodes": 1, "procs_per_node": 1}, "parallel": {"dp": 1}}
    job = services.job_submit(user=user, spec=services.submitted_spec(spec))
    services.schedule_tick()
    return job


def store(job, rows):
    """rows: [(rank, step, ts, loss, metrics)] stored the relay's way (telemetry_ingest)."""
    attempt = job.attempts.order_by("-number").first()
    batch = [{"attempt": attempt.pk, "rank": r, "step": s, "ts": ts, "loss": loss,
              **({"metrics": m} if m else {})} for r, s, ts, loss, m in rows]
    for i in range(0, len(batch), 2000):
        services.telemetry_ingest(batch[i:i + 2000], events=[])


def per_step(rows, metric):
    """The definition of a per-step row (what the relay's rollup writes into MetricStep), in Python:
    [(step, ts, min, max, mean, count)] for the steps with the metric. ts: the step's latest rank's;
    a standard field over every rank reporting it; a user metric: the value of the lowest rank that
    logged any user metric at that step."""
    by_step: dict[int, list] = {}
    for rank, step, ts, loss, m in rows:
        by_step.setdefault(step, []).append((rank, ts, loss, m))
    out = []
    for step in sorted(by_step):
        g = by_step[step]
        ts = max(r[1] for r in g)
        if metric == "loss":
            vals = [float(r[2]) for r in g if r[2] is not None]
        else:
            logged = sorted((r for r in g if r[3]), key=lambda r: r[0])
            vals = [float(logged[0][3][metric])] if logged and metric in logged[0][3] else []
        if vals:
            out.append((step, ts, min(vals), max(vals), sum(vals) / len(vals), len(vals)))
    return out


def reference(rows, metric, x, max_points):
    """The definition, in Python, over the per-step rows: buckets of whole steps or equal time spans."""
    pts = per_step(rows, metric)
    if not pts:
        return []
    if x == "step":
        lo, hi = min(p[0] for p in pts), max(p[0] for p in pts)
        key = lambda p: (p[0] - lo) * max_points // (hi - lo + 1)  # noqa: E731
    else:
        lo, hi = min(p[1] for p in pts), max(p[1] for p in pts)
        width = (hi - lo) / max_points or 1.0
        key = lambda p: min(math.floor((p[1] - lo) / width), max_points - 1)  # noqa: E731
    groups: dict[int, list] = {}
    for p in pts:
        groups.setdefault(key(p), []).append(p)
    out = []
    for b in sorted(groups):
        g = groups[b]
        last = max(g, key=lambda p: p[0])
        out.append({"x": last[0] if x == "step" else max(p[1] for p in g), "min": min(p[2] for p in g),
                    "max": max(p[3] for p in g), "last": last[4]})
    return out


def reference_rank(rows, metric, x, max_points, rank):
    """One rank's own samples (the drill-down): each step's row is that rank's sample."""
    return reference([r for r in rows if r[0] == rank], metric, x, max_points)


def same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["x"] == pytest.approx(w["x"]) and g["min"] == pytest.approx(w["min"])
        assert g["max"] == pytest.approx(w["max"]) and g["last"] == pytest.approx(w["last"])


@pytest.fixture
def noisy(user, nodes):
    """A 2-rank job: loss every step (3,000 steps, uneven time between them), val_loss every 25th
    step on rank 0 only, grad/norm on both ranks."""
    job = submit(user, "noisy")
    rnd = random.Random(7)
    rows, ts = [], T0
    for step in range(1, 3001):
        ts += rnd.choice([0.05, 0.1, 0.4])
        for rank in (0, 1):
            metrics = {"grad/norm": rnd.uniform(0, 5)}
            if rank == 0 and step % 25 == 0:
                metrics["val_loss"] = 3.0 - step / 2000 + rnd.uniform(-0.1, 0.1)
            rows.append((rank, step, ts + rank * 0.001, 4.0 - step / 1000 + rnd.uniform(-0.5, 0.5), metrics))
    store(job, rows)
    return job, rows


@pytest.mark.parametrize("metric", ["loss", "val_loss", "grad/norm"])
@pytest.mark.parametrize("x", ["step", "time"])
@pytest.mark.parametrize("points", [1, 7, 100, 1500])
def test_buckets_match_the_definition(noisy, metric, x, points):
    job, rows = noisy
    got = series.job_series(job.pk, metric, x=x, max_points=points)
    want = reference(rows, metric, x, points)
    assert 0 < len(got["buckets"]) <= points
    same(got["buckets"], want)
    steps = per_step(rows, metric)
    assert got["samples"] == sum(p[5] for p in steps)
    assert got["first_ts"] == pytest.approx(steps[0][1])


def test_a_short_series_is_exact_one_bucket_per_step(user, nodes):
    job = submit(user)
    rows = [(r, s, T0 + s, float(10 * s + r), {"acc": s / 10}) for s in range(5) for r in (0, 1)]
    store(job, rows)
    got = series.job_series(job.pk, "loss")["buckets"]
    assert got == [{"x": s, "min": 10.0 * s, "max": 10.0 * s + 1, "last": 10.0 * s + 0.5} for s in range(5)]
    acc = series.job_series(job.pk, "acc", x="time")["buckets"]
    assert [b["last"] for b in acc] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert [b["x"] for b in acc] == pytest.approx([T0 + s for s in range(5)])


def test_known_step_buckets_min_max_last(user, nodes):
    """Steps 0..99 of one rank, loss = step, 10 buckets: each holds 10 steps."""
    job = submit(user)
    store(job, [(0, s, T0 + s, float(s), None) for s in range(100)])
    got = series.job_series(job.pk, "loss", max_points=10)["buckets"]
    assert got == [{"x": 10 * k + 9, "min": 10.0 * k, "max": 10.0 * k + 9, "last": 10.0 * k + 9} for k in range(10)]


def test_rank_filter_unknown_metric_and_no_samples(noisy, user, nodes):
    job, rows = noisy
    only1 = series.job_series(job.pk, "loss", max_points=50, rank=1)
    same(only1["buckets"], reference([r for r in rows if r[0] == 1], "loss", "step", 50))
    assert series.job_series(job.pk, "val_loss", rank=1)["buckets"] == []
    assert series.job_series(job.pk, "no_such")["buckets"] == []
    assert series.job_series(submit(user, "empty").pk, "loss") == {"buckets": [], "samples": 0, "first_ts": None}


def test_a_user_metric_named_with_double_underscores_is_one_key(user, nodes):
    job = submit(user)
    store(job, [(0, s, T0 + s, None, {"a__b": float(s), "a": float(-s)}) for s in range(10)])
    assert [b["last"] for b in series.job_series(job.pk, "a__b")["buckets"]] == [float(s) for s in range(10)]
    assert series.job_series(job.pk, "loss")["buckets"] == []


def test_metric_names_of_jobs(noisy, user, nodes):
    job, _ = noisy
    empty = submit(user, "empty")
    names = series.job_metric_names([job.pk, empty.pk])
    assert names[job.pk] == ["grad/norm", "loss", "val_loss"]  # step_s etc. were never sent: all NULL
    assert names[empty.pk] == []


def test_the_selector_reads_a_bounded_number_of_rows(noisy, django_assert_max_num_queries):
    """Bounds (3), buckets, last values and the lineage's attempts, whatever the length."""
    job, _ = noisy
    with django_assert_max_num_queries(7):
        assert len(series.job_series(job.pk, "loss", max_points=20)["buckets"]) == 20


# ---------------------------------------------------------------- the API

def test_job_series_api(noisy, client_for, user, other, staff):
    job, rows = noisy
    r = client_for(user).get(f"/api/v1/jobs/{job.pk}/series/?metric=val_loss&x=time&points=30")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["job"] == job.pk and body["metric"] == "val_loss" and body["x"] == "time" and body["points"] == 30
    same(body["buckets"], reference(rows, "val_loss", "time", 30))
    default = client_for(staff).get(f"/api/v1/jobs/{job.pk}/series/?metric=loss").json()
    assert default["x"] == "step" and default["points"] == series.MAX_POINTS and len(default["buckets"]) == 1500
    assert client_for(other).get(f"/api/v1/jobs/{job.pk}/series/?metric=loss").status_code == 404
    from rest_framework.test import APIClient
    assert APIClient().get(f"/api/v1/jobs/{job.pk}/series/?metric=loss").status_code in (401, 403)


@pytest.mark.parametrize("query, field", [
    ("", "metric"), ("metric=", "metric"), ("metric=has space", "metric"), ("metric=" + "m" * 65, "metric"),
    ("metric=loss&x=epoch", "x"), ("metric=loss&points=0", "points"), ("metric=loss&points=1501", "points"),
    ("metric=loss&points=abc", "points"), ("metric=loss&rank=-1", "rank"),
])
def test_bad_parameters_are_400s_naming_the_field(noisy, client_for, user, query, field):
    job, _ = noisy
    r = client_for(user).get(f"/api/v1/jobs/{job.pk}/series/?{query}")
    assert r.status_code == 400 and field in r.json()["errors"], r.content
    r = client_for(user).get(f"/api/v1/series/?jobs={job.pk}&{query}")
    assert r.status_code == 400 and field in r.json()["errors"], r.content


def test_series_of_several_jobs_only_visible_ones(noisy, client_for, user, other, teams):
    job, rows = noisy
    mine2 = submit(user, "second")
    store(mine2, [(0, s, T0 + s, 1.0 / (s + 1), None) for s in range(50)])
    theirs = submit(other, "bob's")
    store(theirs, [(0, 1, T0, 1.0, None)])
    r = client_for(user).get(f"/api/v1/series/?jobs={mine2.pk},{theirs.pk},{job.pk},999999,{job.pk}&metric=loss&points=40")
    assert r.status_code == 200, r.content
    body = r.json()
    assert [s["job"] for s in body["series"]] == [mine2.pk, job.pk]
    assert body["missing"] == [theirs.pk, 999999]
    assert body["series"][0]["name"] == "second" and body["series"][0]["status"] == Job.objects.get(pk=mine2.pk).status
    same(body["series"][1]["buckets"], reference(rows, "loss", "step", 40))
    assert len(body["series"][0]["buckets"]) == 40


def test_team_mates_see_each_others_series(client_for, user, other, teams, django_user_model, nodes):
    mate = django_user_model.objects.create_user("carol", password="pw-carol-123")
    mate.groups.add(teams[0])
    job = submit(user)
    store(job, [(0, 1, T0, 2.0, None)])
    assert client_for(mate).get(f"/api/v1/jobs/{job.pk}/series/?metric=loss").json()["buckets"][0]["last"] == 2.0
    assert client_for(other).get(f"/api/v1/jobs/{job.pk}/series/?metric=loss").status_code == 404


@pytest.mark.parametrize("jobs, message", [
    ("", "required"), ("1,x", "not a job id"), ("1;2", "not a job id"), ("-1", "not a job id"),
    (",".join(str(i) for i in range(1, api_series.MAX_SERIES_JOBS + 2)), "at most 50"),
])
def test_bad_job_lists(client_for, user, jobs, message):
    for path in (f"/api/v1/series/?metric=loss&jobs={jobs}", f"/api/v1/series/metrics/?jobs={jobs}"):
        r = client_for(user).get(path)
        assert r.status_code == 400 and message in " ".join(r.json()["errors"]["jobs"]), r.content


def test_metric_names_api(noisy, client_for, user, other):
    job, _ = noisy
    theirs = submit(other, "bob's")
    store(theirs, [(0, 1, T0, 1.0, {"secret_metric": 1.0})])
    body = client_for(user).get(f"/api/v1/series/metrics/?jobs={job.pk},{theirs.pk}").json()
    assert "val_loss" in body["metrics"] and "secret_metric" not in body["metrics"]
    assert body["missing"] == [theirs.pk] and set(body["jobs"]) == {str(job.pk)}


def test_samples_counted_match_the_table(noisy):
    job, rows = noisy
    assert series.job_series(job.pk, "loss")["samples"] == MetricSample.objects.filter(job=job).count() == len(rows)


def test_a_restarted_job_counts_each_step_once_along_its_lineage(user, nodes):
    """Attempt 1 ran steps 0..59 and died; attempt 2 resumed from the checkpoint at step 40: its
    steps 41.. replace attempt 1's (selectors.lineage_filter), so the series has no duplicate or
    stale step."""
    from jobs.models import Attempt

    job = submit(user)
    first = job.attempts.get()
    second = Attempt.objects.create(job=job, number=2, resumed_from_step=40)
    services.telemetry_ingest(
        [{"attempt": first.pk, "rank": 0, "step": s, "ts": T0 + s, "loss": 100.0 + s} for s in range(60)]
        + [{"attempt": second.pk, "rank": 0, "step": s, "ts": T0 + 100 + s, "loss": float(s)} for s in range(41, 80)],
        events=[])
    got = series.job_series(job.pk, "loss")
    assert [b["x"] for b in got["buckets"]] == list(range(80)) and got["samples"] == 80
    assert [b["last"] for b in got["buckets"]] == [100.0 + s for s in range(41)] + [float(s) for s in range(41, 80)]
    by_time = series.job_series(job.pk, "loss", x="time", max_points=4)["buckets"]
    # 4 spans of ~45 s over T0..T0+179; the restart's gap (T0+40..T0+141) leaves two of them empty
    assert by_time == [{"x": T0 + 40, "min": 100.0, "max": 140.0, "last": 140.0},
                       {"x": T0 + 179, "min": 41.0, "max": 79.0, "last": 79.0}]


# ---------------------------------------------------------------- per-step rows (issue 26)

def test_a_one_rank_spike_survives_bucketing(user, nodes):
    """8 ranks, 1,000 steps, loss ~1; rank 5 spikes to 50 at step 637 alone: every bucketing keeps
    it as its bucket's max, and the bucket's `last` stays the mean over ranks at its last step."""
    job = submit(user)
    rows = [(r, s, T0 + s, 1.0 + r / 100 + (49.0 if (r, s) == (5, 637) else 0.0), None)
            for s in range(1000) for r in range(8)]
    store(job, rows)
    for points in (1, 10, 37, 1500):
        got = series.job_series(job.pk, "loss", max_points=points)["buckets"]
        same(got, reference(rows, "loss", "step", points))
        assert max(b["max"] for b in got) == pytest.approx(50.05) and min(b["min"] for b in got) == 1.0
        assert all(b["last"] == pytest.approx(1.035) for b in got if b["x"] != 637)


def test_series_read_the_per_step_rows_not_the_per_rank_ones(noisy):
    """Retention thins the per-rank rows: the default series does not change, the drill-down does."""
    job, rows = noisy
    before = {m: series.job_series(job.pk, m, max_points=40) for m in ("loss", "val_loss", "grad/norm")}
    MetricSample.objects.filter(job=job, step__lte=2000).exclude(step__in=range(0, 2001, 100)).delete()
    for metric, want in before.items():
        assert series.job_series(job.pk, metric, max_points=40) == want
    kept = [r for r in rows if r[1] > 2000 or r[1] % 100 == 0]
    same(series.job_series(job.pk, "loss", max_points=40, rank=1)["buckets"],
         reference_rank(kept, "loss", "step", 40, 1))


def test_buckets_is_the_name_and_points_its_alias(noisy, client_for, user):
    job, rows = noisy
    c = client_for(user)
    for query in ("buckets=30", "points=30", "buckets=30&points=7"):
        body = c.get(f"/api/v1/jobs/{job.pk}/series/?metric=loss&{query}").json()
        assert body["points"] == 30 and len(body["buckets"]) == 30, query
        same(body["buckets"], reference(rows, "loss", "step", 30))
    drill = c.get(f"/api/v1/jobs/{job.pk}/series/?metric=loss&buckets=30&rank=0").json()
    same(drill["buckets"], reference_rank(rows, "loss", "step", 30, 0))
    for bad in ("buckets=0", "buckets=1501", "buckets=x"):
        r = c.get(f"/api/v1/jobs/{job.pk}/series/?metric=loss&{bad}")
        assert r.status_code == 400 and "buckets" in r.json()["errors"], r.content


@pytest.fixture
def ranked(user, nodes):
    """16 ranks, 3,000 steps of step_s: rank 11 is the slowest at 2 steps in 3, rank 4 at the
    others; rank 2 the fastest at every step but each 10th (rank 9 there). Per-rank rows kept for
    the last 500 steps only (as retention leaves them)."""
    job = submit(user, "ranked")
    rows = []
    for s in range(1, 3001):
        for r in range(16):
            v = 1.0 + r / 1000
            if r == (11 if s % 3 else 4):
                v = 1.5 + s / 10000
            if r == (9 if s % 10 == 0 else 2):
                v = 0.5
            rows.append({"rank": r, "step": s, "ts": T0 + s + r / 100, "step_s": v, "loss": 3.0 - s / 1000})
    attempt = job.attempts.get()
    for i in range(0, len(rows), 4000):
        services.telemetry_ingest([{"attempt": attempt.pk, **x} for x in rows[i:i + 4000]], events=[])
    MetricSample.objects.filter(job=job, step__lte=2500).delete()
    return job, rows


def test_rank_view_band_and_the_slowest_and_fastest_ranks(ranked):
    job, rows = ranked
    got = series.job_rank_view(job.pk, "step_s", steps=2000, max_points=100, top=3)
    assert got["window"] == {"from": 1001, "to": 3000, "steps": 2000}
    assert len(got["band"]) == 100 and got["band"][-1]["x"] == 3000 and got["band"][0]["x"] == 1020
    window = [x for x in rows if x["step"] > 1000]
    first = [x["step_s"] for x in window if x["step"] <= 1020]
    b0 = got["band"][0]
    assert b0["min"] == 0.5 and b0["max"] == max(first) and b0["mean"] == pytest.approx(sum(first) / len(first))
    slow = {r["rank"]: r for r in got["slowest"]}
    assert [r["rank"] for r in got["slowest"]] == [11, 4]
    assert slow[11]["steps"] == 1333 and slow[4]["steps"] == 667 and slow[11]["share"] == pytest.approx(1333 / 2000)
    assert [(r["rank"], r["steps"]) for r in got["fastest"]] == [(2, 1800), (9, 200)]
    # the ranks' own means over the window from the per-rank rows retention kept (steps 2501..3000)
    kept = [x for x in window if x["step"] > 2500]
    for r in got["slowest"] + got["fastest"]:
        mine = [x["step_s"] for x in kept if x["rank"] == r["rank"]]
        assert r["mean"] == pytest.approx(sum(mine) / len(mine))
    # a window with no per-rank row left: the ranks are still named, their means unknown
    old = series.job_rank_view(job.pk, "step_s", steps=3000, max_points=10)
    assert old["window"]["steps"] == 3000 and old["slowest"][0]["rank"] == 11
    MetricSample.objects.filter(job=job).delete()
    assert all(r["mean"] is None for r in series.job_rank_view(job.pk, "step_s")["slowest"])


def test_rank_view_api(ranked, client_for, user, other, staff):
    job, _ = ranked
    r = client_for(user).get(f"/api/v1/jobs/{job.pk}/ranks/?metric=step_s&steps=300&buckets=50&top=2")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["job"] == job.pk and body["metric"] == "step_s" and body["steps"] == 300 and body["points"] == 50
    assert body["window"] == {"from": 2701, "to": 3000, "steps": 300} and len(body["band"]) == 50
    assert [x["rank"] for x in body["slowest"]] == [11, 4] and [x["rank"] for x in body["fastest"]] == [2, 9]
    default = client_for(staff).get(f"/api/v1/jobs/{job.pk}/ranks/").json()
    assert default["metric"] == "step_s" and default["steps"] == series.RANK_WINDOW_STEPS
    assert default["window"] == {"from": 1001, "to": 3000, "steps": 2000} and len(default["slowest"]) == 2
    loss = client_for(user).get(f"/api/v1/jobs/{job.pk}/ranks/?metric=loss").json()
    assert loss["band"][-1]["mean"] == pytest.approx(0.0)
    assert client_for(other).get(f"/api/v1/jobs/{job.pk}/ranks/").status_code == 404
    assert client_for(user).get("/api/v1/jobs/999999/ranks/").status_code == 404
    empty = submit(user, "empty")
    assert client_for(user).get(f"/api/v1/jobs/{empty.pk}/ranks/").json()["band"] == []
    from rest_framework.test import APIClient
    assert APIClient().get(f"/api/v1/jobs/{job.pk}/ranks/").status_code in (401, 403)


@pytest.mark.parametrize("query, field", [
    ("metric=samples_per_s", "metric"), ("metric=val_loss", "metric"), ("steps=0", "steps"), ("steps=x", "steps"),
    ("buckets=0", "buckets"), ("points=1501", "points"), ("top=0", "top"), ("top=101", "top"),
])
def test_rank_view_bad_parameters_are_400s_naming_the_field(ranked, client_for, user, query, field):
    job, _ = ranked
    r = client_for(user).get(f"/api/v1/jobs/{job.pk}/ranks/?{query}")
    assert r.status_code == 400 and field in r.json()["errors"], r.content


def test_the_rank_view_reads_a_bounded_number_of_queries(ranked, django_assert_max_num_queries):
    job, _ = ranked
    with django_assert_max_num_queries(7):
        series.job_rank_view(job.pk, "compute_s")
    with django_assert_max_num_queries(7):
        series.job_rank_view(job.pk, "step_s", max_points=20)
