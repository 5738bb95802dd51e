"""GET /api/v1/jobs/<id>/logs/: the kept files paged by line offset, downloaded whole, bad parameters
named in a 400, other users' jobs a 404, and a deleted job's files removed."""
from __future__ import annotations

import pytest

from jobs import services
from jobs.telemetry.keptlogs import LogKeeper
from trainyard.keys import job_log_dir, rank_log_path

pytestmark = pytest.mark.django_db(transaction=True)  # on_commit runs (job deletion)


@pytest.fixture
def root(tmp_path, settings):
    settings.TRAINYARD_ARTIFACT_ROOT = tmp_path / "artifacts"
    settings.TRAINYARD_KEPT_LOG_ROOT = tmp_path / "keptlogs"
    return settings.TRAINYARD_KEPT_LOG_ROOT


def running(user, name="j"):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": name}))
    services.schedule_tick()
    return job, job.attempts.get()


def test_pages_the_latest_attempt_by_default(user, nodes, root, client_for):
    job, first = running(user)
    keeper = LogKeeper(root, thread=False)
    keeper.write({(job.pk, first.pk, 0): [f"line {i}" for i in range(2500)], (job.pk, first.pk, 1): ["r1 only"]})
    c = client_for(user)
    r = c.get(f"/api/v1/jobs/{job.pk}/logs/")
    assert r.status_code == 200, r.content
    body = r.json()
    assert (body["attempt"], body["rank"], body["offset"], body["total"], body["next_offset"]) == (first.pk, 0, 0, 2500, 1000)
    assert body["lines"][0] == "line 0" and len(body["lines"]) == 1000 and body["note"] == ""
    assert body["attempts"] == [{"id": first.pk, "number": 1, "ranks": [0, 1]}]
    r = c.get(f"/api/v1/jobs/{job.pk}/logs/", {"offset": body["next_offset"], "limit": 2000})
    page = r.json()
    assert page["lines"][0] == "line 1000" and page["lines"][-1] == "line 2499" and page["next_offset"] is None
    assert c.get(f"/api/v1/jobs/{job.pk}/logs/", {"rank": 1, "attempt": first.pk}).json()["lines"] == ["r1 only"]


def test_default_attempt_is_the_latest_with_kept_logs(user, nodes, root, client_for):
    from jobs.models import Attempt

    job, first = running(user)
    second = Attempt.objects.create(job=job, number=2)
    third = Attempt.objects.create(job=job, number=3)  # not launched yet: no logs
    LogKeeper(root, thread=False).write({(job.pk, first.pk, 0): ["first"], (job.pk, second.pk, 0): ["second"]})
    body = client_for(user).get(f"/api/v1/jobs/{job.pk}/logs/").json()
    assert body["attempt"] == second.pk and body["lines"] == ["second"]
    assert [a["id"] for a in body["attempts"]] == [first.pk, second.pk, third.pk]
    assert client_for(user).get(f"/api/v1/jobs/{job.pk}/logs/", {"attempt": third.pk}).json()["total"] == 0


def test_download_streams_the_whole_file(user, nodes, root, client_for):
    job, attempt = running(user)
    want = [f"output {i} ✓" for i in range(6000)]
    LogKeeper(root, thread=False).write({(job.pk, attempt.pk, 1): want})
    r = client_for(user).get(f"/api/v1/jobs/{job.pk}/logs/", {"rank": 1, "download": 1})
    assert r.status_code == 200 and r.streaming
    assert r["Content-Type"].startswith("text/plain")
    assert f'job-{job.pk}-attempt-{attempt.pk}-rank-1.log' in r["Content-Disposition"]
    assert r["X-Trainyard-Dropped-Lines"] == "0"
    assert b"".join(r.streaming_content).decode().splitlines() == want
    missing = client_for(user).get(f"/api/v1/jobs/{job.pk}/logs/", {"rank": 0, "download": 1})
    assert missing.status_code == 404 and "logs" in missing.json()["errors"]


def test_capped_logs_say_what_was_cut(user, nodes, root, client_for, settings):
    settings.TRAINYARD_LOG_MAX_BYTES_PER_JOB = 4000
    job, attempt = running(user)
    keeper = LogKeeper(root, max_bytes=4000, thread=False)
    for b in range(10):
        keeper.write({(job.pk, attempt.pk, 0): [f"batch {b} line {i:02d}" for i in range(40)]})
    r = client_for(user).get(f"/api/v1/jobs/{job.pk}/logs/", {"limit": 5000})
    body = r.json()
    assert body["total"] == 400 and body["dropped_lines"] > 0 and body["offset"] == body["dropped_lines"]
    assert "capped at 4000 bytes" in body["note"] and body["lines"][-1] == "batch 9 line 39"
    dl = client_for(user).get(f"/api/v1/jobs/{job.pk}/logs/", {"download": "1"})
    assert dl["X-Trainyard-Dropped-Lines"] == str(body["dropped_lines"])


@pytest.mark.parametrize("params, field", [
    ({"rank": "x"}, "rank"), ({"rank": -1}, "rank"), ({"rank": 2}, "rank"),  # 2 ranks: 0 and 1
    ({"offset": "1.5"}, "offset"), ({"offset": -3}, "offset"),
    ({"limit": 0}, "limit"), ({"limit": 5001}, "limit"), ({"limit": "all"}, "limit"),
    ({"attempt": "first"}, "attempt"), ({"attempt": 999999}, "attempt"),
    ({"download": "yes"}, "download"),
])
def test_bad_parameters_are_400_naming_them(user, nodes, root, client_for, params, field):
    job, attempt = running(user)
    LogKeeper(root, thread=False).write({(job.pk, attempt.pk, 0): ["x"]})
    r = client_for(user).get(f"/api/v1/jobs/{job.pk}/logs/", params)
    assert r.status_code == 400, (params, r.content)
    assert list(r.json()["errors"]) == [field]


def test_another_attempts_id_is_refused(user, nodes, root, client_for):
    job, _ = running(user, "mine")
    other_job, other_attempt = running(user, "other")
    r = client_for(user).get(f"/api/v1/jobs/{job.pk}/logs/", {"attempt": other_attempt.pk})
    assert r.status_code == 400 and "attempt" in r.json()["errors"]


def test_other_users_jobs_are_404(user, other, nodes, root, client_for):
    job, attempt = running(user)
    LogKeeper(root, thread=False).write({(job.pk, attempt.pk, 0): ["secret"]})
    for params in ({}, {"download": 1}):
        r = client_for(other).get(f"/api/v1/jobs/{job.pk}/logs/", params)
        assert r.status_code == 404 and b"secret" not in r.content


def test_job_without_attempts_has_an_empty_page(user, nodes, root, client_for):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "waiting", "resources": {"nodes": 2, "procs_per_node": 2}}))
    body = client_for(user).get(f"/api/v1/jobs/{job.pk}/logs/").json()
    assert body["attempt"] is None and body["total"] == 0 and body["lines"] == [] and body["attempts"] == []
    assert client_for(user).get(f"/api/v1/jobs/{job.pk}/logs/", {"download": 1}).status_code == 404


def test_deleting_a_job_removes_its_kept_logs(user, nodes, root):
    job, attempt = running(user)
    keep, keep_attempt = running(user, "kept")
    LogKeeper(root, thread=False).write({(job.pk, attempt.pk, 0): ["gone"], (keep.pk, keep_attempt.pk, 0): ["stays"]})
    job_id = job.pk
    assert job_log_dir(root, job_id).is_dir()
    job.delete()
    assert not job_log_dir(root, job_id).exists()
    assert rank_log_path(root, keep.pk, keep_attempt.pk, 0).read_text() == "stays\n"
