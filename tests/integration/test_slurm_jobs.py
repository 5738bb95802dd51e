"""Issue 27 end to end: Trainyard on a real Slurm cluster. Four test hosts on a bridge
(tests/integration/hosts.py): `cp` runs the control plane (Redis with its ACL users, the web server,
the control worker, beat, the relay; no node agent of its own), and `gpu-1`..`gpu-3` one slurmd each
(tests/integration/slurm_cluster.py: munged, slurmctld on the bridge's gateway address). Staff
configure the Slurm pool `lab` with `manage.py pool_set`; jobs ask for it with `resources.pool`.
Every attempt becomes one `sbatch` whose `srun` starts an ephemeral agent on each allocated node
(workers/slurm_agent.py), which registers as one of the pool's seats with a credential minted for
that Slurm job and launches torchrun as any agent does.

- a 2-node built-in GPT job and an SDK user script go from submit to SUCCEEDED on Slurm's nodes, with
  every rank's telemetry, and their Slurm jobs end by themselves;
- a cancel ends the Slurm job; a request sbatch refuses (no such partition) fails the job at once
  with Slurm's words (a placement failure, not retried);
- Slurm's own preemption (a job in the higher-priority `urgent` partition, PreemptMode=REQUEUE with
  a GraceTime) reaches the ranks as the cooperative stop: they checkpoint, the attempt ends
  `preempted`, the next attempt pends in Slurm with its reason on the job (API and job page) and
  resumes with every step once;
- a node set DOWN mid-run: the attempt ends and the job resumes on the healthy nodes; a node set to
  DRAIN (which Slurm lets the job run on) is left with a checkpoint of the current step;
- the control plane killed and restarted mid-run re-adopts its Slurm job (the job finishes), and an
  orphan carrying our tag with no live attempt is cancelled;
- while `squeue` answers nothing and `scontrol` fails, nothing is written off: the job finishes;
- a pool reached over SSH through a login node (sshd on a test host, a key and a pinned host key)
  runs a job the same way.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from playwright.sync_api import sync_playwright

from tests.conftest import REPO, RedisServer, free_port
from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS, login
from tests.test_entrypoint import pack_dir

from . import hosts
from .cluster import Cluster
from .slurm_cluster import slurm_cluster
from .test_user_code import upload

ok, why = hosts.available()
if ok and not all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
    ok, why = False, "Debian's slurm-wlm and munge are not installed: scripts/ensure_system_deps.sh slurm"
pytestmark = [pytest.mark.procs, pytest.mark.timeout(600),
              pytest.mark.skipif(not ok, reason=f"a Slurm cluster cannot run here: {why}")]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
SLURM_HOSTS = ["gpu-1", "gpu-2", "gpu-3"]
GRACE_S = 20
EXAMPLES = Path(REPO) / "examples"
POOL = "lab"


def gpt(name: str, steps: int, every: int) -> dict:
    return {"name": name, "model": {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 2, "seq_len": 64},
            "train": {"steps": steps, "global_batch": 16, "seed": 3},
            "checkpoint": {"every_steps": every, "keep": 3},
            "resources": {"nodes": 2, "procs_per_node": 1, "pool": POOL}}


def submit_slowed(cluster, spec: dict, slow_s: float = 0.05) -> dict:
    """Submit, then slow rank 0 by slow_s a step (workers/runtime/chaos.py) so the job runs long
    enough for the test to act on it; its peer waits for it in every all-reduce."""
    job = cluster.submit(spec)
    path = cluster.chaos_dir / f"job-{job['id']}.json"
    path.with_suffix(".tmp").write_text(json.dumps({"slow_rank": 0, "slow_s": slow_s}))
    path.with_suffix(".tmp").replace(path)
    return job


class SlurmControlPlane(Cluster):
    """tests/integration/cluster.py's control-plane processes on the test host `cp`, with no node
    agent: every node comes from Slurm."""

    def __init__(self, workdir, net: hosts.Hosts):
        super().__init__(workdir)
        self.net = net
        self.host = net.address("cp")
        self.node_addresses = {}
        self.redis = RedisServer(self.dir / "redis", acl_nodes=[], host=self.host, prefix=net.exec_argv("cp", []))
        self.env.update({"DJANGO_ALLOWED_HOSTS": self.host, "TRAINYARD_SLURM_POLL_S": "1",
                         "TRAINYARD_SLURM_RECONCILE_S": "3", "TRAINYARD_ARTIFACT_ROOT": str(self.dir / "artifacts"),
                         "TRAINYARD_RECLAIM_WAIT_S": "0", "TRAINYARD_QUARANTINE_FAILURES": "50"})

    def commands(self) -> dict[str, list[str]]:
        return {name: self.net.exec_argv("cp", argv) for name, argv in super().commands().items()}

    def start(self) -> "SlurmControlPlane":
        Cluster._live.add(self)
        self.redis.start()
        self.env["REDIS_URL"] = self.redis.url
        for d in ("var", "data", "agents", "ckpt", "artifacts"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        self.token = self.prepare_database()
        for name in self.commands():
            self.start_proc(name)
        self.wait_web()
        return self

    def restart(self, *names: str) -> None:
        for name in names:
            self.kill_proc(name)
        for name in names:
            self.start_proc(name)

    def outliving_pids(self) -> set[int]:
        """The Slurm cluster's daemons, and the job steps under them: its own fixture stops them."""
        pids = set()
        for proc in self.slurm.processes.values():
            pids.add(proc.pid)
            try:
                pids |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            except psutil.Error:
                pass
        return pids

    def manage(self, *args: str) -> str:
        return subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, env=self.env, check=True,
                              capture_output=True, text=True).stdout.strip()


def wrappers(bin_dir: Path, flag: Path) -> None:
    """The pool's Slurm commands: the real ones, except while `flag` exists: then squeue answers
    nothing (rc 0) and scontrol fails, as a controller restarting or a login node's hiccup looks."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for cmd in ("sbatch", "squeue", "sacct", "scontrol", "scancel", "sinfo"):
        real = shutil.which(cmd)
        body = {"squeue": f'[ -e "{flag}" ] && exit 0\n',
                "scontrol": f'[ -e "{flag}" ] && {{ echo "slurm_load_jobs error: Socket timed out" >&2; exit 1; }}\n'}
        path = bin_dir / cmd
        path.write_text(f"#!/bin/sh\n{body.get(cmd, '')}exec {real} \"$@\"\n")
        path.chmod(0o755)


@pytest.fixture(scope="module")
def net():
    if os.environ.get("DATABASE_URL"):
        pytest.skip("the test hosts reach no PostgreSQL server on the machine's loopback")
    with hosts.bridged_hosts(["cp", *SLURM_HOSTS]) as n:
        yield n


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, net):
    hosts_ = [(h, net.namespace(h)) for h in SLURM_HOSTS]
    with slurm_cluster(tmp_path_factory.mktemp("slurm"), hosts_, controller_addr=net.gateway, cpus=2,
                       grace_s=GRACE_S) as s:
        yield s


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, net, slurm):
    c = SlurmControlPlane(tmp_path_factory.mktemp("slurmcp"), net)
    c.slurm = slurm
    c.flag = c.dir / "slurm-silent"
    c.chaos_dir = c.dir / "chaos"
    c.chaos_dir.mkdir(parents=True)
    wrappers(c.dir / "slurm-bin", c.flag)
    try:
        c.start()
        agent_env = {k: c.env[k] for k in ("TRAINYARD_CHECKPOINT_ROOT", "TRAINYARD_DATA_ROOT", "TRAINYARD_ARTIFACT_ROOT",
                                           "TRAINYARD_VAR_DIR", "PYTHONUNBUFFERED")}
        agent_env["TRAINYARD_CHAOS_DIR"] = str(c.chaos_dir)
        out = c.manage("pool_set", POOL, "--json", json.dumps({
            "max_nodes": 3, "slots_per_node": 1, "device": "cpu", "agent_python": sys.executable,
            "agent_code_dir": str(REPO), "agent_run_dir": str(c.dir / "slurm-agents"), "agent_env": agent_env,
            "settings": {"state_dir": str(c.dir / "slurm-state"), "partition": "trainyard",
                         "slurm_conf": str(slurm.conf), "bin_dir": str(c.dir / "slurm-bin"),
                         "time_limit_s": 1800}}))
        assert "pool lab: 3 seat(s)" in out, out
        yield c
    finally:
        c.stop()
        slurm.cancel_all()


def slurm_job(cluster, job_id: int, attempt: int = -1) -> dict:
    return cluster.job(job_id)["attempts"][attempt]["slurm"] or {}


def squeue_state(cluster, slurm_id: str) -> str:
    out = cluster.slurm.run(["squeue", "--noheader", "--states=all", f"--jobs={slurm_id}", "--format=%T"],
                            check=False)
    return out.stdout.strip()


def events(cluster, job_id: int) -> list[dict]:
    return cluster.get(f"/api/v1/jobs/{job_id}/events/?page_size=500")["results"]


def checkpoints(cluster, job_id: int) -> list[dict]:
    return cluster.get(f"/api/v1/jobs/{job_id}/checkpoints/?page_size=500")["results"]


def assert_each_step_once(cluster, job_id: int, steps: int, world: int = 2) -> None:
    keys = [(r["rank"], r["step"]) for r in cluster.metrics(job_id)]
    assert len(keys) == len(set(keys)), "a step's metrics appear twice"
    assert set(keys) == {(r, s) for r in range(world) for s in range(1, steps + 1)}


def ended_in_slurm(cluster, slurm_id: str, timeout_s: float = 60) -> str:
    ended = {"COMPLETED", "CANCELLED", "FAILED", "PREEMPTED", "NODE_FAIL", "TIMEOUT"}
    return cluster.wait_for(lambda: (s := squeue_state(cluster, slurm_id)) in ended and s, timeout_s,
                            f"Slurm job {slurm_id} to end ({squeue_state(cluster, slurm_id)!r})\n{cluster.slurm.logs()}")


def seats_free(cluster) -> bool:
    """No seat of the pool held (the previous test's Slurm job released)."""
    return all(n["status"] == "READY" for n in cluster.get("/api/v1/nodes/")["results"]
               if n["name"].startswith(f"{POOL}-"))


def test_a_two_node_gpt_job_submitted_from_the_cli_runs_on_slurm_nodes_with_live_telemetry(cluster, tmp_path):
    steps = 40
    spec = gpt("slurm-gpt", steps, 20)
    del spec["resources"]["pool"]  # the researcher picks the pool on the command line
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path),
           "TRAINYARD_URL": f"http://{cluster.host}:{cluster.port}", "TRAINYARD_TOKEN": cluster.token}
    out = subprocess.run([sys.executable, "-m", "trainyard.cli", "submit", str(tmp_path / "spec.json"), "--pool", POOL,
                          "--json"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    assert job["spec"]["resources"]["pool"] == POOL, job["spec"]["resources"]
    done = cluster.wait_status(job["id"], TERMINAL, 240)
    assert done["status"] == "SUCCEEDED", cluster.job_state(job["id"]) + cluster.slurm.logs()
    att = done["attempts"][0]
    sj = att["slurm"]
    assert sj["pool"] == POOL and sj["job_id"] and len(sj["seats"]) == 2, sj
    assert set(sj["nodes"]) <= set(SLURM_HOSTS) and len(sj["nodes"]) == 2, sj
    # the ranks ran on the Slurm nodes' addresses (the agents registered as the seats from there)
    addresses = {cluster.net.address(h) for h in SLURM_HOSTS}
    assert {r["node"] for r in att["ranks"]} == set(sj["seats"]), att["ranks"]
    shown = subprocess.run([sys.executable, "-m", "trainyard.cli", "show", str(job["id"])], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=120)
    assert f"Slurm job {sj['job_id']}" in shown.stdout, shown.stdout + shown.stderr
    kinds = [e["kind"] for e in events(cluster, job["id"])]
    assert {"slurm_submitting", "slurm_submitted", "slurm_running"} <= set(kinds), kinds
    running = next(e for e in events(cluster, job["id"]) if e["kind"] == "slurm_running")
    assert any(a in running["message"] for a in addresses), running
    assert_each_step_once(cluster, job["id"], steps)
    # the agents left with their attempt: the Slurm job completed by itself, the seats were released
    assert ended_in_slurm(cluster, sj["job_id"]) == "COMPLETED"
    cluster.wait_for(lambda: seats_free(cluster), 60, "the seats to be released")


def test_an_sdk_user_script_runs_on_slurm_nodes(cluster):
    status, body = upload(cluster, pack_dir(EXAMPLES / "sdk_ddp"))
    assert status == 201, body
    bundle = body["bundle"]
    steps = 30
    job = cluster.submit({"name": "slurm-sdk", "code": {"bundle": bundle}, "entrypoint": {"script": "train.py"},
                          "config": {"hidden": 32, "batch": 16, "step_sleep_s": 0.02}, "train": {"steps": steps},
                          "resources": {"nodes": 2, "procs_per_node": 1, "pool": POOL},
                          "checkpoint": {"every_steps": 10, "keep": 2}})
    done = cluster.wait_status(job["id"], TERMINAL, 240)
    assert done["status"] == "SUCCEEDED", cluster.job_state(job["id"]) + cluster.slurm.logs()
    assert done["attempts"][0]["slurm"]["job_id"]
    assert_each_step_once(cluster, job["id"], steps)
    assert checkpoints(cluster, job["id"]), "the SDK script's checkpoints"
    cluster.wait_for(lambda: seats_free(cluster), 60, "the seats to be released")


def test_cancel_ends_the_slurm_job(cluster):
    job = submit_slowed(cluster, gpt("slurm-cancel", 100000, 1000))
    cluster.wait_running_ranks(job["id"], 2, 180)
    slurm_id = slurm_job(cluster, job["id"])["job_id"]
    assert squeue_state(cluster, slurm_id) == "RUNNING"
    status, _ = cluster.request("POST", f"/api/v1/jobs/{job['id']}/cancel/")
    assert status in (200, 202), status
    assert cluster.wait_status(job["id"], TERMINAL, 90)["status"] == "CANCELLED"
    assert ended_in_slurm(cluster, slurm_id, 60) in {"COMPLETED", "CANCELLED"}
    cluster.wait_for(lambda: seats_free(cluster), 60, "the seats to be released")


def checkpointed(cluster, spec: dict) -> dict:
    """Submit (slowed), and return once the job has a checkpoint at its first `every_steps`."""
    job = submit_slowed(cluster, spec)
    every = spec["checkpoint"]["every_steps"]
    cluster.wait_for(lambda: any(c["step"] >= every for c in checkpoints(cluster, job["id"])), 180,
                     "a first checkpoint", job_id=job["id"])
    return job


def test_slurm_preemption_checkpoints_and_the_job_resumes_with_every_step_once(cluster):
    steps = 400
    job = checkpointed(cluster, gpt("slurm-preempted", steps, 10))
    first = slurm_job(cluster, job["id"])["job_id"]
    # An admin's urgent job on every node: Slurm preempts ours (SIGTERM, GraceTime, then the kill).
    urgent = cluster.slurm.run(["sbatch", "--parsable", "--partition=urgent", f"--nodes={len(SLURM_HOSTS)}",
                                "--job-name=urgent", "--exclusive", "--wrap", "sleep 20"]).stdout.strip().split(";")[0]
    # the next attempt waits in Slurm behind it, and the job says why
    pending = cluster.wait_for(
        lambda: (j := cluster.job(job["id"])) and len(j["attempts"]) >= 2 and "pending" in (j["status_reason"] or "")
        and j, 120, "the next attempt pending in Slurm with its reason", job_id=job["id"])
    second = pending["attempts"][-1]["slurm"]
    assert f"Slurm job {second['job_id']} pending: " in pending["status_reason"], pending
    assert second["category"] in {"resources", "priority"}, second
    # the job page says so too, in the attempts table
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            base = f"http://{cluster.host}:{cluster.port}"
            login(page, base)
            page.goto(f"{base}/jobs/{job['id']}/")
            line = page.locator("#attempts-body .slurm", has_text=f"Slurm job {second['job_id']} · pending: ")
            line.first.wait_for(timeout=30_000)
            assert second["category"] in line.first.inner_text()
        finally:
            browser.close()
    done = cluster.wait_status(job["id"], TERMINAL, 300)
    assert done["status"] == "SUCCEEDED", cluster.job_state(job["id"]) + cluster.slurm.logs()
    preempted = done["attempts"][0]
    assert preempted["outcome"] == "preempted", preempted
    assert squeue_state(cluster, first) in {"PREEMPTED", "COMPLETED", "CANCELLED"}
    assert squeue_state(cluster, urgent) == "COMPLETED"
    assert done["attempts"][1]["resumed_from_step"] >= 10, done["attempts"][1]
    assert "Slurm took node" in json.dumps([e["message"] for e in events(cluster, job["id"])])
    assert_each_step_once(cluster, job["id"], steps)
    cluster.wait_for(lambda: seats_free(cluster), 60, "the seats to be released")


def moved_off_a_node(cluster, name: str, steps: int, every: int, state: str, index: int) -> tuple[str, dict]:
    """A job running on Slurm with a first checkpoint; an admin sets its `index`-th node to `state`
    (DOWN, DRAIN); it must SUCCEED, last on nodes without that one, every step once. Returns (the
    node, the finished job); the node is resumed and the seats released afterwards."""
    job = checkpointed(cluster, gpt(name, steps, every))
    victim = slurm_job(cluster, job["id"])["nodes"][index]
    cluster.slurm.run(["scontrol", "update", f"NodeName={victim}", f"State={state}", "Reason=trainyard test"])
    try:
        done = cluster.wait_status(job["id"], TERMINAL, 300)
        assert done["status"] == "SUCCEEDED", cluster.job_state(job["id"]) + cluster.slurm.logs()
        last = done["attempts"][-1]
        assert len(done["attempts"]) >= 2 and victim not in last["slurm"]["nodes"], (victim, done["attempts"])
        assert len(last["slurm"]["nodes"]) == 2 and last["resumed_from_step"] >= every, last
        assert_each_step_once(cluster, job["id"], steps)
    finally:
        cluster.slurm.resume_node(victim)
    cluster.wait_for(lambda: seats_free(cluster), 60, "the seats to be released")
    return victim, done


def test_a_node_set_down_fails_over_to_the_healthy_nodes(cluster):
    moved_off_a_node(cluster, "slurm-node-down", 300, 10, "DOWN", 1)


def test_a_node_slurm_drains_is_left_with_a_checkpoint_of_the_current_step(cluster):
    # Slurm lets a job on a DRAINing node run on; Trainyard moves it, with a checkpoint of the step
    # it is on (not the last periodic one), before the admin's maintenance takes the node.
    _, done = moved_off_a_node(cluster, "slurm-drain", 400, 100, "DRAIN", 0)
    assert done["attempts"][0]["outcome"] == "preempted" and len(done["attempts"]) == 2, done["attempts"]
    assert done["attempts"][-1]["resumed_from_step"] > 100, done["attempts"][-1]  # the drain's own checkpoint
    assert [e for e in events(cluster, done["id"]) if e["kind"] == "slurm_node_unhealthy"]


def test_a_restarted_control_plane_re_adopts_its_slurm_job_and_cancels_orphans(cluster):
    steps = 200
    job = submit_slowed(cluster, gpt("slurm-restart", steps, 20))
    cluster.wait_running_ranks(job["id"], 2, 180)
    slurm_id = slurm_job(cluster, job["id"])["job_id"]
    # An orphan: our tag and our pool's comment, and no attempt of this control plane owns it (a
    # database restored from before its sbatch). A tagged job of another pool is not ours to stop.
    orphan = cluster.slurm.run(["sbatch", "--parsable", "--job-name=trainyard-99999-a99999", "--comment=trainyard:lab",
                                "--wrap", "sleep 300"]).stdout.strip().split(";")[0]
    other = cluster.slurm.run(["sbatch", "--parsable", "--job-name=trainyard-99998-a99998",
                               "--comment=trainyard:elsewhere", "--wrap", "sleep 300"]).stdout.strip().split(";")[0]
    try:
        cluster.kill_proc("control")
        cluster.kill_proc("beat")
        time.sleep(5)  # the agents train on and their heartbeats wait in Redis
        assert squeue_state(cluster, slurm_id) == "RUNNING"
        cluster.start_proc("control")
        cluster.start_proc("beat")
        done = cluster.wait_status(job["id"], TERMINAL, 240)
        assert done["status"] == "SUCCEEDED", cluster.job_state(job["id"]) + cluster.slurm.logs()
        assert len(done["attempts"]) == 1 and done["restarts"] == 0, done["attempts"]
        assert done["attempts"][0]["slurm"]["job_id"] == slurm_id
        assert_each_step_once(cluster, job["id"], steps)
        assert ended_in_slurm(cluster, orphan, 60) == "CANCELLED"
        assert squeue_state(cluster, other) in {"RUNNING", "PENDING"}
    finally:
        cluster.slurm.run(["scancel", orphan, other], check=False)
    cluster.wait_for(lambda: seats_free(cluster), 60, "the seats to be released")


def test_an_empty_squeue_and_a_failing_scontrol_write_nothing_off(cluster):
    steps = 150
    job = submit_slowed(cluster, gpt("slurm-silent", steps, 20))
    cluster.wait_running_ranks(job["id"], 2, 180)
    slurm_id = slurm_job(cluster, job["id"])["job_id"]
    cluster.flag.touch()
    try:
        time.sleep(8)  # eight status passes with no answer
        j = cluster.job(job["id"])
        assert j["status"] == "RUNNING" and len(j["attempts"]) == 1, cluster.job_state(job["id"])
        assert j["attempts"][0]["slurm"]["state"] in {"unknown", "running"}, j["attempts"][0]["slurm"]
        assert squeue_state(cluster, slurm_id) == "RUNNING"
    finally:
        cluster.flag.unlink()
    done = cluster.wait_status(job["id"], TERMINAL, 240)
    assert done["status"] == "SUCCEEDED" and len(done["attempts"]) == 1, cluster.job_state(job["id"])
    assert_each_step_once(cluster, job["id"], steps)


def pool_settings(cluster) -> dict:
    return json.loads(cluster.manage("shell", "-c", "import json; from jobs.models import Pool; "
                                     f"print(json.dumps(Pool.objects.get(name='{POOL}').settings))").splitlines()[-1])


def test_a_request_slurm_refuses_fails_the_job_with_slurms_words_and_no_retry(cluster):
    settings = pool_settings(cluster)
    cluster.manage("pool_set", POOL, "--json", json.dumps({"settings": {**settings, "partition": "nosuchpart"}}))
    try:
        job = cluster.submit(gpt("slurm-refused", 10, 10))
        done = cluster.wait_status(job["id"], TERMINAL, 120)
    finally:
        cluster.manage("pool_set", POOL, "--json", json.dumps({"settings": settings}))
    assert done["status"] == "FAILED" and len(done["attempts"]) == 1, cluster.job_state(job["id"])
    att = done["attempts"][0]
    assert att["outcome"] == "failed:placement", att
    assert "Slurm refused the job" in att["slurm"]["error"] and "invalid partition" in att["slurm"]["error"].lower(), att
    assert not att["slurm"]["job_id"]
    cluster.wait_for(lambda: seats_free(cluster), 60, "the seats to be released")


@contextlib.contextmanager
def login_node(net: hosts.Hosts, host: str, workdir: Path):
    """An SSH login node: sshd on the test host `host` (its own config, host key, authorized key and
    log under workdir), as a Slurm cluster's login node is reached. Yields (port, client key,
    known_hosts file, sshd's log)."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(workdir / name)], check=True)
    (workdir / "authorized_keys").write_text((workdir / "client_key.pub").read_text())
    port, addr = free_port(), net.address(host)
    (workdir / "known_hosts").write_text(f"[{addr}]:{port} {(workdir / 'host_key.pub').read_text()}")
    (workdir / "sshd_config").write_text("\n".join([
        f"ListenAddress {addr}:{port}", f"HostKey {workdir / 'host_key'}", f"PidFile {workdir / 'sshd.pid'}",
        f"AuthorizedKeysFile {workdir / 'authorized_keys'}", "PermitRootLogin prohibit-password",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        "LogLevel VERBOSE", ""]))
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    log = workdir / "sshd.log"
    proc = subprocess.Popen(net.exec_argv(host, ["/usr/sbin/sshd", "-D", "-f", str(workdir / "sshd_config"),
                                                 "-E", str(log)]))
    try:
        deadline = time.monotonic() + 15
        while "Server listening" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.1)
        yield port, workdir / "client_key", workdir / "known_hosts", log
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(), reason="openssh-server is not installed: "
                    "scripts/ensure_system_deps.sh openssh-server")
def test_a_pool_reached_over_ssh_through_a_login_node(cluster):
    """A pool whose Slurm CLI runs on a login node (settings.login) over SSH with a key staff provide
    and a pinned host key: sbatch, squeue, the agents' file, scancel all go through it."""
    with login_node(cluster.net, "gpu-1", cluster.dir / "login") as (port, key, known_hosts, log):
        login = {"login": f"root@{cluster.net.address('gpu-1')}", "ssh_port": port, "ssh_key": str(key),
                 "known_hosts": str(known_hosts)}
        settings = pool_settings(cluster)
        cluster.manage("pool_set", POOL, "--json", json.dumps({"settings": {**settings, **login}}))
        try:
            job = cluster.submit(gpt("slurm-over-ssh", 30, 10))
            done = cluster.wait_status(job["id"], TERMINAL, 240)
            assert done["status"] == "SUCCEEDED", cluster.job_state(job["id"]) + cluster.slurm.logs() + log.read_text()
            assert_each_step_once(cluster, job["id"], 30)
            assert "Accepted publickey for root" in log.read_text()
            assert ended_in_slurm(cluster, done["attempts"][0]["slurm"]["job_id"]) == "COMPLETED"
            cluster.wait_for(lambda: seats_free(cluster), 60, "the seats to be released")
        finally:
            cluster.manage("pool_set", POOL, "--json", json.dumps({"settings": settings}))


def test_the_cluster_leaves_no_slurm_job_behind(cluster):
    """Every Slurm job this control plane submitted has ended (the agents left with their attempts)."""
    def ours() -> list[str]:
        out = cluster.slurm.run(["squeue", "--noheader", "--format=%i|%j|%T"], check=False).stdout.split()
        return [line for line in out if "|trainyard-" in line and "99998" not in line]

    cluster.wait_for(lambda: not ours(), 60, f"every Slurm job of ours to end: {ours()}")
