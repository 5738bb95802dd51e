"""Issue 24, section 3: a SIGKILLed rank's job resumes on the same nodes, its new ranks forked from
a launcher that imported the runtime before the rendezvous (workers/warmrun.py), within a bound
loose enough for CI's 2 slow cores; and with TRAINYARD_WARM_RANKS=0 the ranks are fresh
interpreters again (the benchmark's `before` side). Real processes: the integration Cluster."""
from __future__ import annotations

import signal
import time

import psutil
import pytest

from .cluster import Cluster

pytestmark = [pytest.mark.procs, pytest.mark.timeout(400)]
SPEC = {"name": "fast-resume", "model": {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 2, "seq_len": 64},
        "train": {"steps": 60, "global_batch": 16, "seed": 3}, "checkpoint": {"every_steps": 10, "keep": 2},
        "max_restarts": 2}
BOUND_S = 30.0  # SIGKILL -> first resumed step; about 4 s on a quiet 2-core machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("fast-resume"))
    # Each test kills a rank on the same node: two failures blamed on it would quarantine it (and a
    # 2-node job would wait); quarantine has tests of its own.
    c.env["TRAINYARD_QUARANTINE_FAILURES"] = "10"
    try:
        c.start()
        yield c
    finally:
        c.stop()


def launcher_of(pid: int) -> list[str]:
    """The command line of a rank's parent: the launcher that started it."""
    return psutil.Process(pid).parent().cmdline()


def first_step_ts(cluster: Cluster, job_id: int, attempt_id: int) -> float | None:
    rows = cluster.get(f"/api/v1/jobs/{job_id}/metrics/?per_rank=1&attempt={attempt_id}&limit=1")
    return rows[0]["ts"] if rows else None


def kill_and_resume(cluster: Cluster, name: str) -> tuple[dict, list[dict], float]:
    job = cluster.submit(dict(SPEC, name=name))
    cluster.wait_running_ranks(job["id"], 2, 180)
    cluster.wait_for(lambda: cluster.get(f"/api/v1/jobs/{job['id']}/checkpoints/")["count"] > 0, 180, "a checkpoint")
    ranks = cluster.job(job["id"])["attempts"][0]["ranks"]
    launchers = [launcher_of(r["pid"]) for r in ranks]
    t_kill = time.time()
    psutil.Process(next(r["pid"] for r in ranks if r["rank"] == 1)).send_signal(signal.SIGKILL)
    second = cluster.wait_for(lambda: len((j := cluster.job(job["id"]))["attempts"]) > 1 and j["attempts"][1],
                              120, "the next attempt")
    resumed_at = cluster.wait_for(lambda: first_step_ts(cluster, job["id"], second["id"]), 180, "the first new step")
    done = cluster.wait_status(job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    return done, launchers, resumed_at - t_kill


def test_a_killed_rank_resumes_on_the_same_nodes_from_warm_forked_ranks(cluster):
    done, launchers, took = kill_and_resume(cluster, "warm")
    first, second = done["attempts"][:2]
    assert first["outcome"] == "failed:signal" and first["failure"]["rank"] == 1, first
    assert {r["node"] for r in second["ranks"]} == {r["node"] for r in first["ranks"]} == {"node-a", "node-b"}
    assert second["resumed_from_step"] >= 10 and done["step"] == SPEC["train"]["steps"] and done["restarts"] == 1
    # every rank of the first attempt was a fork of the warm launcher (not a fresh interpreter)
    assert all(cmd[1:3] == ["-m", "workers.warmrun"] for cmd in launchers), launchers
    rows = cluster.metrics(done["id"])
    keys = [(r["rank"], r["step"]) for r in rows]
    assert len(keys) == len(set(keys)) and set(keys) == {(r, s) for r in range(2) for s in range(1, 61)}
    assert took < BOUND_S, took


def test_with_warm_ranks_off_each_rank_is_a_fresh_interpreter_under_torchrun(cluster):
    for node in ("node-a", "node-b"):  # the agents read the setting at each launch, from their environment
        cluster.kill_proc(node, signal.SIGTERM)
    cluster.env["TRAINYARD_WARM_RANKS"] = "0"
    try:
        for node in ("node-a", "node-b"):
            cluster.start_proc(node)
        cluster.wait_for(lambda: all(n["status"] == "READY" for n in cluster.get("/api/v1/nodes/")["results"]),
                         60, "both agents back")
        done, launchers, took = kill_and_resume(cluster, "cold")
    finally:
        cluster.env.pop("TRAINYARD_WARM_RANKS")
    assert all(cmd[1:3] == ["-m", "torch.distributed.run"] for cmd in launchers), launchers
    assert done["restarts"] == 1 and took < BOUND_S * 2, took
