"""Beat and the control worker prove their own liveness (jobs/fleet/liveness.py), whatever manages them:
real `celery beat` and `celery worker` processes on a real Redis; SIGKILL one and /metrics shows it
down within the stamp TTL while the other stays up."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from django.test import Client

from tests.conftest import REPO
from tests.jobs.telemetry.test_prometheus import parse

pytestmark = [pytest.mark.procs, pytest.mark.django_db]
TTL_S = 2.0


def up(staff) -> dict[str, float]:
    c = Client()
    c.force_login(staff)
    fams = parse(c.get("/metrics").content.decode())
    return {lab["process"]: v for lab, v in fams["trainyard_process_up"]["samples"]}


def wait_for(pred, timeout, what, logs):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(
        f"==== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs))


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user("root", password="pw-root-123", is_staff=True)


def test_killing_beat_then_the_control_worker_flips_each_to_down_within_the_ttl(
        tmp_path, redis_server, settings, staff):
    settings.REDIS_URL = redis_server.url
    settings.TRAINYARD_ALIVE_TTL_S = TTL_S
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", REDIS_URL=redis_server.url,
               DJANGO_SETTINGS_MODULE="controlplane.settings", TRAINYARD_ALIVE_TTL_S=str(TTL_S),
               TRAINYARD_VAR_DIR=str(tmp_path / "var"), TRAINYARD_DB=str(tmp_path / "db.sqlite3"),
               DJANGO_SECRET_KEY="liveness-tests-only")
    commands = {
        "beat": [sys.executable, "-m", "celery", "-A", "controlplane", "beat", "-l", "INFO",
                 "-s", str(tmp_path / "celerybeat-schedule")],
        "control": [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-Q", "control,control.beat",
                    "-n", "control@%h", "-c", "1", "-l", "INFO", "--without-gossip", "--without-mingle"],
        "notify": [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-Q", "control.notify",
                   "-n", "notify@%h", "-c", "1", "-l", "INFO", "--without-gossip", "--without-mingle"],
    }
    (tmp_path / "var").mkdir()
    procs, logs = {}, []
    try:
        for name, argv in commands.items():
            logs.append(tmp_path / f"{name}.log")
            procs[name] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=logs[-1].open("wb"),
                                           stderr=subprocess.STDOUT)
        wait_for(lambda: (u := up(staff))["beat"] == 1 and u["control"] == 1 and u["notify"] == 1, 60,
                 "beat, control and notify to stamp", logs)
        procs["beat"].send_signal(signal.SIGKILL)
        procs["beat"].wait(10)
        killed = time.monotonic()
        down = wait_for(lambda: up(staff)["beat"] == 0, TTL_S + 3, "beat to show down", logs)
        assert down - killed <= TTL_S + 0.5
        assert up(staff)["control"] == 1  # the worker's stamp is its own, not a task beat sends
        procs["control"].send_signal(signal.SIGKILL)
        procs["control"].wait(10)
        killed = time.monotonic()
        down = wait_for(lambda: up(staff)["control"] == 0, TTL_S + 3, "control to show down", logs)
        assert down - killed <= TTL_S + 0.5
        assert up(staff)["notify"] == 1  # the notifications' worker (same app) stamps only its own role
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        # the killed worker's pool child notices its parent is gone on its own; do not wait for that
        for child in psutil.Process().children(recursive=True):
            if any(str(tmp_path) in part or "controlplane" in part for part in child.cmdline()):
                child.kill()
