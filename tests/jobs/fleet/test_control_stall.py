"""Issue 16, section 3: a control-plane stall (control worker or beat down, the database locked)
never marks nodes LOST. Heartbeats cannot be applied during a stall, so the node check judges
silence only over time the control plane was itself healthy: the check's own clock
(ControlPlaneClock) starts a new healthy stretch after any gap between checks over
TRAINYARD_CONTROL_STALL_S, and every node then has a whole TRAINYARD_NODE_LOST_S again."""
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import services
from jobs.models import Attempt, ControlPlaneClock, Node
from tests.jobs.runs.test_services import start, submit

pytestmark = pytest.mark.django_db


def clock(**fields):
    ControlPlaneClock.objects.update_or_create(pk=1, defaults=fields)


def silent(name: str, seconds: float):
    Node.objects.filter(name=name).update(last_heartbeat=timezone.now() - timedelta(seconds=seconds))


def test_silence_during_a_stall_is_not_held_against_a_node(user, nodes, sent, settings,
                                                          django_capture_on_commit_callbacks):
    job = submit(user)
    attempt = start(job)
    now = timezone.now()
    # The last check ran 30 s ago (the worker was stopped since), and node-b's heartbeats of that
    # time were never applied: before the fix this check marked node-b LOST and stopped the job.
    clock(last_check_at=now - timedelta(seconds=30), healthy_since=now - timedelta(days=1))
    silent("node-b", 30)
    with django_capture_on_commit_callbacks(execute=True):
        assert services.nodes_check() == []
    assert Node.objects.get(name="node-b").status == "READY"
    assert not [c for c in sent if c[0] == "stop"]
    c = ControlPlaneClock.objects.get()
    assert c.stalls == 1 and 29 < c.last_stall_s < 40 and c.healthy_since >= now
    attempt.refresh_from_db()
    assert attempt.status != Attempt.Status.ENDED and not attempt.stop_reason
    # Checks on schedule from then on: node-b, still silent, is LOST once it has been silent for a
    # whole TRAINYARD_NODE_LOST_S of healthy time.
    clock(last_check_at=timezone.now() - timedelta(seconds=1),
          healthy_since=timezone.now() - timedelta(seconds=settings.TRAINYARD_NODE_LOST_S + 1))
    with django_capture_on_commit_callbacks(execute=True):
        assert services.nodes_check() == ["node-b"]
    assert ("stop", "node-a", attempt.pk, "node_lost:node-b") in sent


def test_a_node_silent_over_healthy_time_is_lost_as_before(user, nodes, healthy_control_plane):
    silent("node-b", 30)
    assert services.nodes_check() == ["node-b"]
    assert ControlPlaneClock.objects.get().stalls == 0


def test_the_first_check_starts_the_healthy_stretch(nodes):
    silent("node-a", 3600)  # a control plane that was down for an hour comes back
    assert services.nodes_check() == []
    c = ControlPlaneClock.objects.get()
    assert c.last_check_at == c.healthy_since and c.stalls == 0
    assert Node.objects.get(name="node-a").status == "READY"


def test_a_stall_does_not_time_out_launches_either(user, nodes, sent, settings, django_capture_on_commit_callbacks):
    job = submit(user)
    with django_capture_on_commit_callbacks(execute=True):
        services.schedule_tick()
    attempt = Attempt.objects.get(job=job)
    old = timezone.now() - timedelta(seconds=settings.TRAINYARD_LAUNCH_TIMEOUT_S + 5)
    Attempt.objects.filter(pk=attempt.pk).update(created_at=old)
    clock(last_check_at=timezone.now() - timedelta(seconds=settings.TRAINYARD_LAUNCH_TIMEOUT_S),
          healthy_since=timezone.now() - timedelta(days=1))
    with django_capture_on_commit_callbacks(execute=True):
        services.nodes_check()
    attempt.refresh_from_db()
    assert attempt.stop_reason == ""  # the ranks' reports could not be applied during the stall
    clock(last_check_at=timezone.now(), healthy_since=old - timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        services.nodes_check()
    attempt.refresh_from_db()
    assert attempt.stop_reason == "launch_timeout"


def test_checks_on_schedule_keep_the_stretch(nodes, settings):
    start_at = timezone.now() - timedelta(seconds=60)
    clock(last_check_at=timezone.now() - timedelta(seconds=settings.TRAINYARD_CONTROL_STALL_S / 2),
          healthy_since=start_at)
    services.nodes_check()
    c = ControlPlaneClock.objects.get()
    assert c.healthy_since == start_at and c.stalls == 0


def test_metrics_show_the_stalls(nodes, staff):
    from django.test import Client

    from tests.jobs.telemetry.test_prometheus import parse, value

    clock(last_check_at=timezone.now() - timedelta(seconds=42), healthy_since=timezone.now() - timedelta(days=1))
    services.nodes_check()
    c = Client()
    c.force_login(staff)
    fams = parse(c.get("/metrics").content.decode())  # the strict exposition reader
    assert value(fams, "trainyard_control_plane_stalls_total") == 1
    assert 42 <= value(fams, "trainyard_control_plane_last_stall_seconds") < 50
    assert 0 <= value(fams, "trainyard_control_plane_healthy_seconds") < 60
