"""The deployment files with real processes (issue 16, section 6): `systemd-analyze verify` on the
units, the `trainyard-agent` console script of a built package run outside the repository, and
the example Redis ACL file loaded into a real redis-server with a real node agent under its node
user. tests/test_deploy.py checks the same files without processes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.conftest import REPO, free_port
from trainyard import nodeauth
from trainyard.launch import CELERY_SETTINGS, NODE_EXIT_TASK, NODE_STOP_TASK

pytestmark = pytest.mark.procs

UNITS = REPO / "deploy" / "systemd"
ACL = REPO / "deploy" / "redis" / "users.acl"


# ---------------------------------------------------------------- systemd-analyze verify

def test_units_pass_systemd_analyze_verify(tmp_path):
    """The units as systemd reads them: unknown keys, bad values and missing programs are
    reported. They name /opt/trainyard; here that is a directory whose .venv/bin holds this
    checkout's programs (trainyard-agent a stand-in when this .venv predates the console script,
    whose resolution tests/test_deploy.py checks)."""
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("no systemd-analyze here; tests/test_deploy.py parses the units instead")
    root = tmp_path / "opt"
    (root / ".venv" / "bin").mkdir(parents=True)
    for program in ("python", "daphne", "celery", "trainyard-agent"):
        real = REPO / ".venv" / "bin" / program
        link = root / ".venv" / "bin" / program
        if real.exists():
            link.symlink_to(real)
        else:
            link.write_text(f'#!/bin/sh\nexec {REPO}/.venv/bin/python -m workers.agent "$@"\n')
            link.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    names = []
    for path in sorted(UNITS.glob("*.service")):
        name = path.name.replace("@.service", "@gpu-1.service")  # verify an instance of the template
        (units / name).write_text(path.read_text().replace("/opt/trainyard", str(root)))
        names.append(name)
    assert len(names) == 6, names  # agent, beat, control, notify, relay, web
    proc = subprocess.run([exe, "verify", *names], cwd=units, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, SYSTEMD_LOG_LEVEL="notice"))
    report = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0 and not report, report


# ---------------------------------------------------------------- the console script

def test_console_script_runs_outside_the_repository(tmp_path):
    """Build the package as `make venv` installs it, install it into a directory, and run
    `trainyard-agent --help` from elsewhere: it must import workers.agent from the package."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    for pkg in ("trainyard", "workers"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"),
                    str(src)], check=True, cwd=tmp_path, timeout=120)
    wheel = next((tmp_path / "dist").glob("trainyard-*.whl"))
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp_path, timeout=120)
    script = target / "bin" / "trainyard-agent"
    assert script.exists(), sorted(p.name for p in (target / "bin").iterdir())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)  # the installed package, not the checkout
    out = subprocess.run([str(script), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--slots" in out.stdout and "--address" in out.stdout


# ---------------------------------------------------------------- the Redis ACL example

PASSWORDS = {"admin": "admin-pw", "trainyard-control": "control-pw", "gpu-1": "gpu1-pw"}


def rendered_acl(tmp_path: Path) -> Path:
    text = ACL.read_text()
    for placeholder, user in (("the-operator-password", "admin"), ("the-control-plane-password", "trainyard-control"),
                              ("gpu-1-password", "gpu-1")):
        text = text.replace(f"<sha256-of-{placeholder}>", hashlib.sha256(PASSWORDS[user].encode()).hexdigest())
    assert "<" not in text, text
    path = tmp_path / "users.acl"
    path.write_text(text)
    return path


@pytest.fixture
def acl_redis(tmp_path):
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path), "--aclfile", str(rendered_acl(tmp_path)), "--save", "",
                             "--appendonly", "no", "--proto-max-bulk-len", "8mb", "--loglevel", "warning", "--logfile", str(tmp_path / "redis.log")])
    url = f"redis://{{user}}:{{pw}}@127.0.0.1:{port}/0"
    admin = redis.Redis.from_url(url.format(user="admin", pw=PASSWORDS["admin"]))
    deadline = time.monotonic() + 10
    while True:
        try:
            admin.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server refused the ACL file: {(tmp_path / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)
    yield url, admin
    proc.terminate()
    proc.wait(10)


def wait_for(pred, timeout_s: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}" + (f"; its log ends:\n{log.read_text()[-3000:]}" if log else ""))


def control_tasks(admin: redis.Redis) -> list[str]:
    return [json.loads(m)["headers"]["task"] for m in admin.lrange("control", 0, -1)]


def test_node_user_runs_a_real_agent_and_reaches_nothing_else(acl_redis, tmp_path, repo_env):
    url, admin = acl_redis
    env = dict(repo_env, REDIS_URL=url.format(user="gpu-1", pw=PASSWORDS["gpu-1"]),
               TRAINYARD_VAR_DIR=str(tmp_path / "var"))
    credential = tmp_path / "gpu-1.credential"  # as node_add --credential-out writes it
    credential.write_text("test-credential-of-gpu-1\n")
    credential.chmod(0o600)
    agent = subprocess.Popen([sys.executable, "-m", "workers.agent", "--name", "gpu-1", "--address", "127.0.0.1",
                              "--slots", "1", "--run-dir", str(tmp_path / "agents"),
                              "--credential-file", str(credential)], cwd=REPO, env=env,
                             stdout=open(tmp_path / "agent.log", "w"), stderr=subprocess.STDOUT)
    try:
        from celery import Celery

        control = Celery("deploy-test", broker=url.format(user="trainyard-control", pw=PASSWORDS["trainyard-control"]))
        control.conf.update(CELERY_SETTINGS)
        log = tmp_path / "agent.log"
        wait_for(lambda: "ready." in log.read_text(), 60, "the agent to consume node.gpu-1", log)
        stop = {"job_id": 1, "attempt_id": 77, "reason": "cancel"}
        control.send_task(NODE_STOP_TASK, args=[nodeauth.seal("test-credential-of-gpu-1", "gpu-1", NODE_STOP_TASK,
                                                               stop, time.time())], queue="node.gpu-1")
        control.send_task(NODE_STOP_TASK, args=[nodeauth.seal("other", "gpu-2", NODE_STOP_TASK,
                                                               {**stop, "attempt_id": 78}, time.time())],
                          queue="node.gpu-2")
        # the agent received its stop and reported to the control queue; heartbeats got there too
        wait_for(lambda: NODE_EXIT_TASK in control_tasks(admin), 30, "the agent's exit report", log)
        assert "jobs.tasks.node_heartbeat" in control_tasks(admin)
        assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        agent.send_signal(signal.SIGINT)
        try:
            agent.wait(20)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    assert admin.llen("node.gpu-2") == 1  # another node's message is untouched
    denied = admin.acl_log()
    assert denied == [], f"the ACL refused what a real agent does: {denied}\n{(tmp_path / 'agent.log').read_text()[-3000:]}"

    def dryrun(*command) -> str:
        return admin.execute_command("ACL", "DRYRUN", "gpu-1", *command).decode()

    sep = "\x06\x16"  # the full table of every user's commands: tests/test_redis_acl.py
    for allowed in [("BRPOP", "node.gpu-1", f"node.gpu-1{sep}3", "1"), ("LPUSH", "control", "x"),
                    ("SET", "trainyard:rdzv:9:0123abcd", "29500", "NX", "EX", "60")]:
        assert dryrun(*allowed) == "OK", allowed
    for refused in [("BRPOP", "node.gpu-2", "1"), ("BRPOP", "node.gpu-10", "1"), ("BRPOP", "control", "1"),
                    ("XADD", "trainyard:job:7", "*", "type", "metric"), ("GET", "trainyard:preempt:9"),
                    ("CLIENT", "PAUSE", "1000"), ("PUBLISH", "/0.celery.pidbox", "x"), ("FLUSHALL",)]:
        assert dryrun(*refused) != "OK", refused
    # nobody gets in without a user; the control plane manages the attempts' users (ACL SETUSER)
    host, port = admin.connection_pool.connection_kwargs["host"], admin.connection_pool.connection_kwargs["port"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=host, port=port).ping()
    assert redis.Redis.from_url(url.format(user="trainyard-control", pw=PASSWORDS["trainyard-control"])).acl_list()
