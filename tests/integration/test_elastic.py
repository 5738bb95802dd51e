"""Issue 24, section 2, through a real cluster (redis, daphne, Celery control worker + beat, relay,
two node agents, torchrun with gloo ranks): an elastic job `nodes: {min: 1, max: 2}` starts on one
node while the other is busy, grows to two when it frees (a cooperative stop at a checkpoint and
an immediate restart on both), survives the loss of a node by shrinking onto the survivor without
waiting in the queue or counting a restart, and trains every step exactly once into the job's
line (the global batch is kept on every world: the data order is the same, so the line is one).
Reclaim's shrink is covered on the database (tests/jobs/scheduling/test_elastic_services.py)."""
from __future__ import annotations


import psutil
import pytest

from .cluster import Cluster, attempt_processes
from .test_chaos import chaos, events, wait_checkpoint

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("elastic"))
    c.chaos_dir = c.dir / "chaos"
    c.chaos_dir.mkdir()
    c.env.update({"TRAINYARD_CHAOS_DIR": str(c.chaos_dir), "TRAINYARD_ELASTIC_GROW_MIN_S": "0"})
    try:
        c.start()
        yield c
    finally:
        c.stop()


def spec(name: str, steps: int, every: int, resources: dict) -> dict:
    return {"name": name, "model": {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 2, "seq_len": 64},
            "train": {"steps": steps, "global_batch": 16, "seed": 3},
            "checkpoint": {"every_steps": every, "keep": 3}, "resources": resources}


def kill_node(cluster, node: str, attempt: dict) -> None:
    """The machine dies: its agent, and the attempt's torchrun and ranks on it."""
    cluster.kill_proc(node)
    ours = {p.pid: p for p in attempt_processes(attempt["id"])}
    for r in attempt["ranks"]:
        if r["node"] != node:
            continue
        try:
            p = psutil.Process(r["pid"])
            for q in [p, *p.parents()]:
                if q.pid in ours:
                    q.kill()
        except psutil.Error:
            pass


def assert_one_line(cluster, job_id: int, steps: int) -> dict[int, int]:
    """Every step 1..steps once: one world's ranks each (no step twice, none missing); returns
    {step: world}."""
    rows = cluster.metrics(job_id)
    keys = [(r["rank"], r["step"]) for r in rows]
    assert len(keys) == len(set(keys)), "a step's metrics appear twice"
    ranks: dict[int, set[int]] = {}
    for rank, step in keys:
        ranks.setdefault(step, set()).add(rank)
    assert sorted(ranks) == list(range(1, steps + 1)), "steps missing from the job's line"
    for step, got in ranks.items():
        assert got in ({0, 1}, {0, 1, 2, 3}), (step, got)
    return {step: len(got) for step, got in ranks.items()}


def test_elastic_job_starts_small_grows_and_shrinks_on_node_loss(cluster):
    steps = 600
    busy = cluster.submit(spec("busy", 1_000_000, 100_000, {"nodes": 1, "procs_per_node": 2}))
    busy_run = cluster.wait_running_ranks(busy["id"], 2)
    busy_node = busy_run["attempts"][0]["ranks"][0]["node"]

    job = cluster.submit(spec("elastic", steps, 20, {"nodes": {"min": 1, "max": 2}, "procs_per_node": 2}))
    chaos(cluster, job["id"], slow_rank=1, slow_s=0.05)  # pace the steps so each phase sees some
    first = cluster.wait_running_ranks(job["id"], 2)
    assert {r["node"] for r in first["attempts"][-1]["ranks"]} == {"node-a", "node-b"} - {busy_node}
    wait_checkpoint(cluster, job["id"], 20)

    status, _ = cluster.request("POST", f"/api/v1/jobs/{busy['id']}/cancel/")  # the busy node frees
    assert status == 202
    grown = cluster.wait_running_ranks(job["id"], 4, 180)
    assert {r["node"] for r in grown["attempts"][-1]["ranks"]} == {"node-a", "node-b"}
    assert grown["attempts"][-2]["outcome"] == "preempted" and grown["restarts"] == 0
    ckpt = wait_checkpoint(cluster, job["id"], grown["attempts"][-1]["resumed_from_step"] + 20)

    victim = "node-b"
    kill_node(cluster, victim, grown["attempts"][-1])
    shrunk = cluster.wait_running_ranks(job["id"], 2, 180)
    last = shrunk["attempts"][-1]
    assert {r["node"] for r in last["ranks"]} == {"node-a"}
    assert shrunk["attempts"][-2]["outcome"] == "lost" and shrunk["restarts"] == 0
    assert last["resumed_from_step"] >= ckpt["step"]
    evs = events(cluster, job["id"])
    kinds = [e["kind"] for e in evs]
    assert "shrinking" in kinds and "restart" not in kinds
    # no wait in the queue for a full gang: the restart was placed as soon as the lost attempt ended
    ended = next(e for e in evs if e["kind"] == "attempt_ended" and e["data"].get("outcome") == "lost")
    started = [e for e in evs if e["kind"] == "attempt_started" and e["id"] > ended["id"]][0]
    gap = _ts(started["created_at"]) - _ts(ended["created_at"])
    assert gap < 10, gap

    done = cluster.wait_status(job["id"], TERMINAL, 400)
    assert done["status"] == "SUCCEEDED", (done["status_reason"], cluster.logs())
    assert [h["nodes"] for h in done["node_history"]] == [1, 2, 1]
    resized = [e for e in events(cluster, job["id"]) if e["kind"] == "resized"]
    assert [e["data"]["nodes"] for e in resized] == [1, 2, 1]
    assert "growing from 1 to 2" in resized[1]["message"] and f"node {victim} was lost" in resized[2]["message"]
    cluster.wait_for(lambda: len({(r["rank"], r["step"]) for r in cluster.metrics(job["id"])}) >= steps * 2, 60,
                     "every metric")
    worlds = assert_one_line(cluster, job["id"], steps)
    assert set(worlds.values()) == {2, 4}


def _ts(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()
