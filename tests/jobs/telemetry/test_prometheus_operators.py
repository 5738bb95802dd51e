"""/metrics figures the operators' dashboard (deploy/grafana/trainyard.json) needs beyond the first
families: the queue by team and its waits, the schedule tick's duration histogram, the relay's oldest
read-but-unacknowledged entry, and the histogram format itself."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import redis
from django.contrib.auth.models import Group
from django.test import Client
from django.utils import timezone

from jobs import services
from jobs.core import dispatch
from jobs.models import Attempt, Job, Quota
from jobs.scheduling import policy as scheduling
from jobs.telemetry import prometheus
from jobs.telemetry.prometheus import Exposition
from trainyard.keys import RELAY_GROUP, SCHEDULER_STATS_KEY, attempt_stream
from tests.jobs.telemetry.test_prometheus import dead_redis, parse, value  # noqa: F401 (dead_redis: autouse)

pytestmark = pytest.mark.django_db
RECORD = dispatch.scheduler_tick_record  # the real one: tests/jobs/conftest.py's `sent` stubs it out


def scrape(staff) -> dict:
    c = Client()
    c.force_login(staff)
    resp = c.get("/metrics")
    assert resp.status_code == 200
    return parse(resp.content.decode())


def samples(fams, name) -> list[tuple[dict, float]]:
    return fams[name].get("samples", [])


def test_histogram_is_written_as_buckets_sum_and_count_with_escaped_labels():
    exp = Exposition()
    exp.histogram("x_seconds", "a histogram", [(0.1, 1), (1.0, 3)], 2.5, 4, team='a "b"\\c')
    exp.histogram("x_seconds", "a histogram", None)
    exp.histogram("y_seconds", "declared only", None)
    text = exp.render()
    lines = text.splitlines()
    assert lines[:2] == ["# HELP x_seconds a histogram", "# TYPE x_seconds histogram"]
    assert lines[2:] [:5] == ['x_seconds_bucket{team="a \\"b\\"\\\\c",le="0.1"} 1',
                              'x_seconds_bucket{team="a \\"b\\"\\\\c",le="1.0"} 3',
                              'x_seconds_bucket{team="a \\"b\\"\\\\c",le="+Inf"} 4',
                              'x_seconds_sum{team="a \\"b\\"\\\\c"} 2.5',
                              'x_seconds_count{team="a \\"b\\"\\\\c"} 4']
    fams = parse(text)
    assert fams["x_seconds"]["type"] == "histogram" and len(samples(fams, "x_seconds")) == 5
    assert fams["y_seconds"]["type"] == "histogram" and not samples(fams, "y_seconds")
    exp = Exposition()
    exp.histogram("z", "no labels", [(1.0, 0)], 0.0, 0)
    assert exp.render().splitlines()[2:] == ['z_bucket{le="1.0"} 0', 'z_bucket{le="+Inf"} 0', "z_sum 0.0", "z_count 0"]


def test_queue_by_team_counts_slots_and_waits_since_submit_or_the_last_attempt(staff, user, other, teams, nodes):
    vision, nlp = teams
    ops = Group.objects.create(name="ops")
    Quota.objects.create(team=ops, max_slots=4)
    spec = services.submitted_spec
    now = timezone.now()
    v1 = services.job_submit(user=user, spec=spec({"name": "v1"}))
    v2 = services.job_submit(user=user, spec=spec({"name": "v2", "resources": {"nodes": 1, "procs_per_node": 2}}))
    n1 = services.job_submit(user=other, spec=spec({"name": "n1"}))
    lone = services.job_submit(user=staff, spec=spec({"name": "no team"}))
    done = services.job_submit(user=other, spec=spec({"name": "finished"}))
    Job.objects.filter(pk=done.pk).update(status=Job.Status.SUCCEEDED)  # not queued: not counted
    Job.objects.filter(pk=v1.pk).update(created_at=now - timedelta(seconds=600))
    Job.objects.filter(pk=v2.pk).update(created_at=now - timedelta(seconds=200))
    # n1 was submitted an hour ago, ran, was preempted 100 s ago: it has waited since then
    Job.objects.filter(pk=n1.pk).update(created_at=now - timedelta(hours=1))
    Attempt.objects.create(job=n1, number=1, status=Attempt.Status.ENDED, outcome="preempted",
                           ended_at=now - timedelta(seconds=100))

    fams = scrape(staff)
    assert value(fams, "trainyard_team_queue_length", team="vision") == 2
    assert value(fams, "trainyard_team_queue_slots", team="vision") == v1.slots + v2.slots == v1.slots + 2
    assert 600 <= value(fams, "trainyard_team_queue_oldest_wait_seconds", team="vision") < 660
    assert 400 <= value(fams, "trainyard_team_queue_mean_wait_seconds", team="vision") < 460
    assert value(fams, "trainyard_team_queue_length", team="nlp") == 1
    assert 100 <= value(fams, "trainyard_team_queue_oldest_wait_seconds", team="nlp") < 160
    assert value(fams, "trainyard_team_queue_length", team=prometheus.NO_TEAM) == 1
    assert value(fams, "trainyard_team_queue_oldest_wait_seconds", team=prometheus.NO_TEAM) < 60
    assert lone.team is None
    # a team with a quota and nothing queued: zero, and no wait at all
    assert value(fams, "trainyard_team_queue_length", team="ops") == 0
    assert value(fams, "trainyard_team_queue_slots", team="ops") == 0
    assert not [lab for lab, _ in samples(fams, "trainyard_team_queue_oldest_wait_seconds") if lab["team"] == "ops"]
    assert {lab["team"] for lab, _ in samples(fams, "trainyard_team_queue_length")} == {
        "vision", "nlp", "ops", prometheus.NO_TEAM}


def test_without_redis_the_scheduler_and_pending_families_are_declared_without_samples(staff):
    fams = scrape(staff)
    assert value(fams, "trainyard_redis_up") == 0
    for name, kind in (("trainyard_scheduler_tick_duration_seconds", "histogram"),
                       ("trainyard_scheduler_tick_errors_total", "counter"),
                       ("trainyard_scheduler_last_tick_duration_seconds", "gauge"),
                       ("trainyard_scheduler_last_tick_timestamp_seconds", "gauge"),
                       ("trainyard_relay_pending_oldest_age_seconds", "gauge")):
        assert fams[name]["type"] == kind and not samples(fams, name), name


def test_record_without_redis_logs_and_returns_quickly(settings, caplog):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    t0 = time.monotonic()
    RECORD(0.01, True)
    assert time.monotonic() - t0 < 2
    assert "schedule tick timing not recorded" in caplog.text


@pytest.fixture
def live_redis(redis_server, settings, monkeypatch):
    settings.REDIS_URL = redis_server.url
    monkeypatch.setattr(prometheus, "_redis", None)
    monkeypatch.setattr(dispatch, "scheduler_tick_record", RECORD)
    return redis.Redis.from_url(redis_server.url)


@pytest.mark.procs
def test_schedule_ticks_fill_the_duration_histogram_in_redis(staff, user, nodes, live_redis, monkeypatch):
    services.job_submit(user=user, spec=services.submitted_spec({"name": "a"}))
    before = time.time()
    services.schedule_tick()
    services.schedule_tick()

    def broken(view):
        raise RuntimeError("policy bug")
    monkeypatch.setattr(scheduling, "schedule", broken)
    with pytest.raises(RuntimeError):
        services.schedule_tick()

    fams = scrape(staff)
    hist = {lab["__name__"] + lab.get("le", ""): v for lab, v in samples(fams, "trainyard_scheduler_tick_duration_seconds")}
    assert hist["trainyard_scheduler_tick_duration_seconds_count"] == 3
    assert hist["trainyard_scheduler_tick_duration_seconds_bucket+Inf"] == 3
    assert 0 < hist["trainyard_scheduler_tick_duration_seconds_sum"] < 30
    bounds = [(float(lab["le"]), v) for lab, v in samples(fams, "trainyard_scheduler_tick_duration_seconds")
              if "le" in lab]
    assert [b for b, _ in bounds] == sorted(b for b, _ in bounds) and len(bounds) == len(dispatch.TICK_BUCKETS_S) + 1
    counts = [v for _, v in bounds]
    assert counts == sorted(counts)  # cumulative
    assert value(fams, "trainyard_scheduler_tick_errors_total") == 1
    assert 0 < value(fams, "trainyard_scheduler_last_tick_duration_seconds") < 30
    assert before <= value(fams, "trainyard_scheduler_last_tick_timestamp_seconds") <= time.time()
    assert live_redis.hget(SCHEDULER_STATS_KEY, "count") == b"3"


@pytest.mark.procs
def test_relay_pending_oldest_age_is_the_oldest_unacknowledged_entry(staff, live_redis):
    r = live_redis
    stream = attempt_stream(7, 2)
    r.xgroup_create(stream, RELAY_GROUP, id="0", mkstream=True)
    old_ms = int(time.time() * 1000) - 5000
    r.xadd(stream, {"type": "metrics", "data": json.dumps([])}, id=f"{old_ms}-0")
    fams = scrape(staff)
    assert value(fams, "trainyard_relay_pending_oldest_age_seconds") == 0  # in the backlog, not read yet
    r.xreadgroup(RELAY_GROUP, "relay-1", {stream: ">"}, count=1)
    fams = scrape(staff)
    assert 4.5 < value(fams, "trainyard_relay_pending_oldest_age_seconds") < 60
    r.xack(stream, RELAY_GROUP, f"{old_ms}-0")
    fams = scrape(staff)
    assert value(fams, "trainyard_relay_pending_oldest_age_seconds") == 0
