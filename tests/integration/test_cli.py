"""The `trainyard` CLI as a new user uses it, against a real cluster (redis, daphne, Celery control
worker + beat, relay, two node agents): errors before login, login with a password typed on
stdin, submit --watch of a job that ends SUCCEEDED (exit 0), logs, ls, show, checkpoints, nodes,
cancel and watch of a cancelled job (exit 1), a refused spec and a non-staff rollback (exit 2,
one line). Every command runs as its own process (`python -m trainyard.cli`, the console script's
code), checked by exit code and output."""
from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest
import yaml

from tests.conftest import REPO

from .cluster import PY, Cluster

pytestmark = [pytest.mark.procs, pytest.mark.timeout(900)]

PASSWORD = "alice-cli-pw-1"
SMALL = {"model": {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 2, "seq_len": 64},
         "train": {"global_batch": 16}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cli"))
    try:
        c.start()
        subprocess.run([PY, "manage.py", "shell", "-c", "from django.contrib.auth.models import User; "
                        f"User.objects.create_user('alice', password={PASSWORD!r})"],
                       cwd=REPO, env=c.env, check=True, capture_output=True)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def alice_env(cluster):
    """TRAINYARD_URL and TRAINYARD_TOKEN (alice's), which override any login file."""
    token = subprocess.run([PY, "manage.py", "api_token", "alice"], cwd=REPO, env=cluster.env, check=True,
                           capture_output=True, text=True).stdout.strip()
    return {"TRAINYARD_URL": f"http://127.0.0.1:{cluster.port}", "TRAINYARD_TOKEN": token}


def cli(home, *args: str, stdin: str = "", timeout: float = 300, env: dict | None = None):
    """One `trainyard` command in a fresh process, as in a shell without a terminal."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg"), "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
           **(env or {})}
    return subprocess.run([PY, "-m", "trainyard.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=home, start_new_session=True)


def one_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def write_spec(home, name: str, spec: dict):
    path = home / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_a_new_user(cluster, home):
    url = f"http://127.0.0.1:{cluster.port}"
    assert one_error(cli(home, "ls")) == ("error: not logged in: run `trainyard login URL` or set TRAINYARD_URL "
                                          "and TRAINYARD_TOKEN")
    assert one_error(cli(home, "login", url, stdin=f"alice\nnot-{PASSWORD}\n")) == \
        "error: login: credentials: wrong username or password (HTTP 400)"
    assert not (home / "xdg").exists()

    result = cli(home, "login", url, stdin=f"alice\n{PASSWORD}\n")
    assert result.returncode == 0, result.stderr
    assert f"logged in to {url} as alice" in result.stdout and PASSWORD not in result.stdout + result.stderr
    saved = home / "xdg" / "trainyard" / "config.toml"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600 and stat.S_IMODE(saved.parent.stat().st_mode) == 0o700
    assert "token = " in saved.read_text() and PASSWORD not in saved.read_text()

    nodes = cli(home, "nodes")
    assert nodes.returncode == 0 and "node-a" in nodes.stdout and "node-b" in nodes.stdout

    bad = cli(home, "submit", write_spec(home, "bad", {"name": "bad", "model": {"kind": "rnn"}}))
    assert one_error(bad).startswith("error: job refused: model.kind: ") and bad.stdout == ""
    assert cluster.get("/api/v1/jobs/")["count"] == 0

    # submit --watch: the job id on stdout, the progress and its end, exit 0 because it SUCCEEDED
    run = cli(home, "submit", write_spec(home, "job", {"name": "cli-job", **SMALL, "train": {
        **SMALL["train"], "steps": 30}}), "--watch", timeout=600)
    assert run.returncode == 0, (run.stdout, run.stderr, cluster.logs())
    job_id = int(run.stdout.splitlines()[0])
    assert f"job {job_id} SUCCEEDED, step 30/30, loss " in run.stdout
    assert "status " in run.stdout and "-> SUCCEEDED" in run.stdout
    job = cluster.job(job_id)
    assert job["status"] == "SUCCEEDED" and job["owner"] == "alice"

    logs = cli(home, "logs", str(job_id))
    assert logs.returncode == 0, logs.stderr
    assert any(line.startswith("[rank 0] ") for line in logs.stdout.splitlines())
    assert any(line.startswith("[rank 1] ") for line in logs.stdout.splitlines())
    rank1 = cli(home, "logs", str(job_id), "--rank", "1", "-f", timeout=60)  # an ended job: -f returns
    assert rank1.returncode == 0 and rank1.stdout.strip() and "[rank" not in rank1.stdout
    assert set(rank1.stdout.splitlines()) == {line[len("[rank 1] "):] for line in logs.stdout.splitlines()
                                               if line.startswith("[rank 1] ")}

    listing = cli(home, "ls")
    assert listing.returncode == 0 and any(
        line.split()[:3] == [str(job_id), "cli-job", "SUCCEEDED"] for line in listing.stdout.splitlines())
    shown = cli(home, "show", str(job_id))
    assert shown.returncode == 0 and "SUCCEEDED" in shown.stdout and "30/30" in shown.stdout
    assert json.loads(cli(home, "show", str(job_id), "--json").stdout)["id"] == job_id
    ckpts = cli(home, "checkpoints", str(job_id), "--json")
    assert ckpts.returncode == 0
    ckpt_id = json.loads(ckpts.stdout)[0]["id"] if json.loads(ckpts.stdout) else 1
    assert one_error(cli(home, "rollback", str(job_id), str(ckpt_id))) == \
        f"error: rollback of job {job_id}: only staff may roll a job back (HTTP 403)"


def test_submit_code_of_the_sdk_example_and_watch_it_succeed(cluster, tmp_path, alice_env):
    """The issue's "done when": submit examples/sdk_ddp --code examples/sdk_ddp --watch."""
    example = REPO / "examples" / "sdk_ddp"
    run = cli(tmp_path, "submit", str(example / "job.yaml"), "--code", str(example), "--watch", env=alice_env,
              timeout=600)
    assert run.returncode == 0, (run.stdout, run.stderr, cluster.logs())
    job_id = int(run.stdout.splitlines()[0])
    steps = yaml.safe_load((example / "job.yaml").read_text())["train"]["steps"]
    assert f"job {job_id} SUCCEEDED, step {steps}/{steps}, loss " in run.stdout
    uploaded = [line for line in run.stderr.splitlines() if line.startswith(f"uploaded {example}: ")]
    assert len(uploaded) == 1, run.stderr
    job = cluster.job(job_id)
    digest = job["spec"]["code"]["bundle"]
    assert uploaded[0].endswith(f"-> {digest}") and job["owner"] == "alice"
    rows = cluster.metrics(job_id)
    assert {(r["rank"], r["step"]) for r in rows} == {(k, s) for k in (0, 1) for s in range(1, steps + 1)}
    assert all(r["loss"] is not None for r in rows)
    # the same tree again: the same digest (the archive is reproducible; the server stores it once)
    again = cli(tmp_path, "submit", str(example / "job.yaml"), "--code", str(example), "--json", env=alice_env)
    assert again.returncode == 0 and json.loads(again.stdout)["spec"]["code"]["bundle"] == digest
    assert cli(tmp_path, "cancel", str(json.loads(again.stdout)["id"]), env=alice_env).returncode == 0


def test_code_over_the_cap_is_refused_before_upload(cluster, tmp_path, alice_env):
    code = tmp_path / "code"
    (code / "data").mkdir(parents=True)
    (code / "train.py").write_text("print('hi')\n")
    (code / "data" / "shard.bin").write_bytes(os.urandom(300_000))
    spec = write_spec(tmp_path, "job", {"name": "too-big", "entrypoint": {"script": "train.py"}})
    before = cluster.get("/api/v1/jobs/")["count"]
    refused = cli(tmp_path, "submit", spec, "--code", str(code),
                  env={**alice_env, "TRAINYARD_BUNDLE_MAX_BYTES": "200000"})
    assert one_error(refused).startswith("error: data/shard.bin is 293.0 KiB, over the 195.3 KiB bundle cap; "
                                         "add it to .trainyardignore")
    assert cluster.get("/api/v1/jobs/")["count"] == before


def test_cancel_and_watch_of_a_cancelled_job_exits_1(cluster, home, alice_env):
    spec = write_spec(home, "long", {"name": "cli-long", **SMALL, "train": {**SMALL["train"], "steps": 100000}})
    submitted = cli(home, "submit", spec, "--json", env=alice_env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    cluster.wait_running_ranks(job_id, 2)
    cancelled = cli(home, "cancel", str(job_id), env=alice_env)
    assert cancelled.returncode == 0 and cancelled.stdout.startswith(f"job {job_id}: cancel requested, now ")
    watched = cli(home, "watch", str(job_id), timeout=120, env=alice_env)
    assert watched.returncode == 1, (watched.stdout, watched.stderr)
    assert f"job {job_id} CANCELLED" in watched.stdout
    assert one_error(cli(home, "cancel", str(job_id), env=alice_env)) == \
        f"error: cancel of job {job_id}: status: job is already CANCELLED (HTTP 409)"
    assert one_error(cli(home, "watch", "999999", env=alice_env)) == "error: job 999999 not found (or not visible to you)"
