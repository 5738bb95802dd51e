"""A control worker killed between the scheduling tick's commit and its launch sends left a
STARTING attempt no agent had heard of (issue 16's chaos run: it failed 120 s later as a launch
timeout blamed on a node). The node check sends such an attempt's launches again, once, identical."""
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import services, tasks
from jobs.models import Attempt
from tests.jobs.runs.test_services import submit

pytestmark = pytest.mark.django_db


def launches(sent):
    return sorted(((c[1], c[2]) for c in sent if c[0] == "launch"), key=lambda x: x[0])


def test_a_launch_lost_with_the_control_worker_is_sent_again_once(user, nodes, sent, settings,
                                                                   django_capture_on_commit_callbacks):
    job = submit(user)
    with django_capture_on_commit_callbacks(execute=False):  # the worker died before its sends
        services.schedule_tick()
    assert launches(sent) == []
    attempt = Attempt.objects.get(job=job)
    Attempt.objects.filter(pk=attempt.pk).update(created_at=timezone.now() - timedelta(seconds=5))
    with django_capture_on_commit_callbacks(execute=True):
        tasks.nodes_check()
    assert launches(sent) == []  # younger than TRAINYARD_LAUNCH_RESEND_S: its launch may be on its way
    Attempt.objects.filter(pk=attempt.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.TRAINYARD_LAUNCH_RESEND_S + 1))
    with django_capture_on_commit_callbacks(execute=True):
        tasks.nodes_check()
    resent = launches(sent)
    assert [node for node, _ in resent] == ["node-a", "node-b"]
    assert [p["node_rank"] for _, p in resent] == [0, 1] and {p["attempt_id"] for _, p in resent} == {attempt.pk}
    assert job.events.filter(kind="launch_resent").count() == 1
    with django_capture_on_commit_callbacks(execute=True):
        tasks.nodes_check()
    assert len(launches(sent)) == 2  # once only
    attempt.refresh_from_db()
    assert attempt.status == Attempt.Status.STARTING


def test_the_resent_launch_is_the_one_the_tick_sent(user, nodes, sent, settings, django_capture_on_commit_callbacks):
    job = submit(user)
    with django_capture_on_commit_callbacks(execute=True):
        services.schedule_tick()
    first = launches(sent)
    sent.clear()
    Attempt.objects.filter(job=job).update(
        created_at=timezone.now() - timedelta(seconds=settings.TRAINYARD_LAUNCH_RESEND_S + 1))
    with django_capture_on_commit_callbacks(execute=True):
        tasks.nodes_check()
    assert launches(sent) == first and len(first) == 2
