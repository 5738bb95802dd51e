"""Services against the database; Celery sends are recorded by the `sent` fixture."""
import threading
from datetime import timedelta

import pytest
from django.db import connections
from django.utils import timezone

from jobs import services
from jobs.core.errors import TransitionError
from jobs.models import Allocation, Job, JobEvent, MetricSample, Node
from trainyard.spec import SpecError
from tests.nodes import node_up

pytestmark = pytest.mark.django_db


def submit(user, **kw):
    return services.job_submit(user=user, spec=services.submitted_spec({"name": "t", **kw}))


def ok_result(node, attempt_id):
    return {"attempt_id": attempt_id, "node": node, "exit_code": 0, "signal": None, "stopped": False,
            "failures": [], "log_tail": {}}


def start(job):
    services.schedule_tick()
    job.refresh_from_db()
    attempt = job.attempts.order_by("-number").first()
    for alloc in attempt.allocations.select_related("node"):
        services.attempt_ranks(attempt.pk, node_name=alloc.node.name, ranks=[
            {"rank": alloc.node_rank, "local_rank": 0, "pid": 1000 + alloc.node_rank}])
    job.refresh_from_db()
    return attempt


def test_submit_queues_and_requests_tick(user, nodes, sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        job = submit(user)
    assert job.status == "QUEUED" and job.slots == 2 and job.spec["parallel"]["dp"] == 2
    assert ("tick",) in sent
    assert job.events.filter(kind="submitted").exists()


def test_submit_rejects_job_that_never_fits_and_creates_nothing(user, nodes):
    with pytest.raises(SpecError) as e:
        submit(user, resources={"nodes": 3, "procs_per_node": 1}, parallel={"dp": 3}, train={"global_batch": 30})
    assert "could never run" in e.value.errors["resources"][0]
    assert Job.objects.count() == 0


def test_parallel_auto_resolves_to_data_parallel(user, nodes):
    job = submit(user, parallel="auto")
    assert job.plan["dp"] == 2 and "auto" in job.plan["source"]


def test_full_lifecycle_to_succeeded(user, nodes, sent, django_capture_on_commit_callbacks):
    job = submit(user)
    with django_capture_on_commit_callbacks(execute=True):
        attempt = start(job)
    launches = [c for c in sent if c[0] == "launch"]
    assert [c[1] for c in launches] == ["node-a", "node-b"]
    assert launches[0][2]["rdzv_host"] == "127.0.0.1" and launches[1][2]["local_addr"] == "127.0.0.2"
    assert job.status == "RUNNING"
    services.attempt_node_exit(attempt.pk, node_name="node-a", result=ok_result("node-a", attempt.pk))
    job.refresh_from_db()
    assert job.status == "RUNNING"  # node-b still running
    services.attempt_node_exit(attempt.pk, node_name="node-b", result=ok_result("node-b", attempt.pk))
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.status == "SUCCEEDED" and attempt.outcome == "succeeded"
    assert not Allocation.objects.filter(active=True).exists()
    # a duplicate exit report changes nothing
    services.attempt_node_exit(attempt.pk, node_name="node-b", result=ok_result("node-b", attempt.pk))
    assert Job.objects.get(pk=job.pk).status == "SUCCEEDED"


def test_failure_uses_earliest_failing_rank_and_user_error_fails_fast(user, nodes, sent,
                                                                      django_capture_on_commit_callbacks):
    job = submit(user)
    attempt = start(job)
    with django_capture_on_commit_callbacks(execute=True):
        services.attempt_node_exit(attempt.pk, node_name="node-a", result={
            "exit_code": 1, "stopped": False, "failures": [
                {"rank": 0, "timestamp": 200.0, "message": "RuntimeError: Connection closed by peer",
                 "traceback": "gloo..."}]})
    assert ("stop", "node-b", attempt.pk, "failure") in sent
    services.attempt_node_exit(attempt.pk, node_name="node-b", result={
        "exit_code": 1, "stopped": False, "failures": [
            {"rank": 1, "timestamp": 100.0, "message": "ValueError: bad shape", "traceback": "Traceback..."}]})
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert attempt.outcome == "failed:user_error"
    assert attempt.failure["rank"] == 1 and "bad shape" in attempt.failure["message"]
    assert job.status == "FAILED" and job.restarts == 0


def test_retryable_failure_requeues_until_restarts_run_out(user, nodes):
    job = submit(user, max_restarts=1)
    for expected in ("QUEUED", "FAILED"):
        attempt = start(job)
        for node in ("node-a", "node-b"):
            services.attempt_node_exit(attempt.pk, node_name=node, result={
                "exit_code": -9, "signal": "SIGKILL", "stopped": False, "failures": []})
        job.refresh_from_db()
        assert job.status == expected
    assert job.attempts.count() == 2


def test_cancel_queued_job_is_immediate(user, nodes, sent):
    big = submit(user, resources={"nodes": 2, "procs_per_node": 2}, parallel={"dp": 4})
    start(big)
    queued = submit(user)
    services.schedule_tick()
    assert Job.objects.get(pk=queued.pk).status == "QUEUED"
    services.job_cancel(queued, user=user)
    queued.refresh_from_db()
    assert queued.status == "CANCELLED" and queued.attempts.count() == 0
    assert not [c for c in sent if c[0] == "stop"]


def test_cancel_running_stops_all_nodes_then_cancelled(user, nodes, sent, django_capture_on_commit_callbacks):
    job = submit(user)
    attempt = start(job)
    with django_capture_on_commit_callbacks(execute=True):
        services.job_cancel(job, user=user)
    assert {c[1] for c in sent if c[0] == "stop"} == {"node-a", "node-b"}
    assert Job.objects.get(pk=job.pk).status == "STOPPING"
    for node in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=node,
                                   result={"exit_code": -15, "stopped": True, "failures": []})
    job.refresh_from_db()
    assert job.status == "CANCELLED" and job.attempts.get().outcome == "cancelled"
    with pytest.raises(TransitionError):
        services.job_cancel(job, user=user)


def test_node_lost_ends_attempt_lost_and_requeues(user, nodes, sent, healthy_control_plane,
                                                 django_capture_on_commit_callbacks):
    job = submit(user)
    attempt = start(job)
    Node.objects.filter(name="node-b").update(last_heartbeat=timezone.now() - timedelta(seconds=30))
    with django_capture_on_commit_callbacks(execute=True):
        assert services.nodes_check() == ["node-b"]
    assert Node.objects.get(name="node-b").status == "LOST"
    assert ("stop", "node-a", attempt.pk, "node_lost:node-b") in sent
    services.attempt_node_exit(attempt.pk, node_name="node-a",
                               result={"exit_code": -15, "stopped": True, "failures": []})
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.outcome == "lost" and job.status == "QUEUED" and job.restarts == 1
    # the lost node comes back on its next heartbeat
    node_up({"name": "node-b", "address": "127.0.0.2", "slots": 2})
    assert Node.objects.get(name="node-b").status == "READY"


def test_heartbeat_reports_orphan_attempts(user, nodes):
    _, orphans = node_up({"name": "node-a", "address": "127.0.0.1", "slots": 2, "attempts": [999]})
    assert orphans == [999]


def test_telemetry_ingest_is_idempotent(user, nodes):
    job = submit(user)
    attempt = start(job)
    samples = [{"rank": r, "step": s, "ts": 1.0 * s, "loss": 5.0 - s / 10, "attempt": attempt.pk,
                "samples_per_s": 1.0, "tokens_per_s": 2.0, "step_s": 0.1, "data_s": 0, "compute_s": 0.05,
                "comm_s": 0.01, "optim_s": 0.01, "bytes_sent": 10, "mem_bytes": 20}
               for s in range(1, 6) for r in (0, 1)]
    services.telemetry_ingest(samples, events=[])
    services.telemetry_ingest(samples[:4], events=[{"kind": "telemetry_dropped", "rank": 1, "count": 3,
                                                    "attempt": attempt.pk}])
    assert MetricSample.objects.filter(job=job).count() == 10
    job.refresh_from_db()
    assert job.step == 5
    assert JobEvent.objects.filter(job=job, kind="telemetry_dropped").count() == 1
    # samples of unknown attempts or with bad values are dropped alone, never the whole batch
    services.telemetry_ingest([dict(samples[0], attempt=123456), dict(samples[0], step="x"),
                               dict(samples[0], step=-3), dict(samples[0], attempt=[1]),
                               dict(samples[0], rank=0, step=6)], events=[])
    assert MetricSample.objects.filter(job=job).count() == 11


@pytest.mark.django_db(transaction=True)
def test_concurrent_ticks_never_over_allocate(user, nodes):
    for _ in range(8):
        submit(user)  # 2 slots each; cluster holds 4 slots = 2 jobs
    errors = []

    def tick():
        try:
            services.schedule_tick()
        except Exception as exc:  # pragma: no cover - a failure shows up in the assert below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=tick) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    per_slot = {}
    for alloc in Allocation.objects.filter(active=True).select_related("node"):
        for slot in alloc.slot_ids:
            key = (alloc.node.name, slot)
            assert key not in per_slot, f"slot {key} double-booked"
            per_slot[key] = alloc.pk
    assert len(per_slot) == 4
    assert Job.objects.filter(status="STARTING").count() == 2


def test_a_submit_takes_the_jobspec_parsed_at_the_edge(user, nodes):
    """Issue 22 s4: the API, the form and the tasks parse the user's mapping once
    (submitted_spec: SpecError naming the field); the service takes only the typed value."""
    with pytest.raises(SpecError) as e:
        services.submitted_spec({"name": "t", "train": {"steps": -1}})
    assert "train.steps" in e.value.errors
    with pytest.raises(TypeError, match="JobSpec"):
        services.job_submit(user=user, spec={"name": "t"})
    assert not Job.objects.exists()


def test_a_jobs_life_and_a_lost_node_are_logged_once_committed(user, nodes, sent, caplog, healthy_control_plane,
                                                               django_capture_on_commit_callbacks):
    """`make run` keeps these lines on its terminal (scripts/supervise.py): one per submit, start and
    end on `trainyard.lifecycle`, a lost node as a warning and its return on `trainyard.lifecycle`;
    text from user code (a failure's message) cannot add lines of its own."""
    from jobs.attempts.services.events import job_event

    caplog.set_level("INFO")
    with django_capture_on_commit_callbacks(execute=True):
        job = submit(user)
        attempt = start(job)
        for node in ("node-a", "node-b"):
            services.attempt_node_exit(attempt.pk, node_name=node, result=ok_result(node, attempt.pk))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "trainyard.lifecycle"]
    assert [m.split(":")[0] for _, m in lines] == [f"job {job.pk} 't' {k}" for k in ("submitted", "running",
                                                                                     "succeeded")], lines
    assert lines[0][1].endswith(f"submitted by {user.get_username()}") and {lv for lv, _ in lines} == {"INFO"}
    caplog.clear()
    with django_capture_on_commit_callbacks(execute=True):
        job_event(job, "failed", "ValueError: x\n12:00:00 web | forged\x1b[2J" + "y" * 1000)
        job_event(job, "checkpoint_pinned", "not a lifecycle event")
    [failed] = [r.getMessage() for r in caplog.records if r.name == "trainyard.lifecycle"]
    assert failed.startswith(f"job {job.pk} 't' failed: ValueError: x 12:00:00 web | forged [2J") and len(failed) < 400
    caplog.clear()
    Node.objects.filter(name="node-b").update(last_heartbeat=timezone.now() - timedelta(seconds=300))
    with django_capture_on_commit_callbacks(execute=True):
        assert services.nodes_check() == ["node-b"]
    assert [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records
            if r.getMessage().startswith("node node-b")] == [("WARNING", "node node-b lost")]
    caplog.clear()
    with django_capture_on_commit_callbacks(execute=True):
        node_up({"name": "node-b", "address": "127.0.0.2", "slots": 2})
    assert [(r.name, r.getMessage()) for r in caplog.records if "is back" in r.getMessage()] == [
        ("trainyard.lifecycle", "node node-b is back (READY)")]
