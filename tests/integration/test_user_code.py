"""Issue 12 end to end through the real cluster (tests/integration/cluster.py: Redis, daphne, the
Celery control worker and beat, the relay, two node agents): the examples are packed and uploaded
as code bundles (POST /api/v1/code/), submitted as entrypoint jobs, and run by torchrun from the
bundle each node verified and unpacked.

- examples/sdk_ddp (a DDP script with the SDK lines) logs per step, checkpoints, survives a
  kill -9 of one rank and resumes with every step recorded exactly once;
- the same script is preempted by a quota change, checkpoints, yields and resumes;
- examples/plain (no SDK) runs with its logs kept and no telemetry;
- a `python` that does not exist on the nodes fails the attempt at once as user_error.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import warnings
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO
from tests.test_entrypoint import pack_dir

from .cluster import Cluster

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
EXAMPLES = Path(REPO) / "examples"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("usercode"))
    # Reclaim at once when a team is over its quota (the preemption test); nothing else contends.
    c.env["TRAINYARD_RECLAIM_WAIT_S"] = "0"
    # Two tests SIGKILL a rank on node-b; quarantine (2 faults an hour by default) is not under test
    # here, and a quarantined node-b would leave every later 2-node job queued.
    c.env["TRAINYARD_QUARANTINE_FAILURES"] = "10"
    try:
        c.start()
        yield c
    finally:
        c.stop()


def upload(cluster: Cluster, data: bytes, token: str | None = None) -> tuple[int, dict]:
    boundary = uuid.uuid4().hex
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="code.tar.gz"\r\n'
            "Content-Type: application/gzip\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(f"http://{cluster.host}:{cluster.port}/api/v1/code/", data=body, method="POST",
                                 headers={"Authorization": f"Token {token or cluster.token}",
                                          "Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@pytest.fixture(scope="module")
def bundles(cluster) -> dict[str, str]:
    out = {}
    for name in ("sdk_ddp", "plain", "own_model"):
        status, body = upload(cluster, pack_dir(EXAMPLES / name))
        assert status == 201, body
        assert body["bundle"].startswith("sha256:") and body["files"] >= 2, body
        out[name] = body["bundle"]
    return out


def sdk_spec(name: str, bundle: str, steps: int, every: int, *, nodes: int = 2, procs: int = 1,
             sleep: float = 0.05) -> dict:
    return {"name": name, "code": {"bundle": bundle}, "entrypoint": {"script": "train.py"},
            "config": {"hidden": 32, "batch": 16, "step_sleep_s": sleep},
            "train": {"steps": steps}, "resources": {"nodes": nodes, "procs_per_node": procs},
            "checkpoint": {"every_steps": every, "keep": 3}}


def checkpoints(cluster: Cluster, job_id: int) -> list[dict]:
    return cluster.get(f"/api/v1/jobs/{job_id}/checkpoints/?page_size=500")["results"]


def event_kinds(cluster: Cluster, job_id: int) -> list[str]:
    return [e["kind"] for e in cluster.get(f"/api/v1/jobs/{job_id}/events/?page_size=500")["results"]]


def log_lines(cluster: Cluster, job_id: int, rank: int, attempt: int) -> list[str]:
    """One rank's kept output in one attempt (the relay keeps it on disk after the job)."""
    page = cluster.get(f"/api/v1/jobs/{job_id}/logs/?rank={rank}&attempt={attempt}&limit=5000")
    assert page["next_offset"] is None, page  # all of it in one page
    return page["lines"]


def assert_each_step_once(cluster: Cluster, job_id: int, steps: int, world: int) -> list[dict]:
    rows = cluster.metrics(job_id)
    keys = [(r["rank"], r["step"]) for r in rows]
    assert len(keys) == len(set(keys)), "a step's metrics appear twice"
    assert set(keys) == {(r, s) for r in range(world) for s in range(1, steps + 1)}
    return rows


def manage(cluster: Cluster, *args: str) -> str:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, env=cluster.env, check=True,
                          capture_output=True, text=True).stdout.strip()


def member(cluster: Cluster, username: str, team: str) -> str:
    manage(cluster, "shell", "-c",
           "from django.contrib.auth.models import Group, User; "
           f"g, _ = Group.objects.get_or_create(name='{team}'); "
           f"u, _ = User.objects.get_or_create(username='{username}'); u.groups.add(g)")
    return manage(cluster, "api_token", username)


def test_an_outside_model_trains_under_the_jobs_plan_with_every_ranks_role_on_the_job(cluster, bundles):
    """examples/own_model (a minGPT-style model of its own) through the cluster: run.prepare applies
    top-k compression with error feedback and 2 micro-batches a step; the samples carry the bytes
    and ratio, the job's ranks their plan."""
    steps = 30
    job = cluster.submit({"name": "own-model", "code": {"bundle": bundles["own_model"]},
                          "entrypoint": {"script": "train.py"},
                          "train": {"steps": steps, "global_batch": 16, "grad_accum": 2},
                          "comm": {"compression": "topk", "ratio": 0.05, "start_step": 5},
                          "resources": {"nodes": 2, "procs_per_node": 1}, "checkpoint": {"every_steps": 10}})
    done = cluster.wait_status(job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    rows = assert_each_step_once(cluster, job["id"], steps, 2)
    assert all(r["bytes_sent"] > 0 and r["comm_s"] > 0 for r in rows)
    assert all(r["compression_ratio"] > 5 for r in rows if r["step"] > 5), [r["compression_ratio"] for r in rows]
    assert all(r["tokens_per_s"] > 0 for r in rows)  # prepare saw the sequence length
    ranks = done["attempts"][0]["ranks"]
    assert [r["strategy"] for r in ranks] == ["ddp", "ddp"] and "replica 1 of 2" in ranks[1]["role"]
    # its knowledge record has the shape run.prepare described, so the knowledge base can match it
    record = cluster.wait_for(lambda: next((r for r in cluster.get("/api/v1/knowledge/?kind=user")["results"]
                                            if r["job"] == job["id"]), None), 60, "the knowledge record")
    assert record["model"] == {"kind": "user", "layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64,
                               "params": 30080}, record
    assert record["global_batch"] == 16 and record["measured"]["tokens_per_s"] > 0


# The plans not exercised by another test here, each an entrypoint job of examples/own_model
# through the cluster: (config, parallel, comm, resources, each rank's strategy, a phrase of rank 1's role).
MORE_PLANS = {
    "local-sgd": ({}, {}, {"sync": "local_sgd", "period": 4, "start_step": 4}, (2, 1), "ddp", "replica 1 of 2"),
    "zero1-recompute": ({}, {"shard_optimizer": True, "recompute": "full"}, {}, (2, 1), "ddp", "ZeRO-1"),
    "dp-x-tp": ({"arch": "llama"}, {"dp": 2, "tp": 2}, {}, (2, 2), "dp x tp", "tp rank 1 of 2"),
}


@pytest.mark.parametrize("name", list(MORE_PLANS))
def test_an_outside_model_trains_under_more_plans_through_the_cluster(name, cluster, bundles):
    config, parallel, comm, (nodes, procs), strategy, role = MORE_PLANS[name]
    steps = 16
    job = cluster.submit({"name": f"own-{name}", "code": {"bundle": bundles["own_model"]},
                          "entrypoint": {"script": "train.py"}, "config": config,
                          "train": {"steps": steps, "global_batch": 16}, "parallel": parallel, "comm": comm,
                          "resources": {"nodes": nodes, "procs_per_node": procs}, "checkpoint": {"every_steps": 8}})
    done = cluster.wait_status(job["id"], TERMINAL, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    rows = assert_each_step_once(cluster, job["id"], steps, nodes * procs)
    ranks = done["attempts"][0]["ranks"]
    assert [r["strategy"] for r in ranks] == [strategy] * (nodes * procs) and role in ranks[1]["role"], ranks
    if comm.get("sync") == "local_sgd":  # after step 4 the replicas average every 4 steps, sending nothing between
        sent = {r["step"]: r["bytes_sent"] for r in rows if r["rank"] == 0}
        assert [s for s in range(5, steps + 1) if sent[s] > 0] == [5, 9, 13], sent


def kill_rank_1_mid_run(cluster: Cluster, bundle: str, name: str, *, config: dict, parallel: dict,
                        resources: dict, steps: int = 120) -> dict:
    """The example's model under `parallel`, rank 1 SIGKILLed after the first checkpoint: the job
    resumes from it and trains every step once; returns the second attempt."""
    job = cluster.submit({"name": name, "code": {"bundle": bundle}, "entrypoint": {"script": "train.py"},
                          "config": {**config, "step_sleep_s": 0.05}, "train": {"steps": steps, "global_batch": 16},
                          "parallel": parallel, "resources": resources, "checkpoint": {"every_steps": 20}})
    ckpt = cluster.wait_for(lambda: next((c for c in checkpoints(cluster, job["id"]) if c["step"] >= 20), None),
                            180, "the first checkpoint", job_id=job["id"])
    running = cluster.job(job["id"])
    assert running["status"] == "RUNNING" and running["step"] < steps, running
    victim = next(r for r in running["attempts"][0]["ranks"] if r["rank"] == 1)
    psutil.Process(victim["pid"]).send_signal(signal.SIGKILL)
    done = cluster.wait_status(job["id"], TERMINAL, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    first, second = done["attempts"][:2]
    assert first["outcome"] == "failed:signal" and second["resumed_from_step"] >= ckpt["step"], done
    rows = assert_each_step_once(cluster, job["id"], steps, 2)
    assert {r["attempt"] for r in rows if r["step"] > second["resumed_from_step"]} == {second["id"]}
    return second


def test_an_outside_model_under_fsdp_killed_mid_run_resumes_with_every_step_once(cluster, bundles):
    second = kill_rank_1_mid_run(cluster, bundles["own_model"], "own-fsdp", config={}, parallel={"fsdp": True},
                                 resources={"nodes": 2, "procs_per_node": 1})
    assert [r["strategy"] for r in second["ranks"]] == ["fsdp", "fsdp"] and "shard 0 of 2" in second["ranks"][0]["role"]


def test_an_outside_llama_under_tp_killed_mid_run_resumes_with_every_step_once(cluster, bundles):
    """The example's Llama-style model (config.arch llama) under tp 2 on one node: run.prepare splits
    q/k/v/o and gate/up/down by their names; a SIGKILLed rank resumes from the tp checkpoint."""
    second = kill_rank_1_mid_run(cluster, bundles["own_model"], "own-tp", config={"arch": "llama"},
                                 parallel={"dp": 1, "tp": 2}, resources={"nodes": 1, "procs_per_node": 2})
    assert [r["strategy"] for r in second["ranks"]] == ["tp", "tp"]
    assert "tp rank 1 of 2" in second["ranks"][1]["role"] and "heads 2-3 of 4" in second["ranks"][1]["role"]


def test_parallel_auto_plans_an_outside_model_on_its_ranks_and_the_job_shows_the_choice(cluster, bundles):
    """`parallel: auto` for user code: the Launch carries the cluster's device facts and constants,
    every rank plans the described Llama-style model alike and applies the plan; rank 0's choice
    becomes the job's plan.auto (the job page's "Chosen by the planner")."""
    steps = 20
    job = cluster.submit({"name": "own-auto", "code": {"bundle": bundles["own_model"]},
                          "entrypoint": {"script": "train.py"}, "config": {"arch": "llama", "seq_len": 16},
                          "train": {"steps": steps, "global_batch": 16}, "parallel": "auto",
                          "resources": {"nodes": 1, "procs_per_node": 2}, "checkpoint": {"every_steps": 10}})
    assert job["spec"]["parallel"] == "auto" and "run.prepare" in job["plan"]["source"], job["plan"]
    done = cluster.wait_status(job["id"], TERMINAL, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    auto = done["plan"]["auto"]
    chosen = auto["chosen"]
    assert chosen["dp"] * chosen["tp"] == 2 and auto["candidates"] >= 2 and auto["runners_up"], auto
    assert done["plan"]["source"].startswith("auto: run.prepare's best of")
    want = "tp" if chosen["tp"] == 2 else "fsdp" if chosen["fsdp"] else "ddp"
    assert [r["strategy"] for r in done["attempts"][0]["ranks"]] == [want, want]
    assert_each_step_once(cluster, job["id"], steps, 2)


def test_an_outside_model_under_balance_gives_the_slowed_rank_a_smaller_share(cluster, bundles):
    """train.balance auto for user code (examples/own_model/job-balance.yaml): rank 1 on node-b
    sleeps 10 ms per sample; after the warm-up run.loader hands it fewer samples of each global
    batch, the samples carry each rank's share (always summing to 1), and the split is on the
    job's timeline."""
    steps = 24
    job = cluster.submit({"name": "own-balance", "code": {"bundle": bundles["own_model"]},
                          "entrypoint": {"script": "train.py"}, "config": {"slow_rank": 1, "slow_s": 0.01},
                          "train": {"steps": steps, "global_batch": 32, "balance": "auto"},
                          "resources": {"nodes": 2, "procs_per_node": 1}, "checkpoint": {"every_steps": 12}})
    done = cluster.wait_status(job["id"], TERMINAL, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    rows = assert_each_step_once(cluster, job["id"], steps, 2)
    share = {(r["rank"], r["step"]): r["share"] for r in rows}
    assert all(share[(0, s)] + share[(1, s)] == pytest.approx(1.0) for s in range(1, steps + 1))
    assert share[(1, 1)] == 0.5 and share[(1, steps)] < 0.4, share
    events = cluster.get(f"/api/v1/jobs/{job['id']}/events/?page_size=500")["results"]
    split = next(e for e in events if e["kind"] == "rebalanced")
    assert split["data"]["step"] == 6 and split["data"]["counts"][1] < 16, split
    assert split["message"].startswith("batch split by measured speed from step 7: rank 0 ")


def test_sdk_script_killed_mid_run_resumes_from_its_checkpoint_with_every_step_once(cluster, bundles):
    steps = 160
    job = cluster.submit(sdk_spec("sdk-kill", bundles["sdk_ddp"], steps, 20))
    assert job["spec"]["entrypoint"]["script"] == "train.py" and job["spec"]["model"] is None
    ckpt = cluster.wait_for(lambda: next((c for c in checkpoints(cluster, job["id"]) if c["step"] >= 20), None),
                            180, "the SDK script's first checkpoint")
    running = cluster.job(job["id"])
    first_attempt = running["attempts"][0]
    assert running["status"] == "RUNNING" and running["step"] < steps, running
    victim = next(r for r in first_attempt["ranks"] if r["rank"] == 1)
    psutil.Process(victim["pid"]).send_signal(signal.SIGKILL)

    done = cluster.wait_status(job["id"], TERMINAL, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    first, second = done["attempts"][:2]
    assert first["outcome"] == "failed:signal" and first["failure"]["rank"] == 1, first
    assert second["resumed_from"] is not None and second["resumed_from_step"] >= ckpt["step"], second
    assert done["step"] == steps and done["restarts"] == 1 and len(done["attempts"]) == 2
    rows = assert_each_step_once(cluster, job["id"], steps, 2)
    assert all(r["loss"] is not None and r["samples_per_s"] > 0 for r in rows)
    assert all(r["data_s"] is not None and r["compute_s"] is not None for r in rows)  # run.phase(...)
    assert all(r["metrics"] == {"lr": pytest.approx(3e-3)} for r in rows)  # the script's own metric
    assert done["has_telemetry"] is True
    assert {r["attempt"] for r in rows if r["step"] > second["resumed_from_step"]} == {second["id"]}
    kinds = event_kinds(cluster, job["id"])
    assert "restart" in kinds and kinds.count("attempt_started") == 2 and kinds[-1] == "succeeded"
    # the script's own output, kept per attempt: the second one started after the checkpoint
    assert f"sdk_ddp: rank 0/2 on cpu, steps 1..{steps}" in log_lines(cluster, job["id"], 0, first["id"])
    lines = log_lines(cluster, job["id"], 0, second["id"])
    assert f"sdk_ddp: rank 0/2 on cpu, steps {second['resumed_from_step'] + 1}..{steps}" in lines, lines[:5]
    assert "sdk_ddp: rank 0 finished" in lines and f"sdk_ddp: rank 0/2 on cpu, steps 1..{steps}" not in lines


def test_a_script_without_the_sdk_runs_with_its_logs_and_no_telemetry(cluster, bundles):
    job = cluster.submit({"name": "plain", "code": {"bundle": bundles["plain"]},
                          "entrypoint": {"script": "train.py", "args": ["--steps", "12", "--lr", "0.02"]},
                          "resources": {"nodes": 2, "procs_per_node": 1}})
    done = cluster.wait_status(job["id"], TERMINAL, 240)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    *retried, attempt = done["attempts"]
    for earlier in retried:
        # A retry is the platform doing its job after an infrastructure fault (CI saw one second
        # attempt here once, 1 run in 6, on a loaded 2-core machine); never after the script's own
        # error. Say which, so that a recurring cause shows in the warnings summary.
        assert earlier["failure"].get("class") not in (None, "user_error", "oom"), earlier
        warnings.warn(f"plain job {job['id']}: attempt {earlier['number']} ended {earlier['outcome']}: "
                      f"{earlier['failure'].get('message')}", stacklevel=1)
    assert attempt["outcome"] == "succeeded" and sorted(r["rank"] for r in attempt["ranks"]) == [0, 1]
    for rank in (0, 1):
        lines = log_lines(cluster, job["id"], rank, attempt["id"])
        assert f"plain: rank {rank}/2 on cpu, 12 steps" in lines and f"plain: rank {rank} done" in lines, lines
        assert sum(line.startswith("plain: step ") and f"rank {rank} loss" in line for line in lines) == 12
    assert cluster.metrics(job["id"]) == []  # nothing was reported: no empty rows either
    assert done["has_telemetry"] is False  # what the job page turns into "telemetry unavailable"


def test_a_python_missing_on_the_nodes_fails_fast_as_user_error(cluster, bundles):
    started = time.monotonic()
    job = cluster.submit({"name": "no-python", "code": {"bundle": bundles["plain"]},
                          "entrypoint": {"script": "train.py"}, "python": "/usr/nowhere/bin/python",
                          "resources": {"nodes": 2, "procs_per_node": 1}, "max_restarts": 3})
    done = cluster.wait_status(job["id"], TERMINAL, 90)
    assert time.monotonic() - started < 60
    assert done["status"] == "FAILED" and done["restarts"] == 0 and len(done["attempts"]) == 1, done
    attempt = done["attempts"][0]
    assert attempt["outcome"] == "failed:user_error", attempt
    assert "python '/usr/nowhere/bin/python' does not exist on node node-" in attempt["failure"]["message"]
    assert attempt["ranks"] == []


def test_sdk_script_preempted_by_a_quota_change_checkpoints_yields_and_resumes(cluster, bundles):
    """Last in this module: the quotas it sets stay."""
    vera, nick = member(cluster, "vera", "vision"), member(cluster, "nick", "nlp")
    status, body = cluster.request("PUT", "/api/v1/quotas/", [{"team": "vision", "max_slots": 4},
                                                               {"team": "nlp", "max_slots": 2}])
    assert status == 200, body
    steps = 400
    status, big = cluster.request("POST", "/api/v1/jobs/", sdk_spec("vision-big", bundles["sdk_ddp"], steps, 25,
                                                                    procs=2), token=vera)
    assert status == 201, big
    cluster.wait_for(lambda: checkpoints(cluster, big["id"]), 240, "the vision job's first checkpoint")
    small = {"name": "nlp-plain", "code": {"bundle": bundles["plain"]},
             "entrypoint": {"script": "train.py", "args": ["--steps", "10"]},
             "resources": {"nodes": 1, "procs_per_node": 2}}
    status, small = cluster.request("POST", "/api/v1/jobs/", small, token=nick)
    assert status == 201, small
    cluster.wait_for(lambda: "waiting" in cluster.job(small["id"])["status_reason"], 30, "the nlp job to wait")
    assert cluster.job(big["id"])["borrowing"] is False

    status, body = cluster.request("PUT", "/api/v1/quotas/", [{"team": "vision", "max_slots": 2}])
    assert status == 200, body
    preempted = cluster.wait_for(lambda: (j := cluster.job(big["id"]))["attempts"][0]["outcome"] == "preempted" and j,
                                 120, "the vision job to be preempted")
    first = preempted["attempts"][0]
    assert first["last_step"] < steps, first
    # the SDK saved at the step the ranks agreed to stop at: the newest checkpoint is that step
    assert max(c["step"] for c in checkpoints(cluster, big["id"])) == first["last_step"]
    kinds = event_kinds(cluster, big["id"])
    assert "preempt_requested" in kinds and "preempted" in kinds and "preempt_forced" not in kinds

    done_small = cluster.wait_status(small["id"], TERMINAL, 240)
    assert done_small["status"] == "SUCCEEDED", done_small
    done_big = cluster.wait_status(big["id"], TERMINAL, 400)
    assert done_big["status"] == "SUCCEEDED" and done_big["step"] == steps, (done_big, cluster.logs())
    assert done_big["attempts"][1]["resumed_from_step"] == first["last_step"]
    assert_each_step_once(cluster, big["id"], steps, 4)
