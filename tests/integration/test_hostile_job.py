"""Issue 21's hostile-job suite, through the real cluster (make run's process set: Redis with its ACL
users, daphne, the control worker and beat, the relay, two sandboxing node agents).

An ordinary user (eve) submits tests/integration/hostile_job/train.py as a code bundle while
another user's job (bob's, examples/sdk_ddp) runs beside it. The script trains a few steps through
the SDK, then tries to read the node's and the control plane's secrets, reach bob's files, write
bob's stream, register a planted checkpoint for bob, set bob's preemption key, pause the bus and
signal bob's ranks and the agents. Every probe must fail (on the code before issue 21 every one of
them got through), bob's job must finish with every step once and nothing of eve's in it, and eve's
own telemetry and checkpoints must still work.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_entrypoint import pack_dir
from trainyard import keys, redis_acl

from .cluster import Cluster
from .test_user_code import EXAMPLES, member, sdk_spec, upload

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]
HOSTILE = Path(__file__).resolve().parent / "hostile_job"
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
CANARY = "trainyard-canary-secret"
VICTIM_STEPS = 400


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("hostile"))
    try:
        c.start()
        # What `make run` keeps in its state directory (scripts/run.sh): 0600 files of the control plane.
        for name in ("secret_key", "admin_password"):
            path = c.dir / "var" / name
            path.write_text(f"{CANARY} {name}\n")
            os.chmod(path, 0o600)
        yield c
    finally:
        c.stop()


def as_user(cluster: Cluster, token: str):
    def call(method, path, body=None):
        return cluster.request(method, path, body, token=token)
    return call


def victim_job(cluster: Cluster, bob: str) -> tuple[dict, dict, str]:
    status, bundle = upload(cluster, pack_dir(EXAMPLES / "sdk_ddp"), token=bob)
    assert status == 201, bundle
    status, job = as_user(cluster, bob)("POST", "/api/v1/jobs/", sdk_spec("bob-training", bundle["bundle"], VICTIM_STEPS, 20))
    assert status == 201, job
    running = cluster.wait_running_ranks(job["id"], 2)
    cluster.wait_for(lambda: cluster.job(job["id"])["step"] >= 25, 240, "bob's job to checkpoint and go on")
    return job, running["attempts"][-1], bundle["bundle"]


def targets(cluster: Cluster, job: dict, attempt: dict, bundle: str) -> dict:
    var = cluster.dir / "var"
    run_dirs = {f"victim_run_dir_{r['node']}": str(cluster.dir / "agents" / r["node"] / f"attempt-{attempt['id']}")
                for r in attempt["ranks"]}
    return {
        "read": {
            "node_credential": str(cluster.dir / "credentials" / "node-a"),
            "control_redis_password": str(redis_acl.password_path(cluster.redis.dir, redis_acl.CONTROL_USER)),
            "node_redis_password": str(redis_acl.password_path(cluster.redis.dir, "node-a")),
            "secret_key": str(var / "secret_key"), "admin_password": str(var / "admin_password"),
            "database": cluster.env.get("TRAINYARD_DB", str(cluster.dir / "db.sqlite3")),
            "victim_bundle": str(keys.bundle_path(var / "artifacts", bundle)),
            "victim_config": str(cluster.dir / "agents" / attempt["ranks"][0]["node"] / f"attempt-{attempt['id']}"
                                 / "config.json"),
        },
        "dirs": {"victim_checkpoints": str(cluster.dir / "ckpt" / f"job-{job['id']}"), **run_dirs,
                 "state_dir": str(var)},
        "victim": {"job": job["id"], "attempt": attempt["id"],
                   "checkpoint_dir": str(cluster.dir / "ckpt" / f"job-{job['id']}"),
                   "streams": [f"trainyard:job:{job['id']}", f"trainyard:job:{job['id']}:a{attempt['id']}"]},
        "pids": {**{f"victim_rank_{r['rank']}": r["pid"] for r in attempt["ranks"]},
                 **{f"process_{name}": proc.pid for name, proc in cluster.procs.items()}},
    }


def probes(cluster: Cluster, job_id: int, token: str) -> list[dict]:
    status, page = as_user(cluster, token)("GET", f"/api/v1/jobs/{job_id}/logs/?rank=0&limit=5000")
    assert status == 200, page
    lines = page["lines"]
    assert "PROBES DONE" in lines, lines[-40:]
    return [json.loads(line[len("PROBE "):]) for line in lines if line.startswith("PROBE ")]


def test_a_hostile_job_reaches_nothing_of_the_node_the_control_plane_or_another_job(cluster):
    bob, eve = member(cluster, "bob", "vision"), member(cluster, "eve", "nlp")
    victim, attempt, bundle = victim_job(cluster, bob)
    status, code = upload(cluster, pack_dir(HOSTILE), token=eve)
    assert status == 201, code
    spec = {"name": "eve-probe", "code": {"bundle": code["bundle"]}, "entrypoint": {"script": "train.py"},
            "config": {"targets": targets(cluster, victim, attempt, bundle)}, "train": {"steps": 5},
            "resources": {"nodes": 1, "procs_per_node": 1}, "checkpoint": {"every_steps": 5}, "max_restarts": 0}
    status, job = as_user(cluster, eve)("POST", "/api/v1/jobs/", spec)
    assert status == 201, job
    done = cluster.wait_status(job["id"], TERMINAL, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())

    results = probes(cluster, job["id"], eve)
    reached = [r for r in results if r["reached"]]
    assert not reached, json.dumps(reached, indent=1)
    names = {r["name"].split(":")[0] for r in results}
    assert len(results) >= 30 and {"env_node_secrets", "node_credential", "secret_key", "xadd_victim_stream",
                                   "register_planted_checkpoint", "set_victim_preempt_key", "client_pause",
                                   "victim_rank_0", "process_node-a", "victim_checkpoints_write"} <= names, names

    # Eve's own job worked as any job does: its telemetry and its checkpoint.
    own = cluster.get(f"/api/v1/jobs/{job['id']}/metrics/?limit=100")
    assert sorted({m["step"] for m in own}) == [1, 2, 3, 4, 5]
    assert [c["step"] for c in cluster.get(f"/api/v1/jobs/{job['id']}/checkpoints/")["results"]] == [5]

    # Bob's job is untouched: every step once, only its own checkpoints, nothing planted.
    done = cluster.wait_status(victim["id"], TERMINAL, 400)
    assert done["status"] == "SUCCEEDED" and len(done["attempts"]) == 1, done
    rows = cluster.get(f"/api/v1/jobs/{victim['id']}/metrics/?per_rank=1&limit=10000")
    assert {(r["rank"], r["step"]) for r in rows} == {(r, s) for r in (0, 1) for s in range(1, VICTIM_STEPS + 1)}
    assert len(rows) == 2 * VICTIM_STEPS
    steps = [c["step"] for c in cluster.get(f"/api/v1/jobs/{victim['id']}/checkpoints/")["results"]]
    assert steps and all(s % 20 == 0 or s == VICTIM_STEPS for s in steps), steps
    planted = [str(p) for p in cluster.dir.rglob("planted-by-hostile-job")]
    assert planted == [] and not list((cluster.dir / "ckpt").rglob("step-99999999-*"))
    for name in ("secret_key", "admin_password"):
        assert (cluster.dir / "var" / name).read_text().startswith(CANARY)


def test_the_node_agent_refuses_to_start_where_the_sandbox_cannot_be_made(cluster, tmp_path):
    """A node without bubblewrap refuses to start and says what is missing, unless the operator
    sets TRAINYARD_INSECURE_NO_SANDBOX=1 (then it starts, loudly)."""
    import subprocess
    import sys

    env = {**cluster.env, "REDIS_URL": cluster.redis.user_url("node-b"), "TRAINYARD_BWRAP": "/nonexistent/bwrap"}
    argv = [sys.executable, "-m", "workers.agent", "--name", "node-x", "--address", "127.0.0.1", "--slots", "1",
            "--run-dir", str(tmp_path)]
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "cannot start" in out.stderr and "bubblewrap" in out.stderr, out.stderr[-2000:]
