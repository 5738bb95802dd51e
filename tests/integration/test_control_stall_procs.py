"""Issue 16, section 3: a control-plane stall never marks nodes LOST. Real processes (make run's
set, TRAINYARD_NODE_LOST_S=4): while a 2-node job trains, the control worker is frozen (SIGSTOP
of it and its pool) for three times the loss limit, then the SQLite database is held under an
exclusive lock for 25 s (longer than its busy timeout). Heartbeats keep arriving in Redis but cannot be applied; afterwards both
nodes are still READY, the job still runs its first attempt, and /metrics counts the stalls."""
from __future__ import annotations

import signal
import sqlite3
import time
import urllib.request

import psutil
import pytest

from .cluster import Cluster
from .test_chaos import spec

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]
LOST_S = 4.0
STALL_S = 3 * LOST_S
LOCK_S = 25.0  # over SQLite's 20 s busy timeout: writes in flight fail, later ones wait on the lock


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("stall"))
    c.env["TRAINYARD_NODE_LOST_S"] = str(LOST_S)
    c.env["TRAINYARD_METRICS_TOKEN"] = "stall-test-scraper"
    try:
        c.start()
        yield c
    finally:
        c.stop()


def metric(cluster, name: str) -> float:
    req = urllib.request.Request(f"http://127.0.0.1:{cluster.port}/metrics",
                                 headers={"Authorization": "Bearer stall-test-scraper"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def nodes_status(cluster) -> dict[str, str]:
    return {n["name"]: n["status"] for n in cluster.get("/api/v1/nodes/")["results"]}


def assert_undisturbed(cluster, job_id: int) -> None:
    """A few loss limits of healthy time after the stall: nothing was written off."""
    deadline = time.monotonic() + 3 * LOST_S
    while time.monotonic() < deadline:
        assert nodes_status(cluster) == {"node-a": "READY", "node-b": "READY"}, cluster.logs()
        time.sleep(0.5)
    job = cluster.job(job_id)
    assert job["status"] == "RUNNING" and job["restarts"] == 0 and len(job["attempts"]) == 1, job
    events = cluster.get(f"/api/v1/jobs/{job_id}/events/")["results"]
    assert not [e for e in events if "lost" in str(e).lower()], events


def test_stalls_of_the_control_plane_write_off_no_node(cluster):
    job = cluster.submit(spec("stall", 1_000_000, 1000, resources={"nodes": 2, "procs_per_node": 1}))["id"]
    cluster.wait_running_ranks(job, 2)
    cluster.wait_for(lambda: cluster.job(job)["step"] > 0, 120, "the first steps")
    stalls_before = metric(cluster, "trainyard_control_plane_stalls_total")

    # 1. The control worker frozen: heartbeats queue in Redis, no check runs, nothing is applied.
    worker = psutil.Process(cluster.procs["control"].pid)
    frozen = [worker, *worker.children(recursive=True)]
    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
    finally:
        for p in frozen:
            p.send_signal(signal.SIGCONT)
    assert_undisturbed(cluster, job)
    assert metric(cluster, "trainyard_control_plane_stalls_total") >= stalls_before + 1

    # 2. The database locked: every write of the control plane waits on it (busy timeout 20 s).
    if cluster.env.get("TRAINYARD_DB") and not cluster.env.get("DATABASE_URL"):
        stalls_before = metric(cluster, "trainyard_control_plane_stalls_total")
        db = sqlite3.connect(cluster.env["TRAINYARD_DB"], isolation_level=None, timeout=30)
        db.execute("BEGIN EXCLUSIVE")
        try:
            time.sleep(LOCK_S)
        finally:
            db.execute("COMMIT")
            db.close()
        assert_undisturbed(cluster, job)
        assert metric(cluster, "trainyard_control_plane_stalls_total") >= stalls_before + 1
    status, body = cluster.request("POST", f"/api/v1/jobs/{job}/cancel/")
    assert status == 202, body
    cluster.wait_status(job, {"CANCELLED"}, 120)
