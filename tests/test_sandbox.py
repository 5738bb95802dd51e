"""workers/sandbox.py through the real launcher: bubblewrap namespaces, the attempt's own uid, the
job's group, host pids for the ranks, stop, adopt and loss (issue 21 section 1)."""
from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from tests.conftest import REPO
from tests.test_launcher import Recorder, exited, leftovers, request, wrapper_pid
from workers import sandbox
from workers.launcher import Supervisor, launched_attempts, pick_free_port

TESTS_RO = (str(REPO / "tests"),)  # the fake worker lives in tests/launcher_fixtures


def plan_for(req, tmp_path, **cfg) -> sandbox.SandboxPlan:
    mounts = sandbox.Mounts(run_dir=req.run_dir, checkpoint_dir=str(tmp_path / "ckpt" / f"job-{req.job_id}"),
                            data_root=str(tmp_path / "data"), python_prefixes=sandbox.agent_python_prefixes())
    (tmp_path / "data").mkdir(exist_ok=True)
    config = sandbox.SandboxConfig(ro_paths=TESTS_RO, **cfg)
    return sandbox.SandboxPlan.for_attempt(config, mounts, job_id=req.job_id, attempt_id=req.attempt_id)


def _can_sandbox() -> str:
    try:
        sandbox.probe(sandbox.SandboxConfig())
        return ""
    except sandbox.SandboxUnavailable as exc:
        return str(exc)


needs_sandbox = pytest.mark.skipif(bool(_can_sandbox()), reason=_can_sandbox() or "ok")


# ---- fast: no processes -------------------------------------------------------------------

def test_ids_are_per_attempt_and_per_job_and_the_same_on_every_node():
    cfg = sandbox.SandboxConfig()
    assert cfg.ids(7, 12) == (sandbox.UID_BASE + 12, sandbox.GID_BASE + 7)
    assert cfg.ids(7, 13)[0] != cfg.ids(7, 12)[0] and cfg.ids(7, 13)[1] == cfg.ids(7, 12)[1]
    wrapped = sandbox.SandboxConfig(id_range=100)
    assert wrapped.ids(1, 205) == (sandbox.UID_BASE + 5, sandbox.GID_BASE + 1)


def test_settings_come_from_the_agents_environment():
    cfg = sandbox.SandboxConfig.from_env({"TRAINYARD_SANDBOX_RO": "/opt/envs:/datasets",
                                          "TRAINYARD_SANDBOX_PASS_ENV": "NCCL_IB_HCA, UCX_*",
                                          "TRAINYARD_SANDBOX_NPROC": "99"})
    assert cfg.enabled and cfg.ro_paths == ("/opt/envs", "/datasets") and cfg.nproc == 99
    assert cfg.passes("NCCL_IB_HCA") and cfg.passes("UCX_TLS") and not cfg.passes("NCCL_DEBUG")
    assert not sandbox.SandboxConfig.from_env({"TRAINYARD_INSECURE_NO_SANDBOX": "1"}).enabled
    with pytest.raises(sandbox.SandboxUnavailable, match="TRAINYARD_SANDBOX_UID_BASE"):
        sandbox.SandboxConfig.from_env({"TRAINYARD_SANDBOX_UID_BASE": "x"})


def test_the_mounts_hold_only_the_attempts_own_paths(tmp_path):
    run = tmp_path / "var" / "agents" / "node-a" / "attempt-5"
    for d in (*sandbox.SANDBOX_DIRS, "code"):
        (run / d).mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (tmp_path / "var" / "secret_key").write_text("k")
    m = sandbox.Mounts(run_dir=str(run), checkpoint_dir=str(tmp_path / "ckpt" / "job-3"),
                       data_root=str(tmp_path / "data"), code_dir=str(run / "code"))
    (tmp_path / "ckpt" / "job-3").mkdir(parents=True)
    args = sandbox.bwrap_args(sandbox.SandboxConfig(), m, uid=5, gid=3, env={"A": "1"}, argv=["x"], cwd=str(run / "home"))
    binds = {(args[i], args[i + 2]) for i, a in enumerate(args) if a in ("--bind", "--ro-bind", "--dev-bind-try")}
    rw = {dest for kind, dest in binds if kind == "--bind"}
    assert rw == {str(run / d) for d in sandbox.SANDBOX_DIRS} | {str(tmp_path / "ckpt" / "job-3")}
    sources = {args[i + 1] for i, a in enumerate(args) if a.startswith(("--bind", "--ro-bind", "--dev-bind"))}
    assert not any(s in (str(run), str(tmp_path / "var"), str(tmp_path / "ckpt")) for s in sources)
    assert str(run / "config.json") in sources and str(run / "code") in sources
    assert not any("/etc" == s or s.startswith("/etc/trainyard") for s in sources)
    tail = args[args.index("--") + 1:]
    assert tail[:2] == [tail[0], "--nproc=16384:16384"] and "--reuid=5" in tail and "--no-new-privs" in tail
    assert tail[-1] == "x" and args[args.index("--clearenv") + 1:args.index("--clearenv") + 4] == ["--setenv", "A", "1"]
    with pytest.raises(ValueError):
        sandbox.encode_args(["a\0b"])


def test_outer_pid_translates_only_among_the_attempts_processes(monkeypatch):
    table = {100: [100, 2], 101: [101, 3], 999: [999]}
    monkeypatch.setattr(sandbox, "ns_pids", lambda pid: table.get(pid, []))
    assert sandbox.outer_pid(3, [100, 101]) == 101
    assert sandbox.outer_pid(999, [100, 101, 999]) is None  # a host process is never named by a rank
    assert sandbox.outer_pid(7, [100, 101]) is None


# ---- real processes -----------------------------------------------------------------------

@needs_sandbox
@pytest.mark.procs
@pytest.mark.timeout(120)
def test_ranks_run_in_their_sandbox_as_the_attempts_uid_with_host_pids(tmp_path):
    port = pick_free_port("127.0.0.1")
    recs, sups = [Recorder(), Recorder()], []
    for i, (node, addr) in enumerate((("node-a", "127.0.0.1"), ("node-b", "127.0.0.2"))):
        req = request(tmp_path, node, node_rank=i, nnodes=2, port=port, local_addr=addr,
                      config={"steps": 3}, env={"FAKE_EXTRA": "x-1"})
        sups.append(Supervisor(req, **recs[i].callbacks(), sandbox=plan_for(req, tmp_path)))
    assert all(s.start() for s in sups)
    for rec in recs:
        rec.wait(exited)
    uid, gid = sandbox.SandboxConfig().ids(7, 1)
    for rec, sup in zip(recs, sups):
        (result,) = rec.exits()
        assert (result["exit_code"], result["failures"]) == (0, []), result
        (r,) = rec.ranks()
        hello = next(line for _, _, line in rec.lines(r["rank"]) if "hello" in line)
        inner = int(hello.split("pid=")[1].split()[0])
        assert inner != r["pid"] and inner < 100  # the rank's own pid is in its PID namespace...
        assert r["pid"] > 0  # ...and the agent reported the host's
        assert os.stat(os.path.join(sup.run_dir, "logs")).st_uid == uid
        assert os.stat(os.path.join(sup.run_dir, "supervisor.json")).st_uid == 0
        info = json.loads(open(os.path.join(sup.run_dir, "supervisor.json")).read())
        assert info["sandboxed"] is True
    ckpt = tmp_path / "ckpt" / "job-7"
    assert (os.stat(ckpt).st_gid, oct(os.stat(ckpt).st_mode & 0o7777)) == (gid, "0o2770")
    # Nothing of the ranks' environment or binds shows on a command line on the host.
    args_file = os.path.join(sups[0].run_dir, "sandbox.args")
    assert oct(os.stat(args_file).st_mode & 0o777) == "0o600" and "FAKE_EXTRA" in open(args_file).read()


@needs_sandbox
@pytest.mark.procs
@pytest.mark.timeout(90)
def test_stop_reaches_the_sandboxed_command_and_leaves_nothing(tmp_path):
    rec = Recorder()
    req = request(tmp_path, "node-a", nproc=2, config={"hang_rank": 1, "steps": 100000})
    sup = Supervisor(req, **rec.callbacks(), sandbox=plan_for(req, tmp_path))
    assert sup.start()
    rec.wait(lambda r: r.has_line("rank 1 allreduce") and len(r.ranks()) == 2)
    uid, _ = sandbox.SandboxConfig().ids(7, 1)
    ranks = [psutil.Process(r["pid"]) for r in rec.ranks()]
    assert all(p.uids().real == uid and p.uids().effective == uid for p in ranks)
    assert all(p.status() != psutil.STATUS_ZOMBIE for p in ranks)
    wrapper = psutil.Process(wrapper_pid(sup))
    pids = {wrapper.pid} | {p.pid for p in wrapper.children(recursive=True)}
    t0 = time.monotonic()
    sup.stop(grace_s=1.0)
    while leftovers(pids) and time.monotonic() < t0 + 8.0:
        time.sleep(0.05)
    assert leftovers(pids) == []
    rec.wait(exited, timeout=10)
    (result,) = rec.exits()
    assert result["stopped"] is True and result["lost"] is False


@needs_sandbox
@pytest.mark.procs
@pytest.mark.timeout(90)
def test_a_sigterm_stop_is_forwarded_into_the_sandbox(tmp_path):
    """bwrap forwards no signal: procwrap sends the stop to torchrun inside, which stops its ranks
    the way it does without a sandbox (-15 from torchrun's ranks, not a SIGKILL of everything)."""
    rec = Recorder()
    req = request(tmp_path, "node-a", config={"steps": 100000})
    sup = Supervisor(req, **rec.callbacks(), sandbox=plan_for(req, tmp_path))
    assert sup.start()
    rec.wait(lambda r: r.has_line("rank 0 allreduce"))
    sup.stop(grace_s=20.0)
    rec.wait(exited, timeout=30)
    (result,) = rec.exits()
    assert result["stopped"] is True and result["exit_code"] != -9, result
    assert not sup._escalated


@needs_sandbox
@pytest.mark.procs
@pytest.mark.timeout(90)
def test_adopt_and_loss_work_with_the_sandbox(tmp_path):
    old = Recorder()
    req = request(tmp_path, "node-a", config={"steps": 20})
    sup = Supervisor(req, **old.callbacks(), sandbox=plan_for(req, tmp_path))
    assert sup.start()
    old.wait(lambda r: r.has_line("rank 0 allreduce"))
    first_pid = old.ranks()[0]["pid"]
    sup._abandon()
    new = Recorder()
    adopted = Supervisor.adopt(sup.run_dir, **new.callbacks())
    assert adopted is not None and adopted.sandboxed and adopted.alive()
    new.wait(exited)
    assert [r["pid"] for r in new.ranks()] == [first_pid]  # translated again after the restart
    assert new.exits()[0]["exit_code"] == 0
    adopted._thread.join(5)  # `reported` is written once on_exit has returned
    assert launched_attempts(str(tmp_path / "runs")) == []

    rec = Recorder()
    req2 = request(tmp_path, "node-a", attempt_id=2, config={"steps": 100000})
    sup2 = Supervisor(req2, **rec.callbacks(), sandbox=plan_for(req2, tmp_path))
    assert sup2.start()
    rec.wait(lambda r: r.has_line("allreduce"))
    wrapper = psutil.Process(wrapper_pid(sup2))
    pids = {p.pid for p in wrapper.children(recursive=True)} | {r["pid"] for r in rec.ranks()}
    os.kill(wrapper.pid, signal.SIGKILL)  # procwrap dies: bwrap's die-with-parent takes the sandbox down
    rec.wait(exited, timeout=15)
    assert rec.exits()[0]["lost"] is True
    deadline = time.monotonic() + 5
    while leftovers(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers(pids) == []


@needs_sandbox
@pytest.mark.procs
def test_a_sandbox_sees_only_its_own_slots_gpu(tmp_path):
    """Issue 21 s1 on a GPU machine: the sandbox of slot 0 holds its GPU's device node and not slot
    1's, so CUDA inside sees one GPU. Skipped on machines with fewer than two NVIDIA GPUs (CI)."""
    import dataclasses
    import sys

    from workers import gpus

    if len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[len("nvidia"):].isdigit()]) < 2:
        pytest.skip("needs two or more NVIDIA GPUs")
    monitor = gpus.GpuMonitor(os.environ.get("CUDA_VISIBLE_DEVICES")).start()
    (uuid,), (mine,) = monitor.slot_nodes((0,))
    _, (theirs,) = monitor.slot_nodes((1,))
    req = request(tmp_path, "node-a")
    base = plan_for(req, tmp_path)
    plan = dataclasses.replace(base, mounts=dataclasses.replace(base.mounts, devices=(mine,), cuda=True))
    for d in sandbox.SANDBOX_DIRS:
        os.makedirs(os.path.join(req.run_dir, d), exist_ok=True)
    with open(os.path.join(req.run_dir, "config.json"), "w") as f:
        f.write("{}")
    plan.prepare()
    code = f"import os, torch; print(torch.cuda.device_count(), os.path.exists({mine!r}), os.path.exists({theirs!r}))"
    done = plan.run({"PATH": sandbox.SYSTEM_PATH, "CUDA_VISIBLE_DEVICES": uuid}, [sys.executable, "-c", code], 180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "True", "False"], done.stdout


def test_the_attempts_redis_url_keeps_the_ca_and_drops_the_nodes_client_certificate():
    from workers.agent import attempt_redis_url

    url, ca = attempt_redis_url("rediss://gpu-1:nodepw@redis.internal:6390/0?ssl_cert_reqs=required&"
                                "ssl_ca_certs=/etc/trainyard/ca.pem&ssl_certfile=/etc/trainyard/gpu-1.pem&"
                                "ssl_keyfile=/etc/trainyard/gpu-1.key", "trainyard-attempt-7", "a/pw")
    assert url.startswith("rediss://trainyard-attempt-7:a%2Fpw@redis.internal:6390/0?")
    assert "nodepw" not in url and "gpu-1.key" not in url and "gpu-1.pem" not in url
    assert "ssl_ca_certs=%2Fetc%2Ftrainyard%2Fca.pem" in url and ca == ("/etc/trainyard/ca.pem",)
    assert attempt_redis_url("redis://n:p@h:1/0", "u", "p") == ("redis://u:p@h:1/0", ())
