"""Elastic jobs through the services (issue 24, section 2), on the database: an elastic job starts
on the free node when the other is busy and its launches carry the spec on that count (dp
follows, global batch kept); it grows when the node frees (a cooperative stop that restarts at
once on two nodes, a `resized` event with the reason, the node count over time on the job);
a lost node restarts it at once on the survivor without counting a restart; reclaim for a team
over its quota shrinks it to its least nodes instead of stopping it."""
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import services
from jobs.models import Job, Node, Quota

from tests.jobs.runs.test_services import start, submit
from tests.jobs.scheduling.test_scheduling import finish_preempted

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("healthy_control_plane")]

ELASTIC = {"resources": {"nodes": {"min": 1, "max": 2}, "procs_per_node": 2},
           "train": {"steps": 1_000_000, "global_batch": 16}}
BUSY = {"resources": {"nodes": 1, "procs_per_node": 2}, "train": {"steps": 1_000_000, "global_batch": 16}}


def launches(sent, job):
    return [p for kind, *rest in sent if kind == "launch" for node, p in [rest] if p["job_id"] == job.pk]


@pytest.fixture
def grow_now(settings):
    settings.TRAINYARD_ELASTIC_GROW_MIN_S = 0


def test_starts_on_one_node_then_grows_to_two(user, nodes, sent, preempts, grow_now, client_for, client,
                                             django_capture_on_commit_callbacks):
    busy = submit(user, **BUSY)
    busy_attempt = start(busy)
    with django_capture_on_commit_callbacks(execute=True):
        job = submit(user, **ELASTIC)
        first = start(job)
    assert job.status == "RUNNING" and first.allocations.count() == 1
    (launch,) = launches(sent, job)
    assert launch["nnodes"] == 1 and launch["spec"]["resources"]["nodes"] == 1
    assert launch["spec"]["train"]["global_batch"] == 16 and launch["spec"]["parallel"].get("dp") in (None, 2)
    assert job.events.get(kind="resized").data["nodes"] == 1
    assert "started on 1 of 2 nodes" in job.node_history[0]["reason"]

    services.schedule_tick()
    assert not preempts  # node-b is busy: nothing to grow onto
    busy_attempt.allocations.update(active=False)  # the busy job's node frees
    services.schedule_tick()
    first.refresh_from_db()
    assert first.stop_reason == "preempt" and "growing from 1 to 2" in first.preempt_reason
    assert Job.objects.get(pk=job.pk).elastic_restart
    finish_preempted(first)
    with django_capture_on_commit_callbacks(execute=True):
        services.schedule_tick()
    job.refresh_from_db()
    second = job.attempts.order_by("-number").first()
    assert job.status == "STARTING" and second.number == 2 and second.allocations.count() == 2
    assert [h["nodes"] for h in job.node_history] == [1, 2] and not job.elastic_restart
    resized = job.events.filter(kind="resized").order_by("id").last()
    assert resized.data["previous"] == 1 and "growing from 1 to 2" in resized.data["reason"]
    assert {p["spec"]["resources"]["nodes"] for p in launches(sent, job)[1:]} == {2}
    # the API and the job page show the node count over time
    got = client_for(user).get(f"/api/v1/jobs/{job.pk}/").json()
    assert [h["nodes"] for h in got["node_history"]] == [1, 2]
    client.force_login(user)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="nodes-over-time"' in page and "<polyline" in page and "growing from 1 to 2" in page


def test_a_lost_node_shrinks_it_at_once_without_a_restart(user, nodes, sent, django_capture_on_commit_callbacks):
    job = submit(user, **ELASTIC)
    attempt = start(job)
    assert attempt.allocations.count() == 2
    Node.objects.filter(name="node-b").update(last_heartbeat=timezone.now() - timedelta(seconds=60))
    with django_capture_on_commit_callbacks(execute=True):
        assert services.nodes_check() == ["node-b"]
    services.attempt_node_exit(attempt.pk, node_name="node-a", result={"exit_code": -15, "stopped": True,
                                                                       "failures": []})
    job.refresh_from_db()
    assert job.status == "QUEUED" and job.restarts == 0 and job.elastic_restart
    assert job.events.filter(kind="shrinking").exists()
    services.schedule_tick()
    job.refresh_from_db()
    second = job.attempts.order_by("-number").first()
    assert job.status == "STARTING" and [a.node.name for a in second.allocations.all()] == ["node-a"]
    resized = job.events.filter(kind="resized").get()
    assert resized.data["nodes"] == 1 and "node-b was lost" in resized.data["reason"]


def test_reclaim_shrinks_a_borrowing_elastic_job(user, other, teams, nodes, sent, preempts):
    Quota.objects.create(team=teams[0], max_slots=2)
    Quota.objects.create(team=teams[1], max_slots=2)
    job = submit(user, **ELASTIC)  # vision borrows node-b
    attempt = start(job)
    assert attempt.allocations.count() == 2 and Job.objects.get(pk=job.pk).borrowing
    theirs = submit(other, **BUSY)
    services.schedule_tick()
    attempt.refresh_from_db()
    assert attempt.stop_reason == "preempt" and attempt.preempt_for == theirs.pk
    assert "shrinking to 1 node(s)" in attempt.preempt_reason
    finish_preempted(attempt)
    services.schedule_tick()
    services.schedule_tick()
    job.refresh_from_db()
    assert Job.objects.get(pk=theirs.pk).status == "STARTING"
    assert job.status == "STARTING" and job.attempts.order_by("-number").first().allocations.count() == 1
    assert [h["nodes"] for h in job.node_history] == [2, 1]


def test_parallel_auto_elastic_job_runs_its_plan_on_every_count(user, nodes, sent,
                                                                django_capture_on_commit_callbacks):
    job = submit(user, resources={"nodes": {"min": 1, "max": 2}, "procs_per_node": 2}, parallel="auto",
                 model={"kind": "gpt", "layers": 2, "hidden": 64, "heads": 2, "seq_len": 64},
                 train={"steps": 100, "global_batch": 16})
    assert job.spec["parallel"].get("dp") is None and job.spec["resources"]["min_nodes"] == 1
    assert job.plan["auto"]  # planned for its most nodes; each attempt's world is planned again
    node_b = Node.objects.get(name="node-b")
    Node.objects.filter(pk=node_b.pk).update(quarantined_at=timezone.now())  # one node left
    with django_capture_on_commit_callbacks(execute=True):
        services.schedule_tick()
    (launch,) = launches(sent, job)
    one = launch["spec"]
    assert launch["nnodes"] == 1 and one["resources"]["nodes"] == 1
    assert one["parallel"]["dp"] * one["parallel"]["tp"] * one["parallel"]["pp"] == 2  # a plan for 2 ranks
    assert one["train"]["global_batch"] == 16


def test_submit_refuses_an_elastic_job_some_count_cannot_run(user, nodes):
    from trainyard.spec import SpecError
    with pytest.raises(SpecError) as e:  # tp 2 over 1 node x 1 process
        submit(user, resources={"nodes": {"min": 1, "max": 2}, "procs_per_node": 1}, parallel={"tp": 2})
    assert "do not split" in str(e.value.errors)
