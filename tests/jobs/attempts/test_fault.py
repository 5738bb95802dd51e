"""Checkpoints, restarts from them, rollback, quarantine, hangs and stragglers (services + API)."""
import json
import time
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from jobs.attempts import selectors
from jobs import services
from jobs.models import Attempt, Checkpoint, Job, JobEvent, MetricSample, Node

from tests.jobs.runs.test_services import start, submit
from tests.nodes import node_up

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("ckpt_root", "relay_alive")]


def signed(manifest: dict, attempt) -> dict:
    """The manifest with the proof the attempt's ranks add (its key from the sealed Launch)."""
    from jobs.attempts.services.busaccess import attempt_secrets
    from trainyard import attemptauth

    body = {k: v for k, v in manifest.items() if k != "proof"}
    return {**body, "proof": attemptauth.manifest_proof(attempt_secrets(attempt).proof_key, body)}


def write_ckpt(root, job, attempt, step, manifest=True):
    d = root / f"job-{job.pk}" / f"step-{step:08d}-a{attempt.pk}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * 100)
    if manifest:
        (d / "trainyard.json").write_text(json.dumps(signed({
            "format": 1, "job_id": job.pk, "attempt_id": attempt.pk, "step": step, "world_size": 2,
            "size_bytes": 100, "blocking_s": 0.01, "save_s": 0.2}, attempt)))
    return d


def report_ckpt(root, job, attempt, step):
    d = write_ckpt(root, job, attempt, step)
    services.telemetry_ingest([], events=[{"kind": "checkpoint", "rank": 0, "attempt": attempt.pk, "step": step,
                                           "path": str(d), "size_bytes": 100, "blocking_s": 0.01, "save_s": 0.2}])
    return Checkpoint.objects.get(path=str(d.resolve()))


def kill(attempt, node="node-a", rank=0):
    for n in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=n, result={
            "node": n, "exit_code": -9 if n == node else 1, "stopped": n != node, "failures": [
                {"rank": rank, "timestamp": 1.0, "message": "Signal 9 (SIGKILL) received", "traceback": "",
                 "signal": "SIGKILL"}] if n == node else []})


def ok_exit(attempt):
    for n in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=n, result={"exit_code": 0, "stopped": False, "failures": []})


# ---------------------------------------------------------------- checkpoints and restart

def test_checkpoint_event_registers_once_and_retention_deletes_old_files(user, nodes, ckpt_root, sent,
                                                                         django_capture_on_commit_callbacks):
    job = submit(user, checkpoint={"every_steps": 10, "keep": 2})
    attempt = start(job)
    with django_capture_on_commit_callbacks(execute=True):
        cps = [report_ckpt(ckpt_root, job, attempt, s) for s in (10, 20, 30)]
        # the same report again (a replayed stream entry) is a no-op
        services.checkpoint_register(attempt.pk, data={"step": 30, "path": cps[2].path})
    assert Checkpoint.objects.filter(job=job).count() == 3
    cps[0].refresh_from_db()
    assert cps[0].deleted_at is not None and not ckpt_root.joinpath(f"job-{job.pk}").joinpath(
        f"step-00000010-a{attempt.pk}").exists()
    assert Checkpoint.objects.filter(job=job, deleted_at__isnull=True).count() == 2
    msgs = [c[2] for c in sent if c[0] == "publish" and c[2].get("type") == "job.checkpoint"]
    assert {m["checkpoint"]["step"] for m in msgs} == {10, 20, 30} and any(m["checkpoint"]["deleted"] for m in msgs)


def test_checkpoint_outside_the_job_dir_is_refused(user, nodes, tmp_path):
    job = submit(user)
    attempt = start(job)
    assert services.checkpoint_register(attempt.pk, data={"step": 5, "path": str(tmp_path / "elsewhere")}) is None
    other = tmp_path / "ckpt" / "job-999" / "step-00000005-a1"
    assert services.checkpoint_register(attempt.pk, data={"step": 5, "path": str(other)}) is None
    assert not Checkpoint.objects.exists()


def test_restart_resumes_from_latest_checkpoint_found_on_disk(user, nodes, ckpt_root, sent,
                                                              django_capture_on_commit_callbacks):
    """A checkpoint whose report never arrived (Redis lost it) is registered from its manifest."""
    job = submit(user, max_restarts=2)
    attempt = start(job)
    report_ckpt(ckpt_root, job, attempt, 10)
    write_ckpt(ckpt_root, job, attempt, 20)            # complete, never reported
    write_ckpt(ckpt_root, job, attempt, 30, manifest=False)  # half-written: not a checkpoint
    kill(attempt)
    job.refresh_from_db()
    assert job.status == "QUEUED" and job.restarts == 1
    restart = job.events.get(kind="restart")
    assert restart.data["resume_step"] == 20 and "from the checkpoint at step 20" in restart.message
    sent.clear()
    with django_capture_on_commit_callbacks(execute=True):
        second = start(job)
    assert second.number == 2 and second.resumed_from_step == 20 and second.resumed_from.step == 20
    launch = [c[2] for c in sent if c[0] == "launch"]
    assert {p["resume"]["step"] for p in launch} == {20} and launch[0]["resume"]["path"].endswith(
        f"step-00000020-a{attempt.pk}")
    assert Job.objects.get(pk=job.pk).step == 20


def test_metrics_show_each_step_once_after_a_restart(user, nodes, ckpt_root):
    job = submit(user, max_restarts=1)
    first = start(job)

    def samples(attempt, steps):
        return [{"rank": r, "step": s, "ts": float(s), "loss": float(attempt.number), "attempt": attempt.pk}
                for s in steps for r in (0, 1)]

    services.telemetry_ingest(samples(first, range(1, 16)), events=[])
    report_ckpt(ckpt_root, job, first, 10)
    kill(first)
    second = start(job)
    services.telemetry_ingest(samples(second, range(11, 21)), events=[])
    c = APIClient()
    c.force_authenticate(user)
    rows = c.get(f"/api/v1/jobs/{job.pk}/metrics/?rank=0&limit=100").json()
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert {r["attempt"] for r in rows if r["step"] > 10} == {second.pk}
    raw = c.get(f"/api/v1/jobs/{job.pk}/metrics/?rank=0&limit=100&attempt={first.pk}").json()
    assert [r["step"] for r in raw] == list(range(1, 16))


# ---------------------------------------------------------------- rollback

@pytest.fixture
def staff_api(staff):
    c = APIClient()
    c.force_authenticate(staff)
    return c


def test_rollback_running_job_stops_it_supersedes_later_and_resumes(user, staff, nodes, ckpt_root, sent, staff_api,
                                                                    django_capture_on_commit_callbacks):
    job = submit(user, checkpoint={"every_steps": 10, "keep": 5})
    attempt = start(job)
    c10, c20, c30 = (report_ckpt(ckpt_root, job, attempt, s) for s in (10, 20, 30))
    with django_capture_on_commit_callbacks(execute=True):
        r = staff_api.post(f"/api/v1/jobs/{job.pk}/rollback/", {"checkpoint": c10.pk}, format="json")
    assert r.status_code == 202, r.content
    assert r.json()["status"] == "STOPPING"
    assert {c[1] for c in sent if c[0] == "stop" and c[3] == "rollback"} == {"node-a", "node-b"}
    assert [c.superseded for c in Checkpoint.objects.filter(job=job).order_by("step")] == [False, True, True]
    # a save that finishes late in the stopping attempt belongs to the discarded future
    late = report_ckpt(ckpt_root, job, attempt, 40)
    assert late.superseded
    for n in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=n, result={"exit_code": -15, "stopped": True, "failures": []})
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.outcome == "rolled_back" and job.status == "QUEUED"
    second = start(job)
    assert second.resumed_from_id == c10.pk and second.resumed_from_step == 10
    ev = JobEvent.objects.get(job=job, kind="rollback")
    assert ev.actor == staff and ev.data["step"] == 10 and sorted(ev.data["superseded"]) == sorted([c20.pk, c30.pk])
    listing = staff_api.get(f"/api/v1/jobs/{job.pk}/checkpoints/").json()
    assert listing["count"] == 4 and [x["step"] for x in listing["results"]] == [40, 30, 20, 10]
    assert listing["results"][3]["superseded"] is False and listing["results"][0]["superseded"] is True


def test_rollback_of_finished_job_runs_it_again(user, nodes, ckpt_root, staff_api):
    job = submit(user)
    attempt = start(job)
    c10 = report_ckpt(ckpt_root, job, attempt, 10)
    ok_exit(attempt)
    assert Job.objects.get(pk=job.pk).status == "SUCCEEDED"
    r = staff_api.post(f"/api/v1/jobs/{job.pk}/rollback/", {"checkpoint": c10.pk}, format="json")
    assert r.status_code == 202 and r.json()["status"] == "QUEUED" and r.json()["finished_at"] is None
    second = start(job)
    assert second.resumed_from_id == c10.pk and Job.objects.get(pk=job.pk).status == "RUNNING"


def test_rollback_bad_input_is_400_and_changes_nothing(user, other, nodes, ckpt_root, staff_api):
    job = submit(user)
    attempt = start(job)
    r = staff_api.post(f"/api/v1/jobs/{job.pk}/rollback/", {"checkpoint": 1}, format="json")
    assert r.status_code == 400 and "no checkpoints" in r.json()["errors"]["checkpoint"][0]
    c10 = report_ckpt(ckpt_root, job, attempt, 10)
    job2 = submit(other)  # stays queued: a checkpoint row of another job is enough
    foreign = Checkpoint.objects.create(job=job2, step=5, path=str(ckpt_root / f"job-{job2.pk}" / "step-5"))
    for payload, fragment in (({"checkpoint": foreign.pk}, "not a checkpoint of job"),
                              ({"checkpoint": 999999}, "not a checkpoint of job"),
                              ({"checkpoint": "abc"}, "must be the id"),
                              ({"checkpoint": True}, "must be the id"),
                              ({}, "required")):
        r = staff_api.post(f"/api/v1/jobs/{job.pk}/rollback/", payload, format="json")
        assert r.status_code == 400 and fragment in r.json()["errors"]["checkpoint"][0], (payload, r.content)
    Checkpoint.objects.filter(pk=c10.pk).update(superseded=True, deleted_at=timezone.now())
    r = staff_api.post(f"/api/v1/jobs/{job.pk}/rollback/", {"checkpoint": c10.pk}, format="json")
    assert r.status_code == 400 and "deleted by retention" in r.json()["errors"]["checkpoint"][0]
    job.refresh_from_db()
    assert job.status == "RUNNING" and not JobEvent.objects.filter(kind="rollback").exists()
    assert Attempt.objects.get(pk=attempt.pk).stop_reason == ""


def test_rollback_and_pin_and_clear_are_staff_only(user, nodes, ckpt_root):
    job = submit(user)
    attempt = start(job)
    c10 = report_ckpt(ckpt_root, job, attempt, 10)
    c = APIClient()
    c.force_authenticate(user)  # the owner, not staff
    assert c.post(f"/api/v1/jobs/{job.pk}/rollback/", {"checkpoint": c10.pk}, format="json").status_code == 403
    assert c.post(f"/api/v1/jobs/{job.pk}/checkpoints/{c10.pk}/pin/", {"pinned": True},
                  format="json").status_code == 403
    assert c.post("/api/v1/nodes/node-a/clear/").status_code == 403
    assert c.get(f"/api/v1/jobs/{job.pk}/checkpoints/").status_code == 200  # reading is fine
    assert Job.objects.get(pk=job.pk).status == "RUNNING" and not Checkpoint.objects.get(pk=c10.pk).pinned


def test_pinned_checkpoint_survives_retention(user, nodes, ckpt_root, staff_api, django_capture_on_commit_callbacks):
    job = submit(user, checkpoint={"every_steps": 10, "keep": 1})
    attempt = start(job)
    c10 = report_ckpt(ckpt_root, job, attempt, 10)
    r = staff_api.post(f"/api/v1/jobs/{job.pk}/checkpoints/{c10.pk}/pin/", {"pinned": True}, format="json")
    assert r.status_code == 200 and r.json()["pinned"] is True
    assert staff_api.post(f"/api/v1/jobs/{job.pk}/checkpoints/{c10.pk}/pin/", {"pinned": "yes"},
                          format="json").status_code == 400
    with django_capture_on_commit_callbacks(execute=True):
        report_ckpt(ckpt_root, job, attempt, 20)
        report_ckpt(ckpt_root, job, attempt, 30)
    assert Checkpoint.objects.get(pk=c10.pk).deleted_at is None
    assert Checkpoint.objects.get(job=job, step=20).deleted_at is not None
    with django_capture_on_commit_callbacks(execute=True):
        staff_api.post(f"/api/v1/jobs/{job.pk}/checkpoints/{c10.pk}/pin/", {"pinned": False}, format="json")
    assert Checkpoint.objects.get(pk=c10.pk).deleted_at is not None
    assert not ckpt_root.joinpath(f"job-{job.pk}", f"step-00000010-a{attempt.pk}").exists()


# ---------------------------------------------------------------- quarantine

def test_two_failures_on_one_node_quarantine_it_until_an_admin_clears_it(user, nodes, staff_api):
    job = submit(user, max_restarts=5)
    for _ in range(2):
        kill(start(job), node="node-b", rank=1)
    node = Node.objects.get(name="node-b")
    assert node.status == "QUARANTINED" and node.quarantined_at and "2 failures" in node.quarantine_reason
    assert JobEvent.objects.filter(job=job, kind="node_quarantined").count() == 1
    # no new work goes there, and a heartbeat does not lift it
    node_up({"name": "node-b", "address": "127.0.0.2", "slots": 2})
    services.schedule_tick()
    job.refresh_from_db()
    assert job.status == "QUEUED" and "waiting for nodes" in job.status_reason
    r = staff_api.post("/api/v1/nodes/node-b/clear/")
    assert r.status_code == 200 and r.json()["status"] == "READY" and r.json()["quarantined_at"] is None
    services.schedule_tick()
    assert Job.objects.get(pk=job.pk).status == "STARTING"


def test_user_errors_do_not_count_against_a_node(user, nodes):
    job = submit(user, max_restarts=5)
    for _ in range(2):
        attempt = start(job)
        services.attempt_node_exit(attempt.pk, node_name="node-b", result={
            "node": "node-b", "exit_code": 1, "stopped": False, "failures": [
                {"rank": 1, "timestamp": 1.0, "message": "ValueError: bad", "traceback": ""}]})
        services.attempt_node_exit(attempt.pk, node_name="node-a",
                                   result={"exit_code": -15, "stopped": True, "failures": []})
        Job.objects.filter(pk=job.pk).update(status="QUEUED")
    assert Node.objects.get(name="node-b").status == "READY"


# ---------------------------------------------------------------- hangs and stragglers

def metric(attempt, rank, step, compute_s=0.05, step_s=0.1):
    return {"rank": rank, "step": step, "ts": float(step), "loss": 1.0, "attempt": attempt.pk, "step_s": step_s,
            "data_s": 0.001, "compute_s": compute_s, "optim_s": 0.01, "comm_s": 0.04}


def test_hang_is_detected_stopped_and_restarted(user, nodes, sent, django_capture_on_commit_callbacks):
    job = submit(user, hang_timeout_s=5, max_restarts=1)
    attempt = start(job)
    services.telemetry_ingest([metric(attempt, r, s) for s in range(1, 4) for r in (0, 1)], events=[])
    assert services.attempts_check()["hung"] == []
    Attempt.objects.filter(pk=attempt.pk).update(last_progress_at=timezone.now() - timedelta(seconds=6))
    with django_capture_on_commit_callbacks(execute=True):
        assert services.attempts_check()["hung"] == [attempt.pk]
    assert {c[1] for c in sent if c[0] == "stop" and c[3] == "hang"} == {"node-a", "node-b"}
    ev = JobEvent.objects.get(job=job, kind="hang_detected")
    assert ev.data["evidence"]["last_step"] == 3 and ev.data["evidence"]["timeout_s"] == 5
    for n in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=n, result={"exit_code": -15, "stopped": True, "failures": []})
    attempt.refresh_from_db()
    assert attempt.outcome == "failed:hang" and attempt.failure["class"] == "hang"
    assert Job.objects.get(pk=job.pk).status == "QUEUED"


def test_no_hang_verdict_while_the_relay_is_down(user, nodes, monkeypatch):

    monkeypatch.setattr(selectors, "relay_alive", lambda: False)
    job = submit(user, hang_timeout_s=5)
    attempt = start(job)
    Attempt.objects.filter(pk=attempt.pk).update(last_progress_at=timezone.now() - timedelta(seconds=60), last_step=3)
    assert services.attempts_check()["hung"] == []


def test_straggler_is_flagged_with_its_node_and_cleared_on_recovery(user, nodes, staff_api):
    job = submit(user)
    attempt = start(job)
    services.telemetry_ingest([metric(attempt, r, s, compute_s=0.08 if r == 1 else 0.05)
                               for s in range(1, 21) for r in (0, 1)], events=[])
    assert services.attempts_check()["stragglers"] == {attempt.pk: [1]}
    body = staff_api.get(f"/api/v1/jobs/{job.pk}/").json()
    assert body["stragglers"][0]["rank"] == 1 and body["stragglers"][0]["node"] == "node-b"
    assert body["stragglers"][0]["ratio"] > 1.2 and body["health"]["hang_timeout_source"] == "auto"
    ev = JobEvent.objects.get(job=job, kind="straggler")
    assert "rank 1 on node-b" in ev.message
    services.attempts_check()  # still slow: no second event
    assert JobEvent.objects.filter(job=job, kind="straggler").count() == 1
    services.telemetry_ingest([metric(attempt, r, s) for s in range(21, 41) for r in (0, 1)], events=[])
    assert services.attempts_check()["stragglers"] == {}
    assert JobEvent.objects.filter(job=job, kind="straggler_cleared").count() == 1
    assert staff_api.get(f"/api/v1/jobs/{job.pk}/").json()["stragglers"] == []
    assert MetricSample.objects.filter(attempt=attempt).count() == 80


def test_events_timeline_api_lists_decisions_with_evidence(user, other, nodes):
    job = submit(user, max_restarts=1)
    kill(start(job), node="node-b", rank=1)
    c = APIClient()
    c.force_authenticate(user)
    body = c.get(f"/api/v1/jobs/{job.pk}/events/").json()
    kinds = [e["kind"] for e in body["results"]]
    assert kinds[:4] == ["submitted", "attempt_started", "running", "attempt_ended"] and "restart" in kinds
    ended = body["results"][3]
    assert ended["data"]["evidence"]["class"] == "signal" and ended["data"]["evidence"]["node"] == "node-b"
    c.force_authenticate(other)
    assert c.get(f"/api/v1/jobs/{job.pk}/events/").status_code == 404


def abort(attempt, node, rank, tail):
    """A rank aborted (SIGABRT, no error file): only its log tail in the node's exit report says why."""
    for n in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=n, result={
            "node": n, "exit_code": -6 if n == node else 1, "stopped": n != node, "failures": [
                {"rank": rank, "timestamp": 1.0, "message": "Signal 6 (SIGABRT) received by PID 7", "traceback": None,
                 "signal": "SIGABRT"}] if n == node else [],
            "log_tail": {str(rank): tail} if n == node else {}})


def test_a_gpu_fault_in_a_ranks_log_tail_avoids_and_quarantines_its_node_and_an_assert_fails_the_job(user, nodes):
    job = submit(user, max_restarts=5)
    attempt = start(job)
    abort(attempt, "node-b", 1, ["  what():  CUDA error: uncorrectable ECC error encountered"])
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert (attempt.failure["class"], attempt.failure["node"], job.avoid_nodes) == ("hardware", "node-b", ["node-b"])
    abort(start(job), "node-b", 1, ["NVRM: Xid (PCI:0000:3b:00): 79, pid=7, GPU has fallen off the bus."])
    assert Node.objects.get(name="node-b").status == "QUARANTINED"
    Node.objects.filter(name="node-b").update(status="READY", quarantined_at=None)
    job = submit(user, max_restarts=5)
    attempt = start(job)
    abort(attempt, "node-a", 0, ["  what():  [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread "
                                 "terminated with exception: CUDA error: device-side assert triggered"])
    attempt.refresh_from_db()
    assert attempt.failure["class"] == "user_error" and Job.objects.get(pk=job.pk).status == "FAILED"


def test_no_idle_time_counts_from_before_the_relay_started(user, nodes, sent, monkeypatch,
                                                          django_capture_on_commit_callbacks):
    """A restarted relay commits what the ranks trained while none ran only after it started: the
    hang detector counts idle time from the relay's start, not from the last committed step (CI
    saw a healthy job stopped as hung while a restarted relay caught up on PostgreSQL)."""
    job = submit(user, hang_timeout_s=5)
    attempt = start(job)
    Attempt.objects.filter(pk=attempt.pk).update(last_progress_at=timezone.now() - timedelta(seconds=60), last_step=3)
    monkeypatch.setattr(selectors, "relay_alive", lambda: time.time() - 2)  # started 2 s ago
    assert services.attempts_check()["hung"] == []
    monkeypatch.setattr(selectors, "relay_alive", lambda: time.time() - 30)  # up for 30 s, still no step
    with django_capture_on_commit_callbacks(execute=True):
        assert services.attempts_check()["hung"] == [attempt.pk]
