"""Issue 16 section 5's chaos under `make run`'s supervisor (scripts/supervise.py) with the real
processes (daphne, Celery control worker + beat, relay, two node agents; Redis from the fixture):
beat SIGKILLed, the control worker SIGKILLed twice while a job trains. Each time the supervisor
restarts only the killed process, /metrics shows it down and back, and the job finishes in its one
attempt with every step trained once (under honcho the first kill stopped every process, and the
agents stopped the training with them).

Not covered here, found while writing it: a control worker killed inside the schedule tick that
places a job, after its commit and before the Launch messages (sent on commit) leave, leaves the
attempt STARTING with nothing sent; it fails as failed:launch_timeout after TRAINYARD_LAUNCH_TIMEOUT_S
and the job restarts (seen once in three runs; the kill cannot be aimed inside the tick without a
control-plane chaos hook)."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
import urllib.request

import pytest

from tests.conftest import REPO

from .cluster import PY, Cluster
from .test_chaos import assert_each_step_once, checkpoints, spec, wait_checkpoint

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]
TTL_S = 2.0
SCRIPT = REPO / "scripts" / "supervise.py"


class SupervisedCluster(Cluster):
    def start(self) -> "SupervisedCluster":
        self.redis.start()
        self.env.update(REDIS_URL=self.redis.url, TRAINYARD_ALIVE_TTL_S=str(TTL_S),
                        TRAINYARD_METRICS_TOKEN="chaos-metrics-token")
        for d in ("var", "data", "agents", "ckpt"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        self.token = self.prepare_database()
        procfile = self.dir / "Procfile"
        # each agent with its own Redis ACL user's URL, as make run's Procfile starts them
        procfile.write_text("".join(
            f"{name}: {'REDIS_URL=' + shlex.quote(self.redis.user_url(name)) + ' ' if name.startswith('node-') else ''}"
            f"{shlex.join(argv)}\n" for name, argv in self.commands().items()))
        self.status_file = self.dir / "var" / "supervisor.json"
        self.supervisor = subprocess.Popen(
            [PY, str(SCRIPT), "--procfile", str(procfile), "--status-file", str(self.status_file),
             "--backoff-initial", "0.5"], cwd=REPO, env=self.env,
            stdout=open(self.dir / "supervisor.log", "ab"), stderr=subprocess.STDOUT)
        self.wait_web()
        self.wait_for(lambda: {n["name"] for n in self.get("/api/v1/nodes/")["results"]
                               if n["status"] == "READY"} == {"node-a", "node-b"}, 90, "both agents to register")
        return self

    def stop(self) -> None:
        if self.supervisor.poll() is None:
            self.supervisor.send_signal(signal.SIGTERM)
            try:
                self.supervisor.wait(40)
            except subprocess.TimeoutExpired:
                self.supervisor.kill()
        super().stop()

    def supervised(self) -> dict:
        return json.loads(self.status_file.read_text())["processes"]

    def kill(self, name: str) -> int:
        pid = self.supervised()[name]["pid"]
        os.kill(pid, signal.SIGKILL)
        return pid

    def process_up(self) -> dict[str, float]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/metrics",
                                     headers={"Authorization": "Bearer chaos-metrics-token"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
        return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("trainyard_process_up{")}

    def wait_back(self, name: str, old_pid: int, restarts: int) -> None:
        self.wait_for(lambda: self.process_up()[name] == 0, TTL_S + 3, f"{name} to show down in /metrics")
        self.wait_for(lambda: (p := self.supervised()[name])["running"] and p["pid"] != old_pid
                      and p["restarts"] == restarts, 20, f"the supervisor to restart {name}")
        self.wait_for(lambda: self.process_up()[name] == 1, 60, f"{name} to show up again in /metrics")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SupervisedCluster(tmp_path_factory.mktemp("chaos-supervised"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def restarts(cluster) -> dict[str, int]:
    return {name: p["restarts"] for name, p in cluster.supervised().items()}


def assert_only_restarted(cluster, before: dict[str, int], expected: dict[str, int]) -> None:
    after = restarts(cluster)
    assert {n: after[n] - before[n] for n in after} == {n: expected.get(n, 0) for n in after}, (before, after)


def test_beat_killed_while_a_job_trains_is_restarted_alone_and_the_job_finishes(cluster):
    steps, before = 60, restarts(cluster)
    job = cluster.submit(spec("beat-killed", steps, 20))
    cluster.wait_running_ranks(job["id"], 2)
    pid = cluster.kill("beat")
    cluster.wait_back("beat", pid, before["beat"] + 1)
    assert_only_restarted(cluster, before, {"beat": 1})
    done = cluster.wait_status(job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
    assert done["status"] == "SUCCEEDED" and len(done["attempts"]) == 1 and done["restarts"] == 0, done
    assert_each_step_once(cluster, job["id"], steps)
    assert_only_restarted(cluster, before, {"beat": 1})


def test_control_worker_killed_twice_while_a_job_trains(cluster):
    steps, before = 80, restarts(cluster)
    job = cluster.submit(spec("control-killed", steps, 20))
    cluster.wait_running_ranks(job["id"], 2, 180)
    for n in (1, 2):  # heartbeats, checkpoint reports and ticks keep coming while it is down
        pid = cluster.kill("control")
        cluster.wait_back("control", pid, before["control"] + n)
    done = cluster.wait_status(job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
    assert done["status"] == "SUCCEEDED" and len(done["attempts"]) == 1 and done["restarts"] == 0, done
    assert_each_step_once(cluster, job["id"], steps)
    assert_only_restarted(cluster, before, {"control": 2})
    assert {n["name"]: n["status"] for n in cluster.get("/api/v1/nodes/")["results"]} == {
        "node-a": "READY", "node-b": "READY"}


def test_redis_sigkill_mid_run_loses_and_duplicates_nothing(cluster):
    """Issue 16: Redis killed outright (no AOF rewrite, no clean exit) while a job trains, under
    make run's supervisor. With appendfsync everysec Redis write()s its AOF before it answers a
    client, so what it acknowledged survives the process (only a crash of the machine loses up to the
    last second): the queued reports, the relay's consumer group and its pending entries come back.
    The ranks buffer telemetry and checkpoint events meanwhile. Every step is stored once, every
    checkpoint registered, one attempt.

    No process dies meanwhile: the Celery workers reconnect. Before trainyard.celery_redis, the
    control worker could die in kombu's reconnect (AttributeError in kombu.transport.redis
    _connparams while restoring unacknowledged messages; kombu issues #582, #970; once in three
    runs here, and in CI in test_chaos's Redis restart); tests/integration/test_bus_outage.py
    reproduces it deterministically."""
    steps, before = 200, restarts(cluster)
    job = cluster.submit(spec("redis-sigkill", steps, 10, max_restarts=0))
    wait_checkpoint(cluster, job["id"], 10)
    cluster.redis.proc.kill()  # SIGKILL
    cluster.redis.proc.wait()
    cluster.redis.proc = None
    time.sleep(3.0)
    cluster.redis.start()
    done = cluster.wait_status(job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
    assert done["status"] == "SUCCEEDED" and len(done["attempts"]) == 1 and done["restarts"] == 0, done
    cluster.wait_for(lambda: len(cluster.metrics(job["id"])) >= steps * 2, 60, "every metric")
    assert_each_step_once(cluster, job["id"], steps)
    registered = sorted(c["step"] for c in checkpoints(cluster, job["id"]))
    assert registered == list(range(10, steps + 1, 10)), registered
    assert_only_restarted(cluster, before, {})
