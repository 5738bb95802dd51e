"""Telemetry retention (issue 26, jobs/telemetry/retention.py): the recent window, the thinned grid and its
determinism, the neighbourhoods of events, team overrides, deletions by age after the job ends, batches
that never hold the relay's write lock for long, the dry run, the command, the beat task and the API.
Data goes in through telemetry_ingest as the relay writes it (SQLite and, under `-p tests.postgres
--postgres`, PostgreSQL)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.core.management import call_command
from django.utils import timezone

from jobs.attempts.services.events import job_event
from jobs.models import Job, MetricSample, MetricStep, RetentionPolicy
from jobs.telemetry import ingest, retention
from trainyard import keys

from tests.jobs.runs.test_services import start, submit


@pytest.fixture(autouse=True)
def _fresh_watermarks():
    cache.clear()  # job ids come back after a flush; a watermark must not outlive its test
    yield
    cache.clear()


def feed(attempt, ranks: int, steps, chunk: int = 4000) -> None:
    """Per-rank samples of `steps` for `ranks` ranks, in relay-sized rounds."""
    batch = []
    for step in steps:
        for rank in range(ranks):
            batch.append({"attempt": attempt.pk, "rank": rank, "step": step, "ts": 1000.0 + step,
                          "loss": 2.0 - step / 1e5, "step_s": 0.1 + rank / 1000, "compute_s": 0.05})
            if len(batch) >= chunk:
                ingest.telemetry_ingest(batch, events=[])
                batch = []
    if batch:
        ingest.telemetry_ingest(batch, events=[])


def end(job, status=Job.Status.SUCCEEDED, **fields) -> None:
    """The job over (its slots free for the next one in the test)."""
    from jobs.models import Allocation, Attempt

    Allocation.objects.filter(attempt__job=job).update(active=False)
    Attempt.objects.filter(job=job).update(status=Attempt.Status.ENDED)
    Job.objects.filter(pk=job.pk).update(status=status, **fields)


def stored(job) -> dict[int, set[int]]:
    """rank -> the steps whose per-rank row is stored."""
    out: dict[int, set[int]] = {}
    for rank, step in MetricSample.objects.filter(job=job).values_list("rank", "step"):
        out.setdefault(rank, set()).add(step)
    return out


def site(**fields) -> RetentionPolicy:
    row = retention.site_row()
    for k, v in fields.items():
        setattr(row, k, v)
    row.save()
    return row


def expect(top: int, window: int, k: int | None, centres: list[int], steps) -> set[int]:
    """The rule written out independently of the service."""
    r = retention.EVENT_NEIGHBOURHOOD_STEPS
    return {s for s in steps if s > top - window or (k is not None and s % k == 0)
            or any(abs(s - c) <= r for c in centres)}


@pytest.mark.django_db(transaction=True)
def test_the_site_row_is_created_on_first_use_with_the_defaults(db):
    assert not RetentionPolicy.objects.exists()
    p, teams = retention.policies()
    row = RetentionPolicy.objects.get(team__isnull=True)
    assert (row.rank_window_steps, row.rank_sampled_per_rank, row.rank_days) == (2000, 1000, None)
    assert (p.rank_window_steps, p.rank_sampled_per_rank, p.finished_jobs_days) == (2000, 1000, None)
    assert teams == {}
    row.rank_window_steps = None  # an emptied site field falls back to the default
    row.save()
    assert retention.policies()[0].rank_window_steps == 2000


def test_the_stride_is_a_power_of_two_keeping_between_half_and_all_of_the_budget():
    assert retention.thinning_stride(top=1999, window=2000, per_rank=1000) == 1  # all in the window
    assert retention.thinning_stride(top=100_000, window=2000, per_rank=1000) == 128  # 98,001 steps -> 766
    for top in range(2000, 400_000, 997):
        k = retention.thinning_stride(top=top, window=2000, per_rank=1000)
        span = top - 2000 + 1
        kept = -(-span // k)
        assert k & (k - 1) == 0 and kept <= 1000 and (k == 1 or kept > 500)
    assert retention.thinning_stride(top=5000, window=100, per_rank=0) is None


@pytest.mark.django_db(transaction=True)
def test_window_thinning_and_event_neighbourhoods_keep_exactly_the_rule(user, nodes):
    job = submit(user)
    attempt = start(job)
    site(rank_window_steps=100, rank_sampled_per_rank=20)
    feed(attempt, 4, range(1, 1001))
    job_event(job, "straggler", "rank 2 slow", attempt=attempt, rank=2, since_step=300)
    job_event(job, "rollback", "rolled back", step=520)
    job_event(job, "resized", "3 nodes", attempt=attempt, nodes=3)  # no step of its own: the resume point's
    job_event(job, "annotated", "a note", step=700)  # not an event that keeps its neighbourhood
    job.refresh_from_db()
    assert job.step == 1000
    before_steps = MetricStep.objects.filter(job=job).count()

    result = retention.telemetry_purge()

    k = retention.thinning_stride(1000, 100, 20)
    assert k == 64  # 901 steps beyond the window / 64 -> 15 kept
    want = expect(1000, 100, k, [300, 520], range(1, 1001))
    got = stored(job)
    assert sorted(got) == [0, 1, 2, 3]
    for rank in range(4):
        assert got[rank] == want, rank
    assert result.rank_rows_thinned == 4 * 1000 - 4 * len(want)
    assert result.jobs_thinned == [job.pk]
    assert MetricStep.objects.filter(job=job).count() == before_steps == 1000  # never thinned


@pytest.mark.django_db(transaction=True)
def test_repeated_purges_keep_the_same_steps_and_a_longer_job_only_drops_more_of_the_same_grid(user, nodes):
    job = submit(user)
    attempt = start(job)
    site(rank_window_steps=100, rank_sampled_per_rank=20)
    feed(attempt, 2, range(1, 1001))
    retention.telemetry_purge()
    first = stored(job)
    assert retention.telemetry_purge().rank_rows_thinned == 0
    cache.clear()  # a full pass (no watermark) finds nothing more either
    assert retention.telemetry_purge().rank_rows_thinned == 0
    assert stored(job) == first

    feed(attempt, 2, range(1001, 2001))  # the job doubles: stride 64 -> 128
    retention.telemetry_purge()
    second = stored(job)
    assert retention.thinning_stride(2000, 100, 20) == 128
    want = expect(2000, 100, 128, [], range(1, 2001))
    assert second[0] == second[1] == want
    old_part = {s for s in first[0] if s <= 1000 - 100}
    assert {s for s in second[0] if s <= 1000 - 100} <= old_part  # nothing new picked below the old window


@pytest.mark.django_db(transaction=True)
def test_a_restart_keeps_the_neighbourhood_of_its_resume_point_and_the_window_follows_the_rewound_step(user, nodes):
    from jobs.models import Attempt

    job = submit(user)
    attempt = start(job)
    site(rank_window_steps=100, rank_sampled_per_rank=10)
    feed(attempt, 2, range(1, 801))
    # a second attempt resumed at step 400 (the job's step rewinds there: jobs/attempts/services/launch.py)
    second = Attempt.objects.create(job=job, number=2, resumed_from_step=400)
    job_event(job, "restart", "restart 1", attempt=attempt, resume_step=400)
    Job.objects.filter(pk=job.pk).update(step=400)
    feed(second, 2, range(401, 601))
    job.refresh_from_db()
    assert job.step == 600
    retention.telemetry_purge()
    k = retention.thinning_stride(600, 100, 10)
    # the first attempt's steps 601..800 are above the rewound top: kept until the job is past them
    want_first = expect(600, 100, k, [400], range(1, 801))
    want_second = expect(600, 100, k, [400], range(401, 601))
    rows = set(MetricSample.objects.filter(job=job, rank=0).values_list("attempt_id", "step"))
    assert rows == {(attempt.pk, s) for s in want_first} | {(second.pk, s) for s in want_second}


@pytest.mark.django_db(transaction=True)
def test_a_team_row_overrides_the_site_field_by_field(user, other, nodes, teams):
    vision, nlp = teams
    site(rank_window_steps=100, rank_sampled_per_rank=20, rank_days=30.0)
    RetentionPolicy.objects.create(team=vision, rank_window_steps=300)  # rank_sampled_per_rank: the site's
    a = submit(user)
    Job.objects.filter(pk=a.pk).update(team=vision)
    attempt_a = start(a)
    feed(attempt_a, 2, range(1, 1001))
    b = submit(other)
    Job.objects.filter(pk=b.pk).update(team=nlp)
    attempt_b = start(b)
    feed(attempt_b, 2, range(1, 1001))
    site_p, team_p = retention.policies()
    assert (team_p[vision.pk].rank_window_steps, team_p[vision.pk].rank_sampled_per_rank,
            team_p[vision.pk].rank_days) == (300, 20, 30.0)
    retention.telemetry_purge()
    ka, kb = retention.thinning_stride(1000, 300, 20), retention.thinning_stride(1000, 100, 20)
    assert (ka, kb) == (64, 64)
    assert stored(a)[0] == expect(1000, 300, ka, [], range(1, 1001))
    assert stored(b)[0] == expect(1000, 100, kb, [], range(1, 1001))


@pytest.mark.django_db(transaction=True)
def test_what_ended_long_enough_ago_goes_per_kind_and_then_the_job_itself(user, other, nodes, teams, settings,
                                                                          tmp_path, django_capture_on_commit_callbacks):
    vision, _ = teams
    settings.TRAINYARD_KEPT_LOG_ROOT = tmp_path / "kept"
    settings.TRAINYARD_CHECKPOINT_ROOT = tmp_path / "ckpt"
    site(rank_days=1.0, reduced_days=5.0, logs_days=2.0)
    RetentionPolicy.objects.create(team=vision, rank_days=20.0)  # vision keeps per-rank rows longer

    def finished(user, days_ago, team=None):
        job = submit(user)
        attempt = start(job)
        feed(attempt, 2, range(1, 51))
        end(job, team=team, finished_at=timezone.now() - timedelta(days=days_ago))
        log = keys.rank_log_path(settings.TRAINYARD_KEPT_LOG_ROOT, job.pk, attempt.pk, 0)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("hello\n")
        ckpt = keys.job_checkpoint_dir(settings.TRAINYARD_CHECKPOINT_ROOT, job.pk) / "step-1"
        ckpt.mkdir(parents=True)
        return job

    old, vision_job, recent = finished(user, 3), finished(user, 3, team=vision), finished(other, 0.5)
    running = submit(other)
    feed(start(running), 2, range(1, 51))

    r = retention.telemetry_purge()
    assert r.rank_rows_expired == 100 and r.step_rows_expired == 0 and sorted(r.logs_removed) == sorted([old.pk, vision_job.pk])
    assert not MetricSample.objects.filter(job=old).exists()
    assert MetricSample.objects.filter(job=vision_job).count() == 100  # the team's 20 days
    assert MetricSample.objects.filter(job=recent).count() == MetricSample.objects.filter(job=running).count() == 100
    assert MetricStep.objects.filter(job=old).count() == 50
    assert not keys.job_log_dir(settings.TRAINYARD_KEPT_LOG_ROOT, old.pk).exists()
    assert keys.job_log_dir(settings.TRAINYARD_KEPT_LOG_ROOT, recent.pk).exists()

    r = retention.telemetry_purge(now=timezone.now() + timedelta(days=3))  # old ended 6 days ago now
    assert r.step_rows_expired == 50 + 50  # old's and vision_job's per-step rows (5 days)
    assert r.rank_rows_expired == 100 and r.logs_removed == [recent.pk]  # recent ended 3.5 days ago now
    assert not MetricStep.objects.filter(job=old).exists()
    assert MetricStep.objects.filter(job=recent).count() == 50
    assert Job.objects.filter(pk=old.pk).exists()  # finished_jobs_days is empty: jobs stay

    site(finished_jobs_days=4.0)
    with django_capture_on_commit_callbacks(execute=True):
        r = retention.telemetry_purge(now=timezone.now() + timedelta(days=3))
    assert sorted(r.jobs_deleted) == sorted([old.pk, vision_job.pk])  # 6 days; recent ended 3.5 days ago
    assert not Job.objects.filter(pk__in=[old.pk, vision_job.pk]).exists()
    assert r.rank_rows_expired == 100  # vision_job's per-rank rows, kept by its team's 20 days until the job went
    assert not keys.job_checkpoint_dir(settings.TRAINYARD_CHECKPOINT_ROOT, old.pk).exists()
    assert keys.job_checkpoint_dir(settings.TRAINYARD_CHECKPOINT_ROOT, recent.pk).exists()
    assert Job.objects.filter(pk__in=[recent.pk, running.pk]).count() == 2
    assert MetricSample.objects.filter(job=running).count() == 100


@pytest.mark.django_db(transaction=True)
def test_deletes_go_in_bounded_batches_each_its_own_transaction(user, nodes, monkeypatch):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    monkeypatch.setattr(retention, "BATCH_ROWS", 250)
    monkeypatch.setattr(retention, "SQLITE_YIELD_MIN_S", 0.0)
    job = submit(user)
    attempt = start(job)
    site(rank_window_steps=100, rank_sampled_per_rank=10, rank_days=0.0)
    feed(attempt, 4, range(1, 601))
    with CaptureQueriesContext(connection) as q:
        r = retention.telemetry_purge()
    deletes = [x["sql"] for x in q.captured_queries if x["sql"].startswith("DELETE")]
    assert r.rank_rows_thinned > 1000 and r.batches == len(deletes) >= r.rank_rows_thinned // 250
    assert all(d.count(",") < 250 for d in deletes)  # at most 250 ids each
    assert r.max_batch_s < 1.0
    # one transaction per batch: a BEGIN (or SAVEPOINT-free atomic) before each DELETE
    begins = [x["sql"] for x in q.captured_queries if x["sql"].upper().startswith("BEGIN")]
    if connection.vendor == "sqlite":
        assert len(begins) >= len(deletes)
    # after the job ends, its rows go by the bounded subquery, also 250 at a time
    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED, finished_at=timezone.now() - timedelta(hours=1))
    left = MetricSample.objects.filter(job=job).count()
    with CaptureQueriesContext(connection) as q:
        r = retention.telemetry_purge()
    limits = [int(x["sql"].rsplit("LIMIT", 1)[1].strip(" )")) for x in q.captured_queries
              if x["sql"].startswith("DELETE")]
    assert r.rank_rows_expired == left and r.batches == len(limits) >= left // 250 and max(limits) <= 250


@pytest.mark.django_db(transaction=True)
def test_a_relay_round_is_not_held_up_by_the_purge(user, nodes):
    """A writer doing relay rounds (telemetry_ingest, BEGIN IMMEDIATE on SQLite) while the purge deletes
    ~30,000 rows: no round waits more than about one batch, and no batch holds the lock long."""
    from django.db import connection

    job = submit(user)
    attempt = start(job)
    site(rank_window_steps=100, rank_sampled_per_rank=10)
    feed(attempt, 8, range(1, 4001), chunk=8000)
    other = submit(user)
    other_attempt = start(other)
    rounds: list[float] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def relay():
        step = 1
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                ingest.telemetry_ingest([{"attempt": other_attempt.pk, "rank": r, "step": step, "ts": 1.0, "loss": 1.0}
                                         for r in range(64)], events=[])
                rounds.append(time.monotonic() - t0)
                step += 1
                time.sleep(0.005)
        except BaseException as exc:  # noqa: B036 - surfaced below
            errors.append(exc)
        finally:
            connection.close()

    t = threading.Thread(target=relay)
    t.start()
    try:
        time.sleep(0.2)
        r = retention.telemetry_purge()
    finally:
        stop.set()
        t.join(30)
    assert not errors
    assert r.rank_rows_thinned > 25_000 and r.batches >= 6
    assert r.max_batch_s < 1.0
    assert len(rounds) > 10
    # a round waits at most for the batch holding the lock when it asked (plus its own work)
    assert max(rounds) < max(1.5, 3 * r.max_batch_s), (max(rounds), r.max_batch_s)


@pytest.mark.django_db(transaction=True)
def test_a_dry_run_counts_what_a_real_run_then_removes_and_removes_nothing(user, nodes, settings, tmp_path):
    settings.TRAINYARD_KEPT_LOG_ROOT = tmp_path / "kept"
    job = submit(user)
    attempt = start(job)
    site(rank_window_steps=100, rank_sampled_per_rank=10)
    feed(attempt, 3, range(1, 501))
    done = submit(user)
    feed(start(done), 2, range(1, 31))
    end(done, Job.Status.FAILED, finished_at=timezone.now() - timedelta(days=9))
    site(reduced_days=1.0, finished_jobs_days=8.0)
    rows, steps = MetricSample.objects.count(), MetricStep.objects.count()
    dry = retention.telemetry_purge(dry_run=True)
    assert (MetricSample.objects.count(), MetricStep.objects.count()) == (rows, steps)
    assert Job.objects.filter(pk=done.pk).exists()
    real = retention.telemetry_purge()
    assert dry.dry_run and not real.dry_run
    for f in ("rank_rows_thinned", "rank_rows_expired", "step_rows_expired", "jobs_deleted", "jobs_thinned"):
        assert getattr(dry, f) == getattr(real, f), f
    assert dry.rank_rows_thinned > 0 and dry.jobs_deleted == [done.pk] and dry.step_rows_expired == 30
    assert MetricSample.objects.count() == rows - real.rank_rows_thinned - real.rank_rows_expired


@pytest.mark.django_db(transaction=True)
def test_the_command_prints_what_it_removed_and_the_dry_run_says_would(user, nodes, capsys):
    job = submit(user)
    feed(start(job), 2, range(1, 301))
    site(rank_window_steps=50, rank_sampled_per_rank=10)
    call_command("purge_telemetry", "--dry-run")
    out = capsys.readouterr().out
    assert "would remove" in out and MetricSample.objects.count() == 600
    call_command("purge_telemetry")
    out = capsys.readouterr().out
    thinned = 600 - MetricSample.objects.count()
    assert thinned > 0 and f"removed {thinned} per-rank sample(s)" in out and "finished job(s)" in out


def test_the_purge_is_a_beat_task_on_the_control_beat_queue(settings):
    from controlplane.celery import app
    from jobs import tasks
    from jobs.core.celery_app import BEAT_TASKS
    from trainyard.keys import CONTROL_BEAT_QUEUE
    from trainyard.launch import TELEMETRY_PURGE_TASK

    assert tasks.telemetry_purge.name == TELEMETRY_PURGE_TASK in BEAT_TASKS
    entry = next(e for e in app.conf.beat_schedule.values() if e["task"] == TELEMETRY_PURGE_TASK)
    assert entry["schedule"] == settings.TRAINYARD_TELEMETRY_PURGE_S == 60.0
    assert app.conf.task_routes[TELEMETRY_PURGE_TASK] == {"queue": CONTROL_BEAT_QUEUE}


# --- the API ---------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_the_api_shows_the_site_and_only_the_callers_teams_to_non_staff(user, staff, teams, client_for):
    vision, nlp = teams
    RetentionPolicy.objects.create(team=vision, rank_days=3.0)
    RetentionPolicy.objects.create(team=nlp, logs_days=1.0)
    body = client_for(user).get("/api/v1/retention/").json()
    assert body["site"]["effective"]["rank_window_steps"] == 2000 and body["defaults"]["rank_sampled_per_rank"] == 1000
    assert [t["team"] for t in body["teams"]] == ["vision"]
    assert body["teams"][0]["rank_days"] == 3.0 and body["teams"][0]["effective"]["rank_window_steps"] == 2000
    body = client_for(staff).get("/api/v1/retention/").json()
    assert [t["team"] for t in body["teams"]] == ["nlp", "vision"]


@pytest.mark.django_db
def test_only_staff_change_retention(user, teams, client_for):
    r = client_for(user).put("/api/v1/retention/", {"site": {"rank_days": 1}}, format="json")
    assert r.status_code == 403
    assert retention.site_row().rank_days is None


@pytest.mark.django_db
def test_staff_change_the_site_and_teams_and_clearing_a_team_removes_its_row(staff, teams, client_for):
    vision, nlp = teams
    c = client_for(staff)
    r = c.put("/api/v1/retention/", {"site": {"rank_window_steps": 500, "rank_days": 7},
                                     "teams": [{"team": "vision", "reduced_days": 30, "rank_sampled_per_rank": 0}]},
              format="json")
    assert r.status_code == 200, r.json()
    body = r.json()
    assert (body["site"]["rank_window_steps"], body["site"]["rank_days"]) == (500, 7.0)
    team = body["teams"][0]
    assert team["team"] == "vision" and team["reduced_days"] == 30.0 and team["rank_window_steps"] is None
    assert team["effective"] == {**body["site"]["effective"], "reduced_days": 30.0, "rank_sampled_per_rank": 0}
    r = c.put("/api/v1/retention/", {"site": {"rank_window_steps": None}}, format="json")  # back to the default
    assert r.json()["site"]["effective"]["rank_window_steps"] == 2000 and r.json()["site"]["rank_days"] == 7.0
    r = c.put("/api/v1/retention/", {"teams": [{"team": "vision", "reduced_days": None,
                                                "rank_sampled_per_rank": None}]}, format="json")
    assert r.json()["teams"] == [] and not RetentionPolicy.objects.filter(team=vision).exists()


@pytest.mark.django_db
def test_bad_settings_are_400s_with_field_errors_and_change_nothing(staff, teams, client_for):
    c = client_for(staff)
    r = c.put("/api/v1/retention/", {"site": {"rank_window_steps": 0, "rank_days": -1, "logs_days": "x", "bogus": 1},
                                     "teams": [{"team": "nobody", "rank_days": 1}, {"rank_days": True}],
                                     "extra": 1}, format="json")
    assert r.status_code == 400
    errors = r.json()["errors"]
    assert set(errors) == {"site.rank_window_steps", "site.rank_days", "site.logs_days", "site.bogus",
                           "teams.0.team", "teams.1.team", "teams.1.rank_days", "extra"}
    assert "nobody" in errors["teams.0.team"][0]
    assert retention.site_row().rank_window_steps == 2000 and RetentionPolicy.objects.count() == 1
    assert c.put("/api/v1/retention/", {"site": {"rank_window_steps": 10, "rank_days": 1},
                                        "teams": [{"team": "nobody"}]}, format="json").status_code == 400
    assert retention.site_row().rank_window_steps == 2000  # all or nothing
    assert c.put("/api/v1/retention/", [], format="json").status_code == 400


@pytest.mark.django_db
def test_the_admin_lists_and_edits_retention_for_staff(staff, teams, client):
    staff.is_superuser = True
    staff.save()
    client.force_login(staff)
    retention.site_row()
    r = client.get("/admin/jobs/retentionpolicy/")
    assert r.status_code == 200 and b"site (every team" in r.content
    r = client.get("/admin/jobs/retentionpolicy/add/")
    assert r.status_code == 200 and b"power of two" in r.content
