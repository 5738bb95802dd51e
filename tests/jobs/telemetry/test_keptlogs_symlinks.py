"""Kept logs never follow what was planted in their place (issue 21, section 5): a symlink (or a FIFO)
where a rank's kept file, its sidecar, the job's or the attempt's directory, or a temporary file of
the cap should be is refused, never read through by the logs API or its download, and never written
through by the relay's writer. The kept log root itself is apart from every root the nodes write.

The API tests point the artifact root and the kept log root at one directory, so that the same test
plants its links where the code before this change looked (the artifact root) and where it looks now."""
from __future__ import annotations

import os
import threading

import pytest

from jobs.telemetry import keptlogs
from jobs import services
from jobs.telemetry.keptlogs import LogKeeper
from trainyard import keys
from trainyard.keys import job_log_dir, rank_log_path

SECRET = "control-plane secret: s3cr3t\n"


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "outside" / "secret_key"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


@pytest.fixture
def root(tmp_path, settings):
    settings.TRAINYARD_ARTIFACT_ROOT = settings.TRAINYARD_KEPT_LOG_ROOT = tmp_path / "logroot"
    (tmp_path / "logroot").mkdir()
    return tmp_path / "logroot"


def running(user):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "planted"}))
    services.schedule_tick()
    return job, job.attempts.get()


def get_logs(client, job, **params):
    return client.get(f"/api/v1/jobs/{job.pk}/logs/", params)


# ---------------------------------------------------------------- the logs API and its download


@pytest.mark.django_db
def test_a_symlinked_rank_log_is_refused_by_the_page_and_the_download(user, nodes, root, secret, client_for):
    job, attempt = running(user)
    path = rank_log_path(root, job.pk, attempt.pk, 0)
    path.parent.mkdir(parents=True)
    path.symlink_to(secret)
    before = getattr(keptlogs, "refusals", {"count": 0})["count"]
    c = client_for(user)
    for params in ({}, {"attempt": attempt.pk}, {"attempt": attempt.pk, "download": 1}):
        r = get_logs(c, job, **params)
        body = b"".join(r.streaming_content) if r.streaming else r.content
        assert r.status_code == 404, (params, r.status_code)
        assert b"s3cr3t" not in body and "logs" in r.json()["errors"]
    assert keptlogs.refusals["count"] > before
    assert secret.read_text() == SECRET


@pytest.mark.django_db
def test_a_symlinked_job_directory_is_refused(user, nodes, root, secret, client_for):
    job, attempt = running(user)
    # the job's directory points at a tree laid out like kept logs, whose rank file is the secret
    fake = secret.parent / "fake-job"
    (fake / f"attempt-{attempt.pk}").mkdir(parents=True)
    (fake / f"attempt-{attempt.pk}" / "rank-0.log").symlink_to(secret)
    (fake / f"attempt-{attempt.pk}" / "rank-1.log").write_text(SECRET)
    job_log_dir(root, job.pk).parent.mkdir(parents=True)
    job_log_dir(root, job.pk).symlink_to(fake)
    c = client_for(user)
    for rank in (0, 1):
        for params in ({"attempt": attempt.pk, "rank": rank}, {"attempt": attempt.pk, "rank": rank, "download": 1}):
            r = get_logs(c, job, **params)
            body = b"".join(r.streaming_content) if r.streaming else r.content
            assert r.status_code == 404 and b"s3cr3t" not in body, (params, r.status_code)
    listing = get_logs(c, job, rank=1, attempt=attempt.pk)
    assert b"s3cr3t" not in listing.content


@pytest.mark.django_db
def test_a_symlinked_attempt_directory_is_refused(user, nodes, root, secret, client_for):
    job, attempt = running(user)
    (secret.parent / "rank-0.log").write_text(SECRET)
    adir = rank_log_path(root, job.pk, attempt.pk, 0).parent
    adir.parent.mkdir(parents=True)
    adir.symlink_to(secret.parent)
    c = client_for(user)
    page = get_logs(c, job, attempt=attempt.pk)
    download = get_logs(c, job, attempt=attempt.pk, download=1)
    assert page.status_code == 404 and b"s3cr3t" not in page.content
    assert download.status_code == 404 and not download.streaming
    default = get_logs(c, job)  # the attempts listing does not list a rank behind the link either
    assert b"s3cr3t" not in default.content
    assert all(a["ranks"] == [] for a in default.json().get("attempts", []))


@pytest.mark.django_db
def test_a_symlinked_sidecar_is_refused(user, nodes, root, secret, client_for):
    job, attempt = running(user)
    LogKeeper(root, thread=False).write({(job.pk, attempt.pk, 0): ["mine"]})
    (secret.parent / "count.json").write_text('{"lines": 31337, "bytes": 31337}')
    side = rank_log_path(root, job.pk, attempt.pk, 0).with_name("rank-0.log.dropped")
    side.symlink_to(secret.parent / "count.json")
    c = client_for(user)
    for params in ({}, {"download": 1}):
        r = get_logs(c, job, **params)
        body = b"".join(r.streaming_content) if r.streaming else r.content
        assert r.status_code == 404 and b"31337" not in body and "31337" not in r.get("X-Trainyard-Dropped-Lines", "")


@pytest.mark.django_db(transaction=True)  # the request runs in another thread (a connection of its own)
def test_a_fifo_in_place_of_a_rank_log_is_refused_without_blocking(user, nodes, root, client_for):
    job, attempt = running(user)
    path = rank_log_path(root, job.pk, attempt.pk, 0)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    out = {}

    def ask():
        out["page"] = get_logs(client_for(user), job, attempt=attempt.pk)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(10)
    assert "page" in out, "a FIFO in place of a kept log blocked the logs API"
    assert out["page"].status_code == 404


# ---------------------------------------------------------------- the relay's writer


def test_the_writer_does_not_append_through_a_planted_rank_log(tmp_path, secret):
    k = LogKeeper(tmp_path / "kept", thread=False)
    path = rank_log_path(tmp_path / "kept", 7, 70, 0)
    path.parent.mkdir(parents=True)
    path.symlink_to(secret)
    k.write({(7, 70, 0): ["overwritten?"], (7, 70, 1): ["fine"]})
    assert secret.read_text() == SECRET and path.is_symlink()
    assert k.stats["lines_write_errors"] == 1 and k.stats.get("unsafe_paths_refused") == 1
    assert rank_log_path(tmp_path / "kept", 7, 70, 1).read_text() == "fine\n"


def test_the_writer_does_not_write_into_a_symlinked_job_or_attempt_directory(tmp_path, secret):
    kept = tmp_path / "kept"
    k = LogKeeper(kept, thread=False)
    job_log_dir(kept, 7).parent.mkdir(parents=True)
    job_log_dir(kept, 7).symlink_to(secret.parent)  # the job's directory
    adir = rank_log_path(kept, 8, 80, 0).parent
    adir.parent.mkdir(parents=True)
    adir.symlink_to(secret.parent)  # one attempt's directory
    k.write({(7, 70, 0): ["via the job dir"], (8, 80, 0): ["via the attempt dir"]})
    assert sorted(os.listdir(secret.parent)) == ["secret_key"]
    assert k.stats["lines_written"] == 0 and k.stats.get("unsafe_paths_refused") == 2


def test_the_cap_never_writes_through_planted_temporary_names(tmp_path, secret):
    """Before: the cut went through the fixed name rank-<r>.log.cut and the sidecar through
    rank-<r>.log.dropped.tmp, both opened following links."""
    kept = tmp_path / "kept"
    other = secret.parent / "other"
    other.write_text(SECRET)
    k = LogKeeper(kept, max_bytes=4000, thread=False)
    k.write({(3, 30, 0): [f"first {i:03d} ......" for i in range(100)]})  # ~2 kB
    path = rank_log_path(kept, 3, 30, 0)
    path.with_name("rank-0.log.cut").symlink_to(secret)
    path.with_name("rank-0.log.dropped.tmp").symlink_to(other)
    for b in range(5):  # past the cap: cut, sidecar written
        k.write({(3, 30, 0): [f"b{b} {i:03d} ........" for i in range(100)]})
    assert secret.read_text() == SECRET and other.read_text() == SECRET
    assert not path.is_symlink() and path.stat().st_size <= 4000
    page = keptlogs.read_page(kept, 3, 30, 0, offset=0, limit=5000)
    assert page["dropped_lines"] > 0 and page["lines"][-1] == "b4 099 ........"
    assert k.stats["lines_cut_by_cap"] == page["dropped_lines"]


def test_the_writer_replaces_a_planted_sidecar_link_without_writing_its_target(tmp_path, secret):
    kept = tmp_path / "kept"
    k = LogKeeper(kept, max_bytes=2000, thread=False)
    k.write({(4, 40, 0): [f"line {i:03d}" for i in range(50)]})
    side = rank_log_path(kept, 4, 40, 0).with_name("rank-0.log.dropped")
    side.symlink_to(secret)
    for b in range(5):
        k.write({(4, 40, 0): [f"more {b} {i:03d}" for i in range(50)]})
    assert secret.read_text() == SECRET
    assert not side.is_symlink() and keptlogs.read_page(kept, 4, 40, 0, offset=0, limit=1)["dropped_lines"] > 0


def test_removing_a_job_never_deletes_through_a_link(tmp_path, secret):
    kept = tmp_path / "kept"
    LogKeeper(kept, thread=False).write({(9, 90, 0): ["stays"]})
    job_log_dir(kept, 8).symlink_to(secret.parent)  # job 8's directory is a link
    keptlogs.remove_job(kept, 8)
    assert secret.read_text() == SECRET and not os.path.lexists(job_log_dir(kept, 8))
    # a link in place of logs/ itself: nothing behind it is deleted
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "job-5" / "attempt-50").mkdir(parents=True)
    (elsewhere / "job-5" / "attempt-50" / "rank-0.log").write_text("not yours\n")
    kept2 = tmp_path / "kept2"
    kept2.mkdir()
    (kept2 / "logs").symlink_to(elsewhere)
    keptlogs.remove_job(kept2, 5)
    assert (elsewhere / "job-5" / "attempt-50" / "rank-0.log").read_text() == "not yours\n"


# ---------------------------------------------------------------- where kept logs live


def test_the_kept_log_root_is_the_control_planes_own(tmp_path, settings):
    env = {"TRAINYARD_VAR_DIR": str(tmp_path / "var"), "TRAINYARD_ARTIFACT_ROOT": str(tmp_path / "shared")}
    assert keys.kept_log_root(env) == (tmp_path / "var" / "keptlogs").resolve()
    for bad in (tmp_path / "shared", tmp_path / "shared" / "logs", tmp_path):
        with pytest.raises(ValueError, match="TRAINYARD_ARTIFACT_ROOT"):
            keys.kept_log_root({**env, "TRAINYARD_KEPT_LOG_ROOT": str(bad)})
    with pytest.raises(ValueError, match="TRAINYARD_CHECKPOINT_ROOT"):
        keys.kept_log_root({**env, "TRAINYARD_KEPT_LOG_ROOT": str(tmp_path / "var" / "checkpoints" / "k")})
    assert keptlogs.default_keeper().root == settings.TRAINYARD_KEPT_LOG_ROOT
    k = LogKeeper(tmp_path / "fresh" / "kept", thread=False)
    k.write({(1, 1, 0): ["x"]})
    assert oct((tmp_path / "fresh" / "kept").stat().st_mode & 0o777) == "0o700"
