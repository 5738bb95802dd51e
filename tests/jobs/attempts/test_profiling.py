"""Profiles of running attempts (services.profiling through attempts_check), the job API's profile,
and POST /api/v1/jobs/<id>/apply_recommendation/ (permissions, refusals that change nothing, the
restart from the latest checkpoint with the new spec)."""
import pytest
from django.contrib.auth.models import Group
from rest_framework.test import APIClient

from jobs import services
from jobs.models import Attempt, Job, JobEvent

from tests.jobs.attempts.test_fault import report_ckpt
from tests.jobs.runs.test_services import start, submit

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("ckpt_root", "relay_alive")]


def api(user):
    c = APIClient()
    c.force_authenticate(user)
    return c


def feed(attempt, steps, *, comm_s=0.04, exposed=0.035, compute_s=0.02, data_s=0.001):
    """Samples of both ranks: step_s = data + compute + exposed comm + optim (5 ms)."""
    services.telemetry_ingest([
        {"rank": r, "step": s, "ts": float(s), "loss": 1.0, "attempt": attempt.pk, "data_s": data_s,
         "compute_s": compute_s, "comm_s": comm_s, "optim_s": 0.005, "step_s": data_s + compute_s + exposed + 0.005}
        for s in steps for r in (0, 1)], events=[])


def comm_bound_job(user, ckpt_root):
    job = submit(user, model={"hidden": 256, "heads": 4, "layers": 2, "seq_len": 64},
                 train={"steps": 100, "global_batch": 8}, checkpoint={"every_steps": 10})
    attempt = start(job)
    feed(attempt, range(1, 21))
    report_ckpt(ckpt_root, job, attempt, 10)
    services.attempts_check()
    attempt.refresh_from_db()
    return job, attempt


def test_attempts_check_profiles_the_attempt_and_records_class_changes(user, nodes, ckpt_root, sent,
                                                                        django_capture_on_commit_callbacks):
    job = submit(user)
    attempt = start(job)
    feed(attempt, range(1, 4))
    assert services.attempts_check()["profiles"] == {attempt.pk: "unknown"}
    assert not JobEvent.objects.filter(job=job, kind="profile").exists()  # not enough telemetry: no event
    body = api(user).get(f"/api/v1/jobs/{job.pk}/").json()
    assert body["profile"]["class"] == "unknown" and "not enough telemetry" in body["profile"]["reason"]
    with django_capture_on_commit_callbacks(execute=True):
        feed(attempt, range(4, 21))
        assert services.attempts_check()["profiles"] == {attempt.pk: "communication"}
    ev = JobEvent.objects.get(job=job, kind="profile")
    assert ev.data["class"] == "communication" and ev.data["previous"] == "unknown"
    assert ev.message.startswith("communication-bound (compute") and "powersgd" in ev.message
    published = [m for c, g, m in (x for x in sent if x[0] == "publish") if m["type"] == "job.profile"]
    assert published and published[-1]["profile"]["class"] == "communication"
    body = api(user).get(f"/api/v1/jobs/{job.pk}/").json()
    p = body["profile"]
    assert p["attempt"] == attempt.pk and p["shares"]["communication"] > 0.5
    assert p["recommendation"]["change"]["comm.compression"] == "powersgd"
    assert p["recommendation"]["predicted_gain"] > 0.5
    assert body["attempts"][0]["profile"]["class"] == "communication"
    # a still communication-bound window: no second event, and an unchanged profile is not rewritten
    sent.clear()
    feed(attempt, range(21, 23))
    with django_capture_on_commit_callbacks(execute=True):
        services.attempts_check()
    assert JobEvent.objects.filter(job=job, kind="profile").count() == 1
    # between the thresholds (share ~0.26): stays communication-bound (hysteresis)
    feed(attempt, range(23, 60), comm_s=0.03, exposed=0.01)
    services.attempts_check()
    assert Attempt.objects.get(pk=attempt.pk).profile["class"] == "communication"
    feed(attempt, range(60, 90), comm_s=0.01, exposed=0.002)
    services.attempts_check()
    assert Attempt.objects.get(pk=attempt.pk).profile["class"] == "compute"
    assert [e.data["class"] for e in JobEvent.objects.filter(job=job, kind="profile")] == ["communication", "compute"]


def test_apply_restarts_from_the_latest_checkpoint_with_the_change(user, nodes, ckpt_root, sent,
                                                                   django_capture_on_commit_callbacks):
    job, attempt = comm_bound_job(user, ckpt_root)
    c20 = report_ckpt(ckpt_root, job, attempt, 20)
    change = attempt.profile["recommendation"]["change"]
    with django_capture_on_commit_callbacks(execute=True):
        r = api(user).post(f"/api/v1/jobs/{job.pk}/apply_recommendation/", {"change": change}, format="json")
    assert r.status_code == 202, r.content
    body = r.json()
    assert body["status"] == "STOPPING" and body["spec"]["comm"]["compression"] == "powersgd"
    assert body["plan"]["compression"] == "powersgd" and "restarting from step 20" in body["status_reason"]
    assert {c[1] for c in sent if c[0] == "stop" and c[3] == "rollback"} == {"node-a", "node-b"}
    ev = JobEvent.objects.get(job=job, kind="recommendation_applied")
    assert ev.actor == user and ev.data["before"] == {"comm.compression": "none"}
    assert ev.data["after"] == {"comm.compression": "powersgd"} and ev.data["step"] == 20
    for n in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=n, result={"exit_code": -15, "stopped": True, "failures": []})
    attempt.refresh_from_db()
    assert attempt.outcome == "rolled_back" and Job.objects.get(pk=job.pk).status == "QUEUED"
    with django_capture_on_commit_callbacks(execute=True):
        second = start(job)
    assert second.resumed_from_id == c20.pk and second.resumed_from_step == 20
    launch = [c[2] for c in sent if c[0] == "launch" and c[2]["attempt_id"] == second.pk]
    assert launch and launch[0]["spec"]["comm"]["compression"] == "powersgd"
    assert second.profile == {}  # the new attempt is profiled afresh
    # its first profile measures the change against the step time before and the prediction
    feed(second, range(21, 45), comm_s=0.001, exposed=0.0)
    services.attempts_check()
    result = JobEvent.objects.get(job=job, kind="recommendation_result")
    before = ev.data["step_s"]
    assert before == pytest.approx(0.061, abs=1e-4) and result.data["step_s_after"] == pytest.approx(0.026, abs=1e-4)
    assert result.data["measured_gain"] == pytest.approx(before / 0.026 - 1, abs=1e-3)
    assert result.data["predicted_gain"] == ev.data["predicted_gain"] and result.attempt_id == second.pk
    assert "comm.compression powersgd: 26.0 ms a step, was 61.0 ms (speed +135%; predicted" in result.message
    feed(second, range(45, 70), comm_s=0.001, exposed=0.0)
    services.attempts_check()
    assert JobEvent.objects.filter(job=job, kind="recommendation_result").count() == 1


def test_team_member_and_staff_may_apply_others_may_not_see_it(user, other, staff, nodes, ckpt_root):
    job, attempt = comm_bound_job(user, ckpt_root)
    url = f"/api/v1/jobs/{job.pk}/apply_recommendation/"
    assert api(other).post(url, {}, format="json").status_code == 404  # not their job or team
    assert Job.objects.get(pk=job.pk).status == "RUNNING"
    team = Group.objects.create(name="vision")
    user.groups.add(team)
    other.groups.add(team)
    Job.objects.filter(pk=job.pk).update(team=team)
    assert api(other).post(url, {}, format="json").status_code == 202
    job2, _ = comm_bound_job(user, ckpt_root)
    assert api(staff).post(f"/api/v1/jobs/{job2.pk}/apply_recommendation/", {}, format="json").status_code == 202
    anon = APIClient().post(url, {}, format="json")
    assert anon.status_code in (401, 403)


def test_browser_session_needs_csrf(user, nodes, ckpt_root):
    job, _ = comm_bound_job(user, ckpt_root)
    c = APIClient(enforce_csrf_checks=True)
    c.force_login(user)
    r = c.post(f"/api/v1/jobs/{job.pk}/apply_recommendation/", {}, format="json")
    assert r.status_code == 403 and Job.objects.get(pk=job.pk).status == "RUNNING"


def _unchanged(job, attempt):
    j = Job.objects.get(pk=job.pk)
    assert j.status == "RUNNING" and j.spec == job.spec
    assert Attempt.objects.get(pk=attempt.pk).stop_reason == ""
    assert not JobEvent.objects.filter(job=job, kind="recommendation_applied").exists()


def test_refusals_change_nothing(user, nodes, ckpt_root):
    job, attempt = comm_bound_job(user, ckpt_root)
    url = f"/api/v1/jobs/{job.pk}/apply_recommendation/"
    c = api(user)
    r = c.post(url, {"change": "powersgd"}, format="json")
    assert r.status_code == 400 and "must be an object" in r.json()["errors"]["change"][0]
    r = c.post(url, {"change": {"comm.compression": "bf16"}}, format="json")
    assert r.status_code == 409 and "changed to" in r.json()["errors"]["change"][0]
    _unchanged(job, attempt)
    # a recommendation that the spec refuses (compression under tp) is a 400 naming the field
    bad = {**attempt.profile, "recommendation": {**attempt.profile["recommendation"],
                                                 "change": {"comm.compression": "powersgd", "parallel.tp": 2}}}
    Attempt.objects.filter(pk=attempt.pk).update(profile=bad)
    r = c.post(url, {}, format="json")
    assert r.status_code == 400, r.content
    assert "comm.compression" in r.json()["errors"] or "parallel.dp" in r.json()["errors"]
    _unchanged(job, attempt)
    none = {**attempt.profile, "recommendation": {**attempt.profile["recommendation"], "change": None}}
    Attempt.objects.filter(pk=attempt.pk).update(profile=none)
    r = c.post(url, {}, format="json")
    assert r.status_code == 409 and "recommends no spec change" in r.json()["errors"]["recommendation"][0]
    _unchanged(job, attempt)


def test_no_checkpoint_or_not_running_is_409(user, nodes, ckpt_root):
    job = submit(user, model={"hidden": 256, "heads": 4, "layers": 2, "seq_len": 64},
                 train={"steps": 100, "global_batch": 8})
    url = f"/api/v1/jobs/{job.pk}/apply_recommendation/"
    r = api(user).post(url, {}, format="json")  # queued
    assert r.status_code == 409 and "running job" in r.json()["errors"]["status"][0]
    attempt = start(job)
    feed(attempt, range(1, 21))
    services.attempts_check()
    r = api(user).post(url, {}, format="json")
    assert r.status_code == 409 and "no checkpoint yet" in r.json()["errors"]["checkpoint"][0]
    _unchanged(job, attempt)
