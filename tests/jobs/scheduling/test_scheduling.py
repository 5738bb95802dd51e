"""The scheduling policy applied by services: borrowing, reclaim by cooperative preemption,
quota changes taking effect at the next tick, ETAs, the predictor at submit."""
import pytest

from jobs import services
from jobs.models import Attempt, Job, JobEvent, Quota

from tests.jobs.runs.test_services import start, submit

pytestmark = pytest.mark.django_db

FOUR = {"resources": {"nodes": 2, "procs_per_node": 2}, "parallel": {"dp": 4}}
TWO = {"resources": {"nodes": 1, "procs_per_node": 2}, "parallel": {"dp": 2}}


def finish_preempted(attempt):
    for alloc in attempt.allocations.select_related("node"):
        services.attempt_node_exit(attempt.pk, node_name=alloc.node.name, result={
            "node": alloc.node.name, "exit_code": 1, "stopped": False, "failures": []})


def test_lowering_a_quota_makes_the_job_borrowing_and_another_teams_job_reclaims_it(
        user, other, staff, teams, nodes, preempts, django_capture_on_commit_callbacks):
    Quota.objects.create(team=teams[0], max_slots=4)
    Quota.objects.create(team=teams[1], max_slots=2)
    # long: the policy reclaims only when waiting for it would take longer than RECLAIM_WAIT_S
    big = submit(user, **FOUR, train={"steps": 1_000_000, "global_batch": 32})
    attempt = start(big)
    assert not Job.objects.get(pk=big.pk).borrowing
    small = submit(other, **TWO)
    services.schedule_tick()
    assert Job.objects.get(pk=small.pk).status == "QUEUED" and not preempts  # vision is within its quota
    with django_capture_on_commit_callbacks(execute=True):
        services.quotas_update(actor=staff, entries={"team": "vision", "max_slots": 2})
        services.schedule_tick()
    assert Job.objects.get(pk=big.pk).borrowing
    assert preempts and preempts[0][0] == attempt.pk and "vision" in preempts[0][1]
    attempt.refresh_from_db()
    assert attempt.stop_reason == "preempt" and attempt.preempt_for == small.pk
    services.schedule_tick()  # in flight: not preempted twice, nobody takes the slots meanwhile
    assert len(preempts) == 1 and Job.objects.get(pk=small.pk).status == "QUEUED"
    finish_preempted(attempt)
    big.refresh_from_db()
    assert big.status == "QUEUED" and big.attempts.get().outcome == "preempted" and big.restarts == 0
    services.schedule_tick()
    assert Job.objects.get(pk=small.pk).status == "STARTING"
    assert Job.objects.get(pk=big.pk).status == "QUEUED"
    assert JobEvent.objects.filter(job=big, kind="preempt_requested").get().data["for_job"] == small.pk


def test_borrowing_uses_idle_capacity_only(user, other, teams, nodes, preempts):
    Quota.objects.create(team=teams[0], max_slots=2)
    big = submit(user, **FOUR)
    services.schedule_tick()
    big.refresh_from_db()
    assert big.status == "STARTING" and big.borrowing and "borrowing" in big.status_reason


def test_device_hours_spent_make_jobs_wait(user, teams, nodes):
    from datetime import timedelta

    from django.utils import timezone

    Quota.objects.create(team=teams[0], max_slots=4, device_hours=0.001)
    done = submit(user, **TWO)
    a = start(done)
    Attempt.objects.filter(pk=a.pk).update(started_at=timezone.now() - timedelta(hours=1))
    job = submit(user, **TWO)
    services.schedule_tick()
    assert Job.objects.get(pk=job.pk).status == "QUEUED"


def test_eta_refresh_predicts_queued_jobs_start(user, nodes):
    first = submit(user, **FOUR)
    start(first)
    queued = submit(user, **FOUR)
    assert services.eta_refresh() == 1
    queued.refresh_from_db()
    assert queued.predicted_start_at is not None
    from rest_framework.test import APIClient

    c = APIClient()
    c.force_authenticate(user)
    body = c.get(f"/api/v1/jobs/{queued.pk}/").json()
    assert body["predicted_start_at"] and body["queue_position"] == 1 and body["predicted_s"] > 0


def test_submit_predicts_run_time_from_history_then_model(user, nodes):
    job = submit(user, **TWO)
    assert job.plan["prediction_source"] == "model" and job.predicted_s > 0
    a = start(job)
    for alloc in a.allocations.select_related("node"):
        services.attempt_node_exit(a.pk, node_name=alloc.node.name, result={
            "node": alloc.node.name, "exit_code": 0, "stopped": False, "failures": []})
    again = submit(user, **TWO)
    assert again.plan["prediction_source"] == "history:user"
