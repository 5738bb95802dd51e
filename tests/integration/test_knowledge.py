"""Issue 13, the knowledge base end to end with real processes (tests/integration/cluster.py:
redis, daphne, the Celery control worker and beat, the relay, two node agents, torchrun): a short
demo-GPT job on both nodes ends SUCCEEDED and leaves exactly one record, whose measured step time
is the median of its warm steps as the metrics API shows them, visible in GET /api/v1/knowledge/;
the next job of a nearby shape is predicted from it."""
from __future__ import annotations

import statistics

import pytest

from .cluster import Cluster

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
STEPS = 20
SPEC = {"name": "kb-demo", "train": {"steps": STEPS, "global_batch": 32},
        "resources": {"nodes": 2, "procs_per_node": 1}, "checkpoint": {"every_steps": 50}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("knowledge"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def warm_median(metrics: list[dict]) -> tuple[float, int]:
    """What the record must say, from the metrics API: per step the slowest rank, the first 3 steps left out."""
    slowest: dict[int, float] = {}
    for m in metrics:
        slowest[m["step"]] = max(slowest.get(m["step"], 0.0), m["step_s"])
    warm = [slowest[s] for s in sorted(slowest)[3:]]
    return statistics.median(warm), len(warm)


def test_a_finished_job_leaves_one_record_with_its_measured_step_time(cluster):
    job = cluster.submit(SPEC)
    done = cluster.wait_status(job["id"], TERMINAL, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    metrics = cluster.wait_for(lambda: len(m := cluster.metrics(job["id"])) == 2 * STEPS and m, 60,
                               "every sample committed by the relay")
    expected, warm = warm_median(metrics)
    assert warm == STEPS - 3

    def record():  # written at the attempt's end; samples the relay commits later rewrite it
        rows = [r for r in cluster.get("/api/v1/knowledge/")["results"] if r["job"] == job["id"]]
        return rows if rows and rows[0]["measured"]["warm_steps"] == warm else None
    rows = cluster.wait_for(record, 30, "the job's knowledge record with every warm step")
    assert len(rows) == 1
    rec = rows[0]
    assert rec["attempt"] == 1 and rec["model"] == {"kind": "gpt", "layers": 4, "hidden": 128, "heads": 4,
                                                    "seq_len": 128, "vocab": 256, "params": 875_264}
    assert rec["cluster"] == {"nodes": 2, "procs_per_node": 1, "world": 2, "device": "cpu"}
    assert rec["plan"]["dp"] == 2 and rec["plan"]["micro_batch"] == 16 and rec["global_batch"] == 32
    measured = rec["measured"]
    assert measured["step_time_s"] == pytest.approx(expected)
    # sane: the demo GPT (16 x 128 tokens per rank) takes ~0.25 s a step on one CPU thread here
    assert 0.01 < measured["step_time_s"] < 10.0, measured
    assert measured["tokens_per_s"] == pytest.approx(32 * 128 / expected)
    assert measured["mem_bytes"] > 50e6  # the ranks' resident memory: python + torch
    assert measured["mem_bytes"] == max(m["mem_bytes"] for m in metrics)
    assert 0 < measured["tflops_per_device"] < 1.0
    # the spec chose the plan; the planner predicted it at submit (the job's plan["planner"])
    planner = job["plan"]["planner"]
    assert rec["predicted"] == {"step_time_s": planner["step_time_s"], "memory_gb": planner["memory_gb_per_device"]}
    assert rec["error"]["step_time"] == pytest.approx((planner["step_time_s"] - expected) / expected, abs=1e-3)
    assert any(b["model"]["layers"] == 4 and b["plan"]["dp"] == 2 for b in cluster.get("/api/v1/knowledge/")["best"])

    # the next job of the same shape but twice the batch has no run of its own: the record predicts it
    nxt = cluster.submit({**SPEC, "name": "kb-next", "train": {"steps": 10_000, "global_batch": 64}})
    assert nxt["plan"]["prediction_source"] == "knowledge: 1 run of nearest shape", nxt["plan"]
    status, _ = cluster.request("POST", f"/api/v1/jobs/{nxt['id']}/cancel/")
    assert status == 202
    cluster.wait_status(nxt["id"], TERMINAL, 120)
