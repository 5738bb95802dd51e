"""Issue 16, section 3, fencing, with real processes (TRAINYARD_NODE_LOST_S=4): the agent of the node
a job trains on is frozen (SIGSTOP), so the control plane hears nothing from that node while its
ranks train on and still reach Redis, as behind a partition of the agent alone. The node is written
off, the job restarts on the other node from its latest checkpoint, and the stale ranks, fenced,
exit by themselves (exit code 84) before the agent comes back; none of their samples or
checkpoints after the fence step is in the job. When the agent is thawed the node is READY again
and the job trains on undisturbed."""
from __future__ import annotations

import signal
import time

import psutil
import pytest

from .cluster import Cluster, attempt_processes
from .test_chaos import checkpoints, spec

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]
LOST_S = 4.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("fencing"))
    c.env["TRAINYARD_NODE_LOST_S"] = str(LOST_S)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes that still run (a zombie waits for its parent to reap it: it runs nothing)."""
    out = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def restarted_elsewhere(cluster, job_id: int, node: str, timeout_s: float) -> tuple[dict, int]:
    """The job's second attempt, running on another node from a checkpoint at or before the first
    attempt's fence step; and that step."""
    job = cluster.wait_for(lambda: (j := cluster.job(job_id))["status"] == "RUNNING" and len(j["attempts"]) == 2
                           and j["attempts"][-1]["ranks"] and j, timeout_s, "the restart on the other node")
    fenced_step = next(e for e in cluster.get(f"/api/v1/jobs/{job_id}/events/?page_size=500")["results"]
                       if e["kind"] == "fenced")["data"]["step"]
    second = job["attempts"][-1]
    assert second["ranks"][0]["node"] != node
    assert second["resumed_from_step"] is not None and second["resumed_from_step"] <= fenced_step
    return second, fenced_step


def assert_nothing_after_the_fence_and_cancel(cluster, job_id: int, attempt_id: int, fenced_step: int) -> None:
    """No sample and no checkpoint of the fenced attempt after its fence step is in the job, which
    still runs its second attempt; then cancel it."""
    cluster.wait_for(lambda: cluster.job(job_id)["step"] > fenced_step + 5, 180, "the second attempt training on")
    stale = [m for m in cluster.get(f"/api/v1/jobs/{job_id}/metrics/?attempt={attempt_id}&limit=10000")
             if m["step"] > fenced_step]
    assert stale == []
    assert [c for c in checkpoints(cluster, job_id) if c["attempt"] == attempt_id and c["step"] > fenced_step] == []
    job = cluster.job(job_id)
    assert job["status"] == "RUNNING" and len(job["attempts"]) == 2, job
    status, body = cluster.request("POST", f"/api/v1/jobs/{job_id}/cancel/")
    assert status == 202, body
    cluster.wait_status(job_id, {"CANCELLED"}, 120)


def node_status(cluster, node: str) -> str:
    return {n["name"]: n["status"] for n in cluster.get("/api/v1/nodes/")["results"]}[node]


def training_with_a_checkpoint(cluster, name: str) -> tuple[int, dict, str]:
    """A long 1-node job once its first attempt has a checkpoint: (job id, that attempt, its node)."""
    job_id = cluster.submit(spec(name, 1_000_000, 5, resources={"nodes": 1, "procs_per_node": 1}))["id"]
    first = cluster.wait_running_ranks(job_id, 1)["attempts"][-1]
    cluster.wait_for(lambda: any(c["attempt"] == first["id"] for c in checkpoints(cluster, job_id)), 180,
                     "a checkpoint of the first attempt")
    return job_id, first, first["ranks"][0]["node"]


def test_a_written_off_attempt_is_fenced_and_the_job_goes_on_elsewhere(cluster):
    job_id, first, node = training_with_a_checkpoint(cluster, "fenced")
    assert attempt_processes(first["id"]), "the first attempt's processes"

    agent = psutil.Process(cluster.procs[node].pid)
    agent.send_signal(signal.SIGSTOP)
    try:
        cluster.wait_for(lambda: node_status(cluster, node) == "LOST", 60, f"{node} written off")
        # The ranks, still running and reaching Redis, read the fence and exit by themselves
        # (torchrun's wrapper stays a zombie until the frozen agent reaps it).
        cluster.wait_for(lambda: not running(attempt_processes(first["id"])), 30, "the fenced ranks to exit")
        _, fenced_step = restarted_elsewhere(cluster, job_id, node, 120)
        time.sleep(3)
    finally:
        agent.send_signal(signal.SIGCONT)
    cluster.wait_for(lambda: node_status(cluster, node) == "READY", 60, f"{node} back")
    assert_nothing_after_the_fence_and_cancel(cluster, job_id, first["id"], fenced_step)
