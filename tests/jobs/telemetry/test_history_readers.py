"""Every server-side reader of a job's history reads the per-step rows (MetricStep, issue 26), which
outlive the per-rank rows retention thins: the job list and page, /metrics, the knowledge base,
the metric names, has_telemetry; the straggler window keeps reading the recent per-rank rows (it
compares ranks) rank by rank on the (attempt, rank, step) index; MetricStep in the admin, read-only.
Data goes in through the relay's ingest; "retention" here deletes per-rank rows as the purge would.

Runs on SQLite here and on PostgreSQL with `-p tests.postgres --postgres` (make test-postgres)."""
from __future__ import annotations

import pytest
from django.test import Client

from jobs import services
from jobs.attempts import selectors as attempts_selectors
from jobs.models import MetricSample, MetricStep
from jobs.planning.policy import knowledge as knowledge_policy
from jobs.planning.services.knowledge import attempt_steps
from jobs.runs import views as runs_views
from jobs.telemetry import prometheus, selectors, series
from tests.conftest import free_port
from tests.jobs.runs.test_services import start, submit
from tests.jobs.telemetry.test_prometheus import parse, value

pytestmark = pytest.mark.django_db


def ingest(attempt, steps, ranks, **fields):
    """Each rank's sample at each step: loss 1 + step/100 + rank, samples_per_s 10 x (rank + 1),
    step_s 0.1 x (rank + 1), tokens_per_s 100, mem_bytes 1000 + rank, plus `fields`."""
    services.telemetry_ingest([
        {"attempt": attempt.pk, "rank": r, "step": s, "ts": 1000.0 + s + r / 100, "loss": 1.0 + s / 100 + r,
         "samples_per_s": 10.0 * (r + 1), "step_s": 0.1 * (r + 1), "tokens_per_s": 100.0, "mem_bytes": 1000 + r,
         **fields} for s in steps for r in ranks], events=[])


def purge_per_rank(job):
    """What retention leaves of the per-rank rows of an old job: none."""
    MetricSample.objects.filter(job=job).delete()


@pytest.fixture
def two_ranks(user, nodes):
    job = submit(user, resources={"nodes": 2, "procs_per_node": 1}, parallel={"dp": 2})
    attempt = start(job)
    ingest(attempt, range(1, 11), (0, 1))
    job.refresh_from_db()
    return job, attempt


def test_the_job_list_and_page_read_the_newest_per_step_row(two_ranks, user, client_for):
    job, _ = two_ranks
    purge_per_rank(job)
    assert runs_views._throughputs([job.pk]) == {job.pk: pytest.approx(15.0)}  # the ranks' mean at step 10
    summary = runs_views._latest_step_summary(job)
    assert summary == {"step": 10, "loss": pytest.approx(1.6), "step_s": pytest.approx(0.15),
                       "samples_per_s": pytest.approx(30.0), "tokens_per_s": pytest.approx(200.0)}
    c = client_for(user)
    assert c.get(f"/api/v1/jobs/{job.pk}/").json()["has_telemetry"] is True
    assert [j["has_telemetry"] for j in c.get("/api/v1/jobs/").json()["results"] if j["id"] == job.pk] == [True]
    page = Client()
    page.force_login(user)
    r = page.get(f"/jobs/{job.pk}/")
    assert selectors.job_has_telemetry(job.pk) and r.status_code == 200 and r.context["config"]["has_telemetry"]
    assert r.context["summary"]["step"] == 10
    assert series.job_metric_names([job.pk])[job.pk] == ["loss", "mem_bytes", "samples_per_s", "step_s",
                                                         "tokens_per_s"]


def test_the_job_list_with_many_jobs_is_one_query(two_ranks, user, nodes, django_assert_max_num_queries):
    job, _ = two_ranks
    other = submit(user)
    with django_assert_max_num_queries(1):
        got = runs_views._throughputs([job.pk, other.pk])
    assert got == {job.pk: pytest.approx(15.0), other.pk: None}


def test_prometheus_reads_the_step_most_ranks_reported(two_ranks, staff, settings, monkeypatch):
    """Step 11 has only rank 0 so far: the loss and throughput are step 10's (both ranks)."""
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setattr(prometheus, "_redis", None)
    monkeypatch.delenv(prometheus.TOKEN_ENV, raising=False)
    job, attempt = two_ranks
    ingest(attempt, [11], (0,))
    purge_per_rank(job)
    c = Client()
    c.force_login(staff)
    fams = parse(c.get("/metrics").content.decode())
    assert value(fams, "trainyard_job_step", job=job.pk) == 11
    assert value(fams, "trainyard_job_loss", job=job.pk) == pytest.approx(1.6)
    assert value(fams, "trainyard_job_samples_per_second", job=job.pk) == pytest.approx(30.0)
    ingest(attempt, [11], (1,))  # the step completes: now it is the newest with the most ranks
    fams = parse(c.get("/metrics").content.decode())
    assert value(fams, "trainyard_job_loss", job=job.pk) == pytest.approx(1.61)


def test_the_knowledge_base_reads_the_per_step_rows(two_ranks):
    job, attempt = two_ranks
    attempt.refresh_from_db()
    per_rank = list(MetricSample.objects.filter(attempt=attempt).values("rank", "step", "step_s", "tokens_per_s",
                                                                         "mem_bytes"))
    purge_per_rank(job)
    rows = attempt_steps(attempt)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert rows[0] == {"step": 1, "step_s": pytest.approx(0.2), "tokens_per_s": pytest.approx(200.0),
                       "mem_bytes": 1001}
    assert knowledge_policy.measure(rows) == knowledge_policy.measure(per_rank)


def test_the_straggler_window_reads_every_rank_of_the_recent_steps(user, nodes):
    """4 ranks on 2 nodes, each node reported only its first rank so far: the window still holds
    all four (the world from the slots), the last STRAGGLER_WINDOW_STEPS steps of each."""
    job = submit(user, resources={"nodes": 2, "procs_per_node": 2}, parallel={"dp": 4})
    attempt = start(job)
    ingest(attempt, range(1, 51), range(4), data_s=0.01, compute_s=0.05, optim_s=0.01)
    attempt.refresh_from_db()
    window = attempts_selectors.attempt_recent_samples(attempt.pk, attempt.last_step)
    steps = range(51 - attempts_selectors.STRAGGLER_WINDOW_STEPS, 51)
    assert sorted((s["rank"], s["step"]) for s in window) == [(r, s) for r in range(4) for s in steps]
    # an attempt without allocations (nothing to name its ranks): every rank's rows of the window
    from jobs.models import Attempt
    bare = Attempt.objects.create(job=job, number=9)
    ingest(bare, range(1, 31), (0, 5))
    assert len(attempts_selectors.attempt_recent_samples(bare.pk, 30)) == 2 * attempts_selectors.STRAGGLER_WINDOW_STEPS


def test_a_slow_rank_is_still_flagged(user, nodes, relay_alive):
    """Rank 3 does 3x its peers' work at every step: flagged from the per-rank window."""
    job = submit(user, resources={"nodes": 2, "procs_per_node": 2}, parallel={"dp": 4})
    attempt = start(job)
    for s in range(1, 31):
        services.telemetry_ingest([{"attempt": attempt.pk, "rank": r, "step": s, "ts": 1000.0 + s, "step_s": 0.2,
                                    "data_s": 0.01, "compute_s": 0.15 if r == 3 else 0.05, "optim_s": 0.01}
                                   for r in range(4)], events=[])
    assert services.attempts_check()["stragglers"] == {attempt.pk: [3]}
    attempt.refresh_from_db()
    assert [f["rank"] for f in attempt.stragglers] == [3]


def test_metric_step_is_in_the_admin_read_only(two_ranks, django_user_model):
    root = django_user_model.objects.create_superuser("super", password="pw-super-123")
    c = Client()
    c.force_login(root)
    row = MetricStep.objects.filter(job=two_ranks[0]).first()
    assert c.get("/admin/jobs/metricstep/").status_code == 200
    assert c.get(f"/admin/jobs/metricstep/{row.pk}/change/").status_code == 200  # the view page
    assert c.get("/admin/jobs/metricstep/add/").status_code == 403
    assert c.post(f"/admin/jobs/metricstep/{row.pk}/change/", {"step": 99}).status_code == 403
    assert c.post(f"/admin/jobs/metricstep/{row.pk}/delete/", {"post": "yes"}).status_code == 403
    assert MetricStep.objects.filter(pk=row.pk, step=row.step).exists()


def test_the_readers_answer_the_same_after_retention(two_ranks):
    """The readers answer from the per-step rows alone: purging every per-rank row changes nothing."""
    job, attempt = two_ranks
    attempt.refresh_from_db()

    def read():
        return (runs_views._latest_step_summary(job), runs_views._throughputs([job.pk]),
                series.job_series(job.pk, "loss"), series.job_rank_view(job.pk, "step_s")["band"],
                attempt_steps(attempt), series.job_metric_names([job.pk]))

    before = read()
    purge_per_rank(job)
    assert read() == before
