"""workers.launcher: real torchrun, real gloo ranks (tests/launcher_fixtures/fake_worker.py).

Two "nodes" on one machine advertise 127.0.0.1 and 127.0.0.2, as the node agents do.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from trainyard.launch import NodeExit, RankInfo
from workers import launch_spec, launcher, launcher_logs
from workers.launcher import LaunchRequest, Supervisor, launched_attempts, pick_free_port

FAKE = "tests.launcher_fixtures.fake_worker"


class Recorder:
    """Callback sink; every event in arrival order, waitable without sleeps."""

    def __init__(self, fail_first_log: bool = False):
        self.events: list[tuple] = []
        self.cond = threading.Condition()
        self._fail_first_log = fail_first_log

    def _add(self, event: tuple) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def on_ranks(self, ranks):
        self._add(("ranks", ranks))

    def on_log(self, rank, stream, lines):
        self._add(("log", rank, stream, list(lines)))
        if self._fail_first_log:
            self._fail_first_log = False
            raise RuntimeError("callback bug: supervision must survive it")

    def on_exit(self, result):
        self._add(("exit", result))

    def callbacks(self) -> dict:
        return {"on_ranks": self.on_ranks, "on_log": self.on_log, "on_exit": self.on_exit}

    def wait(self, predicate, timeout: float = 45.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self), timeout), self.events

    def exits(self) -> list[dict]:
        out = [e[1] for e in self.events if e[0] == "exit"]
        for result in out:  # the agent sends it as a NodeExit: it must validate and keep every key
            assert NodeExit.model_validate(result).wire() == result
        return out

    def ranks(self) -> list[dict]:
        out = [r for e in self.events if e[0] == "ranks" for r in e[1]]
        for rank in out:  # sent as RankInfo
            assert RankInfo.model_validate(rank).model_dump(mode="json") == rank
        return out

    def lines(self, rank: int | None = None) -> list[tuple[int, str, str]]:
        return [(e[1], e[2], line) for e in self.events if e[0] == "log"
                for line in e[3] if rank is None or e[1] == rank]

    def has_line(self, text: str) -> bool:
        return any(text in line for _, _, line in self.lines())


def exited(rec: Recorder) -> bool:
    return bool(rec.exits())


def request(tmp_path, node: str, *, node_rank=0, nnodes=1, nproc=1, port=None,
            local_addr="127.0.0.1", config=None, attempt_id=1, **kw) -> LaunchRequest:
    return LaunchRequest(
        job_id=7, attempt_id=attempt_id, node=node, node_rank=node_rank, nnodes=nnodes,
        nproc=nproc, slots=tuple(range(nproc)), device="cpu", rdzv_host="127.0.0.1",
        rdzv_port=port or pick_free_port("127.0.0.1"), local_addr=local_addr,
        config=config or {}, run_dir=str(tmp_path / "runs" / f"attempt-{attempt_id}" / node),
        module=FAKE, **kw)


def two_nodes(tmp_path, config, recs, **kw) -> list[Supervisor]:
    port = pick_free_port("127.0.0.1")
    sups = [Supervisor(request(tmp_path, node, node_rank=i, nnodes=2, port=port,
                               local_addr=addr, config=config, **kw), **rec.callbacks())
            for i, (node, addr, rec) in enumerate(
                [("node-a", "127.0.0.1", recs[0]), ("node-b", "127.0.0.2", recs[1])])]
    assert all(s.start() for s in sups)
    return sups


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wrapper_pid(sup: Supervisor) -> int:
    with open(os.path.join(sup.run_dir, "supervisor.json")) as f:
        return json.load(f)["wrapper_pid"]


def leftovers(pids) -> list[tuple[int, list]]:
    out = []
    for pid in pids:
        try:
            if running(pid):
                out.append((pid, psutil.Process(pid).cmdline()))
        except psutil.NoSuchProcess:
            pass
    return out


def attempt_processes(run_dir: str) -> list[psutil.Process]:
    """procwrap, torchrun and the ranks of one run_dir, found by command line."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(run_dir in a for a in cmd) and running(p.pid):
            found.append(p)
    return found


# ---- fast: no processes -------------------------------------------------------------------

def test_argv_is_accepted_by_torchrun_and_hosts_only_on_node_rank_0(tmp_path):
    from torch.distributed.run import get_args_parser  # the 2.13 parser itself

    for node_rank, is_host in ((0, "1"), (1, "0")):
        req = request(tmp_path, "n", node_rank=node_rank, nnodes=2, port=29400)
        argv = launcher.build_argv(req, "/r/config.json", "/r/logs")
        assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
        args = get_args_parser().parse_args(argv[3:])
        assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2", "1", "c10d")
        assert args.rdzv_endpoint == "127.0.0.1:29400" and args.rdzv_id == "attempt-1"
        assert args.rdzv_conf == f"is_host={is_host}" and args.local_addr == "127.0.0.1"
        assert (args.max_restarts, args.redirects, args.log_dir) == (0, "3", "/r/logs")
        assert args.module and args.training_script == FAKE
        assert args.training_script_args == ["--config", "/r/config.json"]


def test_env_per_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", "/elsewhere/error.json")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    req = request(tmp_path, "node-b", nproc=2, local_addr="127.0.0.2", cores_per_slot=3,
                  env={"FOO": 1})
    env = launcher.build_env(dataclasses.replace(req, slots=(2, 3), device="cuda"))
    assert env["OMP_NUM_THREADS"] == "3" and env["TRAINYARD_NODE"] == "node-b"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["FOO"] == "1"
    assert env["GLOO_SOCKET_IFNAME"] in psutil.net_if_addrs()
    assert "TORCHELASTIC_ERROR_FILE" not in env
    assert env["PATH"] == f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"
    assert env["HOME"] == os.path.join(os.path.abspath(req.run_dir), "home")
    assert env["TMPDIR"] == os.path.join(os.path.abspath(req.run_dir), "tmp")
    assert launch_spec.REPO_ROOT in env["PYTHONPATH"].split(os.pathsep)
    cpu = launcher.build_env(req)
    assert "CUDA_VISIBLE_DEVICES" not in cpu
    # gloo and NCCL on the interface holding the node's address (tests/test_nccl_setup.py)
    assert cpu["GLOO_SOCKET_IFNAME"] == cpu["NCCL_SOCKET_IFNAME"]


def test_user_code_argv_runs_the_script_or_module_under_the_jobs_python(tmp_path):
    from torch.distributed.run import get_args_parser

    code = str(tmp_path / "code")
    base = request(tmp_path, "n", port=29400, user_code=True, code_dir=code, python="/opt/env/bin/python",
                   args=("--lr", "3e-4", "-m", "x"))
    script = dataclasses.replace(base, script=f"{code}/src/train.py")
    argv = launcher.build_argv(script, "/r/config.json", "/r/logs")
    assert argv[:3] == ["/opt/env/bin/python", "-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(argv[3:])
    assert not args.module and args.training_script == f"{code}/src/train.py"
    assert args.training_script_args == ["--lr", "3e-4", "-m", "x"]  # the script's, not torchrun's
    assert (args.max_restarts, args.rdzv_id, args.log_dir) == (0, "attempt-1", "/r/logs")
    module = dataclasses.replace(base, module="mypkg.train")
    args = get_args_parser().parse_args(launcher.build_argv(module, "/r/config.json", "/r/logs")[3:])
    assert args.module and args.training_script == "mypkg.train"
    assert args.training_script_args == ["--lr", "3e-4", "-m", "x"]
    home = os.path.join(os.path.abspath(base.run_dir), "home")
    assert script.cwd == code and dataclasses.replace(base, code_dir="").cwd == home
    builtin = request(tmp_path, "n", port=29400)
    assert builtin.cwd == home and launcher.build_argv(builtin, "/c", "/l")[0] == sys.executable


def test_user_code_env_puts_the_bundle_and_the_sdk_on_the_path_and_the_run_config_everywhere(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/site/extra", launch_spec.REPO_ROOT]))
    code = str(tmp_path / "code")
    req = request(tmp_path, "n", user_code=True, code_dir=code, script=f"{code}/train.py",
                  env={"HF_HOME": "/data/hf", "GLOO_SOCKET_IFNAME": "eth9"})
    env = launcher.build_env(req)
    assert env["PYTHONPATH"].split(os.pathsep) == [code, launch_spec.REPO_ROOT]  # not the agent's
    assert env["HF_HOME"] == "/data/hf" and env["GLOO_SOCKET_IFNAME"] == "eth9"  # the job's own, kept
    assert env["TRAINYARD_RUN_CONFIG"] == os.path.join(os.path.abspath(req.run_dir), "config.json")
    builtin = launcher.build_env(request(tmp_path, "n"))  # the built-in runtime reads it the same way
    assert builtin["TRAINYARD_RUN_CONFIG"] == env["TRAINYARD_RUN_CONFIG"]
    assert builtin["PYTHONPATH"].split(os.pathsep) == [launch_spec.REPO_ROOT]


def test_the_ranks_get_nothing_of_the_agents_environment_but_what_the_operator_names(tmp_path):
    """Issue 21 s2: by allow-list. Before, every rank inherited the agent's whole environment:
    its REDIS_URL with the node's password, TRAINYARD_VAR_DIR (the control plane's secrets under
    make run), the node credential file's path."""
    agent = {"REDIS_URL": "redis://node-a:s3cret@127.0.0.1:6379/0", "TRAINYARD_VAR_DIR": "/srv/var",
             "TRAINYARD_NODE_CREDENTIAL_FILE": "/srv/cred", "DJANGO_SECRET_KEY": "k", "AWS_SECRET_ACCESS_KEY": "x",
             "PATH": "/evil/bin:/usr/bin", "PYTHONPATH": "/evil", "LD_PRELOAD": "/evil.so", "LANG": "de_DE.UTF-8",
             "NCCL_IB_HCA": "mlx5_0", "NCCL_DEBUG": "INFO", "UCX_TLS": "rc", "TORCHELASTIC_RUN_ID": "x",
             "NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}
    req = request(tmp_path, "n", env={"WANDB_MODE": "offline"})
    env = launch_spec.build_env(req, agent)
    leaked = {k for k in env if k in agent and agent[k] == env[k]}
    assert leaked == {"LANG", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}, leaked  # locale and the fabric binding
    assert env["WANDB_MODE"] == "offline" and "secret" not in json.dumps(env).lower()
    passed = launch_spec.build_env(req, agent, passes=lambda n: n == "NCCL_IB_HCA" or n.startswith("UCX_"))
    assert (passed["NCCL_IB_HCA"], passed["UCX_TLS"]) == ("mlx5_0", "rc") and "NCCL_DEBUG" not in passed
    trainyard_named = launch_spec.build_env(req, agent, passes=lambda n: True)  # an operator's "*"
    assert "REDIS_URL" in trainyard_named and not any(k in trainyard_named for k in (
        "TRAINYARD_VAR_DIR", "TRAINYARD_NODE_CREDENTIAL_FILE", "TORCHELASTIC_RUN_ID"))


@pytest.mark.parametrize("change", [
    {"script": "train.py"}, {"python": "python3"}, {"code_dir": "code"}, {"script": "/elsewhere/train.py"},
    {"script": "/c/../x.py"}, {"user_code": False}, {"args": (1,)},
])
def test_rejects_user_code_requests_that_escape_or_would_be_read_as_options(tmp_path, change):
    req = request(tmp_path, "n", port=29400, user_code=True, code_dir="/c", script="/c/train.py")
    Supervisor(req, on_ranks=print, on_log=print, on_exit=print)  # the unchanged request is fine
    with pytest.raises(ValueError):
        Supervisor(dataclasses.replace(req, **change), on_ranks=print, on_log=print, on_exit=print)


@pytest.mark.parametrize("change", [
    {"module": "-c"}, {"module": "x; rm"}, {"local_addr": "--nnodes"}, {"rdzv_host": "a b"},
    {"nproc": 2}, {"node_rank": 2}, {"device": "tpu"}, {"rdzv_port": 0},
])
def test_rejects_requests_that_would_inject_or_mislead_torchrun(tmp_path, change):
    req = dataclasses.replace(request(tmp_path, "n", port=29400), **change)
    with pytest.raises(ValueError):
        Supervisor(req, on_ranks=print, on_log=print, on_exit=print)


def test_launcher_imports_no_control_plane():
    code = ("import sys, workers.launcher; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('django', 'jobs', 'controlplane', 'torch', 'celery')]; print(bad); "
            "sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=launch_spec.REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_pick_free_port_binds_on_a_second_loopback_address():
    port = pick_free_port("127.0.0.2")
    with socket.socket() as s:
        s.bind(("127.0.0.2", port))


def test_log_tailer_labels_only_known_ranks_and_flushes_partial_lines_at_the_end(tmp_path):
    rank_dir = tmp_path / "logs" / "attempt-1_abc" / "attempt_0"
    for lr in (0, 1):
        (rank_dir / str(lr)).mkdir(parents=True)
    (rank_dir / "0" / "stdout.log").write_text("a\nb\npart")
    (rank_dir / "1" / "stderr.log").write_text("x\n")
    tailer = launcher_logs.LogTailer(str(tmp_path / "logs"), nproc=2)
    assert tailer.poll(final=False, ready=lambda lr: lr == 0) == [(0, "stdout", ["a", "b"])]
    with open(rank_dir / "0" / "stdout.log", "a") as f:
        f.write("ial\nlast words")  # the line completes; the last one never gets a newline
    assert tailer.poll(final=False, ready=lambda lr: lr == 0) == [(0, "stdout", ["partial"])]
    assert tailer.poll(final=True, ready=lambda lr: True) == [
        (0, "stdout", ["last words"]), (1, "stderr", ["x"])]
    assert tailer.tails() == {0: ["a", "b", "partial", "last words"], 1: ["x"]}

    adopted = launcher_logs.LogTailer(str(tmp_path / "logs"), nproc=2)
    adopted.skip_to_end()
    assert adopted.poll(final=True, ready=lambda lr: True) == []
    assert adopted.tails()[0][-1] == "last words"


def test_error_file_time_has_sub_second_resolution(tmp_path):
    rank_dir = tmp_path / "logs" / "attempt-1_abc" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    path = rank_dir / "error.json"
    now = time.time()
    path.write_text(json.dumps({"message": {"message": "ValueError: bad", "extraInfo": {
        "py_callstack": "Traceback ...", "timestamp": str(int(now))}}}))
    os.utime(path, (now, int(now) + 0.25))
    err = launcher_logs.read_error_file(launcher_logs.LogTailer(str(tmp_path / "logs"), nproc=1), 0)
    assert err == {"message": "ValueError: bad", "traceback": "Traceback ...",
                   "timestamp": pytest.approx(int(now) + 0.25, abs=1e-3)}


def test_files_a_job_planted_in_its_logs_are_never_followed(tmp_path):
    """Issue 21 s5: logs/ and ranks/ are the job's; a symlink there must not make the agent read
    (and stream back to the job's owner) a file only the agent can read."""
    secret = tmp_path / "secret_key"
    secret.write_text("the control plane's secret\n" * 3)
    run = tmp_path / "run"
    rank_dir = run / "logs" / "attempt-1_abc" / "attempt_0"
    (rank_dir / "0").mkdir(parents=True)
    (rank_dir / "0" / "stdout.log").symlink_to(secret)
    (rank_dir / "0" / "stderr.log").symlink_to(secret)
    (rank_dir / "0" / "error.json").symlink_to(secret)
    os.mkfifo(rank_dir / "0" / "fifo")
    (rank_dir / "1").symlink_to(secret.parent)  # a whole rank directory elsewhere
    (run / "ranks").mkdir()
    (run / "ranks" / "0.json").symlink_to(secret)
    tailer = launcher_logs.LogTailer(str(run / "logs"), nproc=2)
    got = tailer.poll(final=True, ready=lambda lr: True)
    assert not any("secret" in line for _, _, lines in got for line in lines), got
    assert launcher_logs.read_error_file(tailer, 0) is None and tailer.stderr_tail(0, 10) == []
    assert tailer.read_file(0, "fifo", 100) is None  # refused at once, not blocking the agent
    assert launcher_logs.read_run_json(str(run), "ranks/0.json") is None
    failures = launcher_logs.collect_failures(tailer, str(run / "none.log"), lambda lr: lr, {}, 0.0)
    assert "secret" not in json.dumps(failures)


SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
fake_worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_03:37:05
  host      : localhost
  rank      : 2 (local_rank: 0)
  exitcode  : -15 (pid: 5895)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 5895
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_03:37:05
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 5896)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 5896
============================================================
"""


def test_failures_without_error_files_come_from_torchruns_summary(tmp_path):
    (tmp_path / "torchrun.stderr.log").write_text("noise\n" + SUMMARY)
    tailer = launcher_logs.LogTailer(str(tmp_path / "logs"), nproc=2)
    # Both deaths bracketed in the same 150 ms window: the SIGKILL is placed at its start
    # (a likely cause), the SIGTERM torchrun sent to the survivor at its end.
    died = {0: (100.0, 100.15), 1: (100.0, 100.15)}
    failures = launcher_logs.collect_failures(
        tailer, str(tmp_path / "torchrun.stderr.log"), lambda lr: 2 + lr, died, 0.0)
    assert [(f["rank"], f["local_rank"], f["exitcode"], f["signal"], f["timestamp"])
            for f in failures] == [(3, 1, -9, "SIGKILL", 100.0), (2, 0, -15, "SIGTERM", 100.15)]
    assert failures[0]["message"] == "Signal 9 (SIGKILL) received by PID 5896"


def test_a_script_without_record_is_diagnosed_from_the_traceback_on_its_stderr(tmp_path):
    from jobs.attempts.policy.diagnosis import diagnose

    rank_dir = tmp_path / "logs" / "attempt-1_abc" / "attempt_0"
    (rank_dir / "0").mkdir(parents=True)
    (rank_dir / "1").mkdir(parents=True)
    # torch's excepthook prefixes every line with "[rank3]: " once a process group exists
    (rank_dir / "1" / "stderr.log").write_text("\n".join("[rank3]: " + line for line in (
        "warming up\nTraceback (most recent call last):\n  File \"/c/train.py\", line 3, in <module>\n"
        "    raise KeyError('x')\nKeyError: 'x'\n\nDuring handling of the above exception, another "
        "exception occurred:\n\nTraceback (most recent call last):\n  File \"/c/train.py\", line 5, in "
        "<module>\n    raise ValueError('bad lr')\nValueError: bad lr").splitlines()) + "\n[W1201 gloo] shutting down\n")
    summary = SUMMARY.replace("exitcode  : -9 (pid: 5896)  (SIGKILL)", "exitcode  : 1 (pid: 5896)")
    (tmp_path / "torchrun.stderr.log").write_text(summary)
    tailer = launcher_logs.LogTailer(str(tmp_path / "logs"), nproc=2)
    failures = launcher_logs.collect_failures(tailer, str(tmp_path / "torchrun.stderr.log"), lambda lr: 2 + lr,
                                              {1: (100.0, 100.1), 0: (100.1, 100.2)}, 0.0)
    failed = next(f for f in failures if f["rank"] == 3)
    assert failed["message"] == "ValueError: bad lr" and failed["exitcode"] == 1
    assert failed["traceback"].startswith("Traceback") and failed["traceback"].endswith("ValueError: bad lr")
    d = diagnose([{"node": "node-a", "failures": failures}])
    assert (d.failure_class, d.retry, d.rank, d.message) == ("user_error", False, 3, "ValueError: bad lr")
    (rank_dir / "1" / "stderr.log").write_text("no traceback here\n")
    failures = launcher_logs.collect_failures(tailer, str(tmp_path / "torchrun.stderr.log"), lambda lr: 2 + lr,
                                              {}, 0.0)
    assert next(f for f in failures if f["rank"] == 3)["message"].startswith("exit code 1 without an error file")


# ---- real torchrun ------------------------------------------------------------------------

@pytest.mark.procs
@pytest.mark.timeout(90)
def test_two_nodes_rendezvous_over_loopback_and_report(tmp_path):
    recs = [Recorder(), Recorder(fail_first_log=True)]
    two_nodes(tmp_path, {"steps": 3}, recs, env={"FAKE_EXTRA": "x-1"})
    for rec in recs:
        rec.wait(exited)

    results = [rec.exits()[0] for rec in recs]
    for node, result in zip(("node-a", "node-b"), results):
        assert json.loads(json.dumps(result)) == result  # it travels over Celery as JSON
        assert (result["node"], result["exit_code"], result["failures"]) == (node, 0, [])
        assert result["stopped"] is False and result["duration_s"] > 0
    ranks = recs[0].ranks() + recs[1].ranks()
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for rec, node in zip(recs, ("node-a", "node-b")):
        (r,) = rec.ranks()
        assert r["node"] == node and r["local_rank"] == 0
        # The pid is the real rank process: the rank printed it, and the line is labelled
        # with the global rank that process reported.
        hello = [line for rank, stream, line in rec.lines(r["rank"]) if "hello" in line]
        assert hello == [f"hello from rank {r['rank']} pid={r['pid']} omp=1 node={node} extra=x-1"]
        assert (r["rank"], "stderr", f"stderr line from rank {r['rank']}") in rec.lines()
        assert any("done after 3 steps" in line for line in results[recs.index(rec)]
                   ["log_tail"][str(r["rank"])])
    # node-b's first on_log raised; supervision went on and still delivered later lines.
    assert recs[1].has_line("done after 3 steps")


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_first_failure_across_nodes_is_the_cause_not_the_consequence(tmp_path):
    recs = [Recorder(), Recorder()]
    two_nodes(tmp_path, {"fail_rank": 1, "steps": 200}, recs)
    for rec in recs:
        rec.wait(exited)

    results = [rec.exits()[0] for rec in recs]
    assert all(r["exit_code"] not in (0, None) for r in results)
    failures = sorted((f for r in results for f in r["failures"]), key=lambda f: f["timestamp"])
    first, later = failures[0], failures[1:]
    assert (first["rank"], first["message"]) == (1, "ValueError: bad shape")
    assert first["traceback"].startswith("Traceback")
    assert 'raise ValueError("bad shape")' in first["traceback"]
    # The survivor also failed (gloo: peer closed the connection), later: a consequence.
    assert [f["rank"] for f in later] == [0]
    assert later[0]["timestamp"] > first["timestamp"]
    assert "Connection closed" in later[0]["message"] or "peer" in later[0]["message"].lower()
    # The failing rank's last line was delivered, and before on_exit.
    failing = next(rec for rec in recs if 1 in [r["rank"] for r in rec.ranks()])
    kinds = [e[0] for e in failing.events]
    last_line = next(i for i, e in enumerate(failing.events)
                     if e[0] == "log" and any("about to fail" in s for s in e[3]))
    assert last_line < kinds.index("exit")


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_stop_kills_the_whole_tree_even_a_rank_ignoring_sigterm(tmp_path):
    rec = Recorder()
    sup = Supervisor(request(tmp_path, "node-a", nproc=2,
                             config={"hang_rank": 1, "steps": 100000}), **rec.callbacks())
    assert sup.start()
    rec.wait(lambda r: r.has_line("rank 1 allreduce") and len(r.ranks()) == 2)
    wrapper = psutil.Process(wrapper_pid(sup))
    pids = {wrapper.pid} | {p.pid for p in wrapper.children(recursive=True)}
    pids |= {r["pid"] for r in rec.ranks()}
    assert len(pids) >= 4  # procwrap, torchrun, 2 ranks
    assert sup.alive()

    t0 = time.monotonic()
    sup.stop(grace_s=1.0)
    while leftovers(pids) and time.monotonic() < t0 + 5.0:  # no exit event for non-children
        time.sleep(0.05)
    assert leftovers(pids) == [], f"{time.monotonic() - t0:.1f} s after stop()"
    # Our SIGKILL did it, not torchrun's own SIGTERM->SIGKILL timeout for rank 1.
    assert time.monotonic() - t0 < launch_spec.SHUTDOWN_TIMEOUT_S - 1
    rec.wait(exited, timeout=5)
    sup._thread.join(5)
    (result,) = rec.exits()
    assert result["stopped"] is True and result["lost"] is False
    assert not sup.alive()
    sup.stop()  # idempotent, and no second on_exit
    assert len(rec.exits()) == 1


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_start_is_idempotent_per_run_dir(tmp_path):
    rec, rec2 = Recorder(), Recorder()
    req = request(tmp_path, "node-a", config={"steps": 100000})
    sup = Supervisor(req, **rec.callbacks())
    assert sup.start() is True
    assert sup.start() is False  # the same message delivered twice
    restarted = Supervisor(req, **rec2.callbacks())  # a restarted agent gets it again
    assert restarted.start() is False

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        procs = attempt_processes(sup.run_dir)
        if any("torch.distributed.run" in p.cmdline() and "workers.procwrap" not in p.cmdline()
               for p in procs):
            break
        time.sleep(0.05)
    cmdlines = [p.cmdline() for p in attempt_processes(sup.run_dir)]
    assert sum("workers.procwrap" in c for c in cmdlines) == 1, cmdlines
    assert sum("torch.distributed.run" in c and "workers.procwrap" not in c
               for c in cmdlines) == 1, cmdlines
    sup.stop(grace_s=1.0)
    assert len(rec.exits()) == 1 and rec2.events == []


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_adopt_after_agent_death_reports_the_exit(tmp_path):
    old = Recorder()
    req = request(tmp_path, "node-a", config={"steps": 20})  # ~1 s of steps after adoption
    sup = Supervisor(req, **old.callbacks())
    assert sup.start()
    old.wait(lambda r: r.has_line("rank 0 allreduce"))
    sup._abandon()  # the agent dies: its threads stop, torchrun goes on
    base = str(tmp_path / "runs")
    assert launched_attempts(base) == [sup.run_dir]

    new = Recorder()
    adopted = Supervisor.adopt(sup.run_dir, **new.callbacks())
    assert adopted is not None and adopted.alive()
    new.wait(exited)
    (result,) = new.exits()
    assert (result["exit_code"], result["failures"], result["stopped"]) == (0, [], False)
    assert result["attempt_id"] == 1 and result["node"] == "node-a"
    assert [r["rank"] for r in new.ranks()] == [0]
    assert new.has_line("rank 0 done after 20 steps")  # streamed after adoption
    assert not new.has_line("hello from rank 0")  # resumed at the end: no duplicates...
    assert any("hello from rank 0" in line for line in result["log_tail"]["0"])  # ...kept
    assert old.exits() == []
    adopted._thread.join(5)  # `reported` is written once on_exit has returned
    assert launched_attempts(base) == []  # reported: the next restart leaves it alone
    assert Supervisor.adopt(sup.run_dir, **Recorder().callbacks()) is None


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_wrapper_killed_means_lost_and_nothing_left_running(tmp_path):
    rec = Recorder()
    sup = Supervisor(request(tmp_path, "node-a", config={"steps": 100000}), **rec.callbacks())
    assert sup.start()
    rec.wait(lambda r: r.has_line("allreduce"))  # the supervisor has seen the whole tree
    wrapper = psutil.Process(wrapper_pid(sup))
    pids = {p.pid for p in wrapper.children(recursive=True)} | {r["pid"] for r in rec.ranks()}
    os.kill(wrapper.pid, signal.SIGKILL)
    rec.wait(exited, timeout=15)
    (result,) = rec.exits()
    assert (result["lost"], result["exit_code"], result["stopped"]) == (True, None, False)
    assert leftovers(pids) == []


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_ranks_do_not_outlive_a_killed_torchrun(tmp_path):
    rec = Recorder()
    sup = Supervisor(request(tmp_path, "node-a", config={"steps": 100000}), **rec.callbacks())
    assert sup.start()
    rec.wait(lambda r: r.has_line("allreduce"))
    (torchrun,) = psutil.Process(wrapper_pid(sup)).children()
    rank_pid = rec.ranks()[0]["pid"]
    torchrun.kill()  # e.g. the OOM killer: the rank, in its own session, is orphaned
    rec.wait(exited, timeout=15)
    (result,) = rec.exits()
    assert (result["exit_code"], result["signal"], result["lost"]) == (-9, "SIGKILL", False)
    assert leftovers([rank_pid]) == []  # procwrap (subreaper) killed it before exit.json


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_rank_killed_by_signal_is_reported_with_the_signal(tmp_path):
    rec = Recorder()
    sup = Supervisor(request(tmp_path, "node-a", nproc=2,
                             config={"fail_rank": 1, "fail_mode": "sigkill", "steps": 200}),
                     **rec.callbacks())
    assert sup.start()
    rec.wait(exited)
    (result,) = rec.exits()
    assert result["exit_code"] not in (0, None) and result["stopped"] is False
    first = result["failures"][0]
    assert (first["rank"], first["local_rank"], first["exitcode"], first["signal"]) == \
        (1, 1, -9, "SIGKILL")
    assert "SIGKILL" in first["message"] and first["traceback"] is None
    assert abs(first["timestamp"] - time.time()) < 60
    assert any("about to fail (sigkill)" in line for line in result["log_tail"]["1"])


USER_CODE = os.path.join(launch_spec.REPO_ROOT, "tests", "launcher_fixtures", "user_code")


def user_request(tmp_path, **kw) -> LaunchRequest:
    return request(tmp_path, "node-a", nproc=2, user_code=True, code_dir=USER_CODE,
                   script=os.path.join(USER_CODE, "train.py"), env={"USER_EXTRA": "e-1"}, **kw)


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_a_script_that_never_imports_the_sdk_is_labelled_and_supervised(tmp_path):
    rec = Recorder()
    sup = Supervisor(user_request(tmp_path, args=("--steps", "4")), **rec.callbacks())
    assert sup.start()
    rec.wait(exited)
    (result,) = rec.exits()
    assert (result["exit_code"], result["failures"]) == (0, [])
    ranks = rec.ranks()  # found from the processes torchrun started: the script wrote no ranks file
    assert sorted((r["rank"], r["local_rank"]) for r in ranks) == [(0, 0), (1, 1)]
    config = os.path.join(sup.run_dir, "config.json")
    for r in ranks:
        hello = [line for _, _, line in rec.lines(r["rank"]) if line.startswith("user rank")]
        assert hello == [f"user rank {r['rank']} pid={r['pid']} cwd={USER_CODE} config={config} "
                         "helper from the code dir extra=e-1", f"user rank {r['rank']} done sum=2"]


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_a_script_without_the_sdk_failing_is_diagnosed_from_its_traceback(tmp_path):
    from jobs.attempts.policy.diagnosis import diagnose

    rec = Recorder()
    assert Supervisor(user_request(tmp_path, args=("--fail-rank", "1", "--steps", "200")), **rec.callbacks()).start()
    rec.wait(exited)
    (result,) = rec.exits()
    assert result["exit_code"] not in (0, None)
    first = result["failures"][0]
    assert (first["rank"], first["message"]) == (1, "ValueError: user code refused step 1"), result["failures"]
    assert 'train.py", line' in first["traceback"]
    d = diagnose([dict(result, node="node-a")])
    assert (d.failure_class, d.retry, d.rank) == ("user_error", False, 1)


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_a_module_entrypoint_is_found_in_the_code_dir(tmp_path):
    rec = Recorder()
    req = dataclasses.replace(user_request(tmp_path, args=("--steps", "2")), nproc=1, slots=(0,), script="",
                              module="train")  # `python -m train`: the code dir is first on PYTHONPATH
    assert Supervisor(req, **rec.callbacks()).start()
    rec.wait(exited)
    (result,) = rec.exits()
    assert (result["exit_code"], result["failures"]) == (0, [])
    (rank,) = rec.ranks()
    assert "user rank 0 done sum=1" in [line for _, _, line in rec.lines(0)], rec.lines()
    assert rank["rank"] == 0
