"""Issue 16, section 2: the relay process on a real PostgreSQL server that restarts under it. The
server goes down with samples in flight; the relay keeps retrying (its connection is broken, so it
reconnects) and, once the server is back, stores every sample exactly once and acknowledges them.
Skipped where Debian's postgresql is not installed (`make test-postgres` installs it)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import psycopg
import pytest
import redis

from tests.conftest import REPO
from tests.postgres import PostgresServer, postgres_bin_dir
from trainyard.keys import RELAY_GROUP, attempt_stream

pytestmark = pytest.mark.procs

SETUP = r"""
import json
import django
django.setup()
from django.contrib.auth import get_user_model
from jobs import services
from jobs.core import dispatch
from trainyard.launch import Heartbeat
dispatch.send_launch = lambda *a, **k: None
dispatch.request_tick = lambda *a, **k: None
dispatch.publish = lambda *a, **k: None
dispatch.bus_user_grant = lambda *a, **k: None
user = get_user_model().objects.create_user("alice", password="pw-alice-123")
services.node_add("node-a", slots=2, address="127.0.0.1")  # registered by staff first (issue 16)
services.node_heartbeat(Heartbeat(name="node-a", address="127.0.0.1", slots=2, labels={},
                                  cpu_percent=0.0, mem_percent=0.0))
job = services.job_submit(user=user, spec=services.submitted_spec({"name": "pg", "resources": {"nodes": 1, "procs_per_node": 1}}))
services.schedule_tick()
print(json.dumps({"job": job.pk, "attempt": job.attempts.get().pk}))
"""


def stored(url: str, attempt: int) -> tuple[int, int]:
    """(samples of the attempt, distinct (rank, step) among them), or (-1, -1) while the server is down."""
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            return conn.execute("SELECT COUNT(*), COUNT(DISTINCT (rank, step)) FROM jobs_metricsample "
                                "WHERE attempt_id = %s", [attempt]).fetchone()
    except psycopg.OperationalError:
        return -1, -1


def wait_for(cond, what: str, relay: subprocess.Popen, log, timeout_s: float = 40.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        assert relay.poll() is None, f"the relay exited waiting for {what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")


def test_the_relay_rides_out_a_postgresql_restart_and_stores_each_sample_once(tmp_path, redis_server, repo_env):
    try:
        postgres_bin_dir()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    server = PostgresServer().start()
    relay = None
    try:
        url = server.create_database("relay_restart")
        env = {**repo_env, "DJANGO_SETTINGS_MODULE": "controlplane.settings", "DATABASE_URL": url,
               "REDIS_URL": redis_server.url, "TRAINYARD_VAR_DIR": str(tmp_path / "var"),
               "TRAINYARD_ARTIFACT_ROOT": str(tmp_path / "artifacts"), "DJANGO_SECRET_KEY": "relay-pg-tests-only",
               "TRAINYARD_CHECKPOINT_ROOT": str(tmp_path / "ckpt")}
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO, env=env,
                       check=True, capture_output=True, timeout=300)
        ids = json.loads(subprocess.run([sys.executable, "-c", SETUP], cwd=REPO, env=env, check=True,
                                        capture_output=True, text=True, timeout=120).stdout.splitlines()[-1])
        r = redis.Redis.from_url(redis_server.url)
        stream = attempt_stream(ids["job"], ids["attempt"])

        def add(steps):
            for step in steps:
                r.xadd(stream, {"type": "metrics", "data": json.dumps(
                    [{"rank": rank, "step": step, "ts": 1.0, "loss": 1.0, "attempt": ids["attempt"]} for rank in (0, 1)])})
        log = tmp_path / "relay.log"
        with open(log, "ab") as out:
            relay = subprocess.Popen([sys.executable, "manage.py", "relay"], cwd=REPO, env=env, stdout=out,
                                     stderr=subprocess.STDOUT)
        add(range(1, 21))
        wait_for(lambda: stored(url, ids["attempt"]) == (40, 40), "the first 40 samples", relay, log)
        server.stop(keep_data=True)  # fast shutdown: the relay's connection dies under it
        add(range(21, 41))
        time.sleep(2.0)  # rounds fail against the stopped server meanwhile
        assert relay.poll() is None, log.read_text()[-4000:]
        assert r.xlen(stream) > 0  # nothing acknowledged while nothing could be stored
        server.start()
        wait_for(lambda: stored(url, ids["attempt"]) == (80, 80), "all 80 samples after the restart", relay, log)
        wait_for(lambda: r.xlen(stream) == 0 and r.xpending(stream, RELAY_GROUP)["pending"] == 0,
                 "every entry acknowledged", relay, log)
        assert "database error" in log.read_text()  # it did see the outage, and retried
    finally:
        if relay is not None and relay.poll() is None:
            relay.terminate()
            relay.wait(15)
        server.stop()
