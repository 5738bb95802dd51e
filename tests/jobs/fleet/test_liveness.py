"""Process liveness (jobs/fleet/liveness.py) in /metrics and on the nodes page: each role's own stamp in
Redis (control, beat, relay), Redis's PING, the agents' heartbeats, and `make run`'s supervisor file."""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest
import redis
from django.test import Client
from django.utils import timezone

from jobs.fleet import liveness
from jobs.telemetry import prometheus
from jobs.models import Node
from tests.conftest import free_port
from tests.jobs.telemetry.test_prometheus import parse, value
from trainyard import keys

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def var_dir(tmp_path, monkeypatch, settings):
    monkeypatch.setenv("TRAINYARD_VAR_DIR", str(tmp_path))
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens (tests with Redis override)
    monkeypatch.setattr(prometheus, "_redis", None)
    return tmp_path


def metrics(staff) -> dict:
    c = Client()
    c.force_login(staff)
    resp = c.get("/metrics")
    assert resp.status_code == 200
    return parse(resp.content.decode())


def agents():
    now = timezone.now()
    Node.objects.create(name="node-a", address="127.0.0.1", slots=2, last_heartbeat=now)
    Node.objects.create(name="node-b", address="127.0.0.2", slots=2, last_heartbeat=now - timedelta(seconds=60))


def write_status(var_dir, updated_at):
    (var_dir / "supervisor.json").write_text(json.dumps({"supervisor_pid": 1, "updated_at": updated_at, "processes": {
        "beat": {"pid": None, "running": False, "restarts": 3, "last_exit": {"code": None, "signal": "SIGKILL"}},
        "web": {"pid": 4242, "running": True, "restarts": 0, "last_exit": None}}}))


def test_without_redis_every_stamped_role_is_down_and_agents_go_by_heartbeat(staff):
    agents()
    fams = metrics(staff)
    up = {lab["process"]: v for lab, v in fams["trainyard_process_up"]["samples"]}
    assert up == {"web": 1, "redis": 0, "control": 0, "notify": 0, "beat": 0, "relay": 0, "agent:node-a": 1, "agent:node-b": 0}
    assert fams["trainyard_process_up"]["type"] == "gauge"
    # no supervisor on this host (systemd, say): declared, no sample, so nothing alerts on it
    assert "samples" not in fams["trainyard_supervisor_up"]


@pytest.mark.procs
def test_a_role_is_down_once_its_stamp_is_stale(staff, redis_server, settings):
    settings.REDIS_URL = redis_server.url
    r = redis.Redis.from_url(redis_server.url)
    liveness.stamp("control")
    r.set(keys.alive_key("beat"), time.time(), px=200)  # beat's last stamp, about to expire
    r.set(keys.RELAY_ALIVE_KEY, time.time(), ex=10)
    fams = metrics(staff)
    assert [value(fams, "trainyard_process_up", process=p) for p in ("redis", "control", "beat", "relay")] == [1] * 4
    assert 0 <= value(fams, "trainyard_process_heartbeat_age_seconds", process="beat") < 5
    time.sleep(0.4)
    fams = metrics(staff)
    assert value(fams, "trainyard_process_up", process="beat") == 0
    assert value(fams, "trainyard_process_up", process="control") == 1
    assert 9 <= r.pttl(keys.alive_key("control")) / 1000 <= settings.TRAINYARD_ALIVE_TTL_S


def test_supervisor_restarts_in_metrics_and_a_stale_file_is_not_believed(staff, var_dir):
    write_status(var_dir, time.time())
    assert os.path.exists(keys.supervisor_status_path())
    fams = metrics(staff)
    assert value(fams, "trainyard_supervisor_up") == 1
    assert value(fams, "trainyard_process_restarts_total", process="beat") == 3
    assert fams["trainyard_process_restarts_total"]["type"] == "counter"
    assert (value(fams, "trainyard_process_running", process="beat"),
            value(fams, "trainyard_process_running", process="web")) == (0, 1)
    write_status(var_dir, time.time() - 60)  # the supervisor itself was killed
    fams = metrics(staff)
    assert value(fams, "trainyard_supervisor_up") == 0
    assert value(fams, "trainyard_process_running", process="web") == 0
    (var_dir / "supervisor.json").write_text("{not json")
    assert value(metrics(staff), "trainyard_supervisor_up") == 0


def test_nodes_page_has_a_control_plane_panel(staff, user, var_dir):
    agents()
    write_status(var_dir, time.time())
    c = Client()
    c.force_login(staff)
    html = c.get("/nodes/").content.decode()
    panel = html[html.index('id="control-plane"'):]
    assert '<tr data-process="beat"><td>beat</td><td><span class="status s-down">DOWN</span>' in panel
    assert '<tr data-process="web"><td>web</td><td><span class="status s-up">UP</span>' in panel
    assert "agent:node-b" in panel and "killed by SIGKILL" in panel and "4242" in panel
    data = c.get("/nodes/control-plane/").json()
    assert {p["process"]: p["up"] for p in data["processes"]}["agent:node-a"] is True
    assert {p["process"]: p["restarts"] for p in data["supervisor"]["rows"]} == {"beat": 3, "web": 0}
    # pids and exit codes are for staff; everyone signed in sees what is up
    c.force_login(user)
    data = c.get("/nodes/control-plane/").json()
    assert data["supervisor"] is None and len(data["processes"]) == 8
    assert "4242" not in c.get("/nodes/").content.decode()
