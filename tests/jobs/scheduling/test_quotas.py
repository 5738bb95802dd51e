"""Quotas (API, audit log, admin), node drain/cordon, cooperative preemption (services)."""
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.attempts import selectors
from jobs import services
from jobs.models import Attempt, Job, JobEvent, Node, Quota, QuotaChange

from tests.jobs.runs.test_services import start, submit
from tests.nodes import node_up

pytestmark = pytest.mark.django_db


def test_quota_put_is_audited_and_listed_with_usage(user, staff, teams, nodes, client_for):
    job = submit(user)
    start(job)
    submit(user)  # queued behind it: 2 slots of demand
    r = client_for(staff).put("/api/v1/quotas/", [{"team": "vision", "max_slots": 4}, {"team": "nlp", "max_slots": 2,
                                                                               "device_hours": 10}], format="json")
    assert r.status_code == 200, r.content
    rows = {row["team"]: row for row in r.json()["results"] if row["team"]}
    assert rows["vision"]["max_slots"] == 4 and rows["vision"]["in_use"] == 2 and rows["vision"]["queued"] == 2
    assert rows["nlp"]["device_hours"] == 10 and rows["nlp"]["in_use"] == 0
    change = QuotaChange.objects.get(subject="team:vision")
    assert change.old is None and change.new == {"max_slots": 4, "device_hours": None} and change.actor == staff
    client_for(staff).put("/api/v1/quotas/", {"team": "vision", "max_slots": 1}, format="json")
    latest = QuotaChange.objects.filter(subject="team:vision").first()
    assert latest.old["max_slots"] == 4 and latest.new["max_slots"] == 1
    assert client_for(user).get("/api/v1/quotas/").status_code == 200  # everyone may read


@pytest.mark.parametrize("payload,field,fragment", [
    ({"team": "vision", "max_slots": -1}, "max_slots", ">= 0"),
    ({"team": "vision", "max_slots": "4"}, "max_slots", "whole number"),
    ({"team": "vision", "max_slots": 2.5}, "max_slots", "whole number"),
    ({"team": "nosuch", "max_slots": 2}, "team", "no team named 'nosuch'"),
    ({"user": "ghost", "max_slots": 2}, "user", "no user named"),
    ({"team": "vision"}, "max_slots", "required"),
    ({"team": "vision", "user": "alice", "max_slots": 1}, "team", "exactly one"),
    ({"team": "vision", "max_slots": 1, "device_hours": -3}, "device_hours", "positive"),
    ({"team": "vision", "max_slots": 1, "colour": "red"}, "colour", "unknown"),
])
def test_bad_quota_is_400_and_changes_nothing(staff, teams, client_for, payload, field, fragment):
    Quota.objects.create(team=teams[0], max_slots=8)
    r = client_for(staff).put("/api/v1/quotas/", payload, format="json")
    assert r.status_code == 400 and fragment in r.json()["errors"][field][0], r.content
    assert Quota.objects.get(team=teams[0]).max_slots == 8 and not QuotaChange.objects.exists()


def test_a_bad_entry_in_a_list_rejects_the_whole_list(staff, teams, client_for):
    r = client_for(staff).put("/api/v1/quotas/", [{"team": "vision", "max_slots": 3}, {"team": "nlp", "max_slots": -2}],
                       format="json")
    assert r.status_code == 400 and "1.max_slots" in r.json()["errors"]
    assert not Quota.objects.exists()


def test_quota_and_node_controls_are_staff_only(user, teams, nodes, client_for):
    c = client_for(user)
    assert c.put("/api/v1/quotas/", {"team": "vision", "max_slots": 3}, format="json").status_code == 403
    for action in ("drain", "cordon", "uncordon", "clear"):
        assert c.post(f"/api/v1/nodes/node-a/{action}/", {"mode": "finish"}, format="json").status_code == 403
    assert not Quota.objects.exists() and Node.objects.get(name="node-a").status == "READY"


def test_django_admin_quota_edit_is_audited(client, staff, teams):
    staff.is_superuser = True
    staff.save()
    client.force_login(staff)
    r = client.post("/admin/jobs/quota/add/", {"team": teams[1].pk, "max_slots": 6, "device_hours": ""})
    assert r.status_code == 302, r.content[:2000]
    assert QuotaChange.objects.get(subject="team:nlp").new == {"max_slots": 6, "device_hours": None}


# ---------------------------------------------------------------- drain / cordon

def test_cordon_and_drain_finish_stop_new_work_but_not_running_jobs(user, staff, nodes, client_for, sent):
    job = submit(user, resources={"nodes": 1, "procs_per_node": 2}, parallel={"dp": 2})
    attempt = start(job)
    node = attempt.allocations.get().node.name
    r = client_for(staff).post(f"/api/v1/nodes/{node}/drain/", {"mode": "finish"}, format="json")
    assert r.status_code == 200 and r.json()["status"] == "DRAINING" and r.json()["drain_mode"] == "finish"
    assert not [c for c in sent if c[0] == "stop"]
    assert Attempt.objects.get(pk=attempt.pk).stop_reason == ""
    other = "node-b" if node == "node-a" else "node-a"
    client_for(staff).post(f"/api/v1/nodes/{other}/cordon/")
    second = submit(user, resources={"nodes": 1, "procs_per_node": 1}, parallel={"dp": 1},
                    train={"global_batch": 8})
    services.schedule_tick()
    assert Job.objects.get(pk=second.pk).status == "QUEUED"
    # a heartbeat does not undo it; uncordon does
    node_up({"name": other, "address": "127.0.0.9", "slots": 2})
    assert Node.objects.get(name=other).status == "CORDONED"
    assert client_for(staff).post(f"/api/v1/nodes/{other}/uncordon/").json()["status"] == "READY"
    services.schedule_tick()
    assert Job.objects.get(pk=second.pk).status == "STARTING"


def test_drain_bad_input(staff, nodes, client_for):
    assert client_for(staff).post("/api/v1/nodes/node-a/drain/", {"mode": "later"}, format="json").status_code == 400
    assert client_for(staff).post("/api/v1/nodes/node-a/drain/", {}, format="json").status_code == 400
    r = client_for(staff).post("/api/v1/nodes/nope/drain/", {"mode": "finish"}, format="json")
    assert r.status_code == 404 and r.json()["errors"]["node"] == ["no node named 'nope'"]
    assert Node.objects.get(name="node-a").status == "READY"


def test_drain_preempt_checkpoints_running_attempts_away(user, staff, nodes, client_for, sent, monkeypatch,
                                                         django_capture_on_commit_callbacks):
    from jobs.core import dispatch

    asked = []
    monkeypatch.setattr(dispatch, "request_preempt", lambda a, reason, grace: asked.append((a, reason)))
    job = submit(user)
    attempt = start(job)
    with django_capture_on_commit_callbacks(execute=True):
        client_for(staff).post("/api/v1/nodes/node-a/drain/", {"mode": "preempt"}, format="json")
    assert asked and asked[0][0] == attempt.pk and "drained by root" in asked[0][1]
    attempt.refresh_from_db()
    assert attempt.stop_reason == "preempt" and attempt.status == "RUNNING"
    assert not [c for c in sent if c[0] == "stop"]  # cooperative: the runtime checkpoints and exits
    for n in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=n, result={
            "node": n, "exit_code": 1, "stopped": False, "failures": [
                {"rank": 0, "timestamp": 1.0, "message": "exitcode 83", "traceback": "", "exitcode": 83}]})
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.outcome == "preempted" and job.status == "QUEUED" and job.restarts == 0
    assert "drained by root" in job.status_reason
    ev = JobEvent.objects.get(job=job, kind="preempted")
    assert "drained" in ev.message


def test_preemption_grace_expiry_stops_the_processes(user, nodes, sent, monkeypatch, settings,
                                                     django_capture_on_commit_callbacks):
    from jobs.core import dispatch

    monkeypatch.setattr(dispatch, "request_preempt", lambda *a: None)
    monkeypatch.setattr(selectors, "relay_alive", lambda: True)
    job = submit(user)
    attempt = start(job)
    assert services.attempt_preempt(attempt, reason="test")
    assert not services.attempt_preempt(attempt, reason="again")  # already being preempted
    services.attempts_check()
    assert not [c for c in sent if c[0] == "stop"]
    Attempt.objects.filter(pk=attempt.pk).update(
        preempt_requested_at=timezone.now() - timedelta(seconds=settings.TRAINYARD_PREEMPT_GRACE_S + 1))
    with django_capture_on_commit_callbacks(execute=True):
        services.attempts_check()
    assert {c[1] for c in sent if c[0] == "stop" and c[3] == "preempt"} == {"node-a", "node-b"}
    assert JobEvent.objects.filter(job=job, kind="preempt_forced").exists()


def test_job_finishing_during_its_grace_period_succeeds(user, nodes, monkeypatch):
    from jobs.core import dispatch

    monkeypatch.setattr(dispatch, "request_preempt", lambda *a: None)
    job = submit(user)
    attempt = start(job)
    services.attempt_preempt(attempt, reason="test")
    for n in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=n,
                                   result={"node": n, "exit_code": 0, "stopped": False, "failures": []})
    assert Job.objects.get(pk=job.pk).status == "SUCCEEDED"


def test_non_staff_see_only_their_own_teams_quota_rows(user, other, staff, teams, client_for):
    """GET /api/v1/quotas/ leaked every team's usage to any user (issue 15, section 3); staff see all."""
    Quota.objects.create(team=teams[1], max_slots=2)  # nlp, bob's team
    Quota.objects.create(user=other, max_slots=1)
    Quota.objects.create(user=user, max_slots=3)
    mine = client_for(user).get("/api/v1/quotas/").json()
    assert [(r["team"], r["user"]) for r in mine["results"]] == [("vision", None), (None, "alice")]
    assert mine["count"] == 2
    everyone = client_for(staff).get("/api/v1/quotas/").json()["results"]
    assert {(r["team"], r["user"]) for r in everyone} == {("vision", None), ("nlp", None), (None, "alice"),
                                                          (None, "bob")}
