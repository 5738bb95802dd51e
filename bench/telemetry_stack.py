"""The processes of bench/telemetry.py's live path, started and stopped: a redis-server, the
database migrated by `manage.py migrate` with jobs and attempts created through `jobs.services`
(SETUP), the relay, daphne, and the simulated ranks and websocket clients (bench/telemetry_roles.py,
each a `bench/telemetry.py --role ...` process spoken to through `Child`). The measurements on top
of them are bench/telemetry_measure.py's `Bench`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from trainyard import keys  # the repository root is on sys.path (bench/telemetry.py)

REPO = Path(__file__).resolve().parent.parent  # on sys.path: bench/telemetry.py puts it there
PY = sys.executable
# What the ranks and clients run (`--role emitter|client`): the entry point, not this module.
SCRIPT = str(Path(__file__).resolve().parent / "telemetry.py")


def say(*args) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """A subprocess speaking one JSON line per command."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path):
        self.name = name
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "ab"), text=True, bufsize=1)

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited (rc={self.proc.poll()})")
        return json.loads(line)

    def ask(self, cmd: dict) -> dict:
        self.send(cmd)
        return self.recv()


SETUP = r"""
import json, sys
import django
django.setup()
from django.contrib.auth import get_user_model
from jobs import services
from jobs.core import dispatch
from trainyard.launch import Heartbeat
from jobs.models import Attempt
dispatch.send_launch = lambda *a, **k: None   # no agent runs here: the bench plays the ranks
jobs, ranks = int(sys.argv[1]), int(sys.argv[2])
admin = get_user_model().objects.get(username="admin")
services.node_add("bench-node", slots=256, address="127.0.0.1", reissue=True)  # staff registration (issue 16)
services.node_heartbeat(Heartbeat(name="bench-node", address="127.0.0.1", slots=256, labels={},
                                  cpu_percent=0.0, mem_percent=0.0))
out = []
for j in range(jobs):
    job = services.job_submit(user=admin, spec=services.submitted_spec({
        "name": f"bench-{j}", "resources": {"nodes": 1, "procs_per_node": ranks}, "train": {"steps": 10_000_000}}))
    services.schedule_tick()
    att = Attempt.objects.get(job=job)
    services.attempt_ranks(att.pk, node_name="bench-node",
                           ranks=[{"rank": r, "local_rank": r, "pid": 1} for r in range(ranks)])
    att.refresh_from_db()
    assert att.status == "RUNNING", att.status
    out.append({"job": job.pk, "attempt": att.pk})
print(json.dumps(out))
"""


class Stack:
    """The processes of one run, in a temporary directory; `Bench` measures on top of them."""

    def __init__(self, args, db_env: dict | None = None, db_pid: int | None = None):
        """db_env: the database's environment (default: a SQLite file in the work directory);
        db_pid: the database server's pid, whose CPU (its backends' included) is counted."""
        self.args = args
        self.db_pid = db_pid
        self.dir = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.emitters: list[Child] = []
        self.clients: list[Child] = []
        self.step = 1  # next unused step: phases never reuse (attempt, rank, step)
        self.env = dict(os.environ)
        self.env.update({
            "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "TRAINYARD_VAR_DIR": str(self.dir / "var"), "TRAINYARD_DB": str(self.dir / "db.sqlite3"),
            "TRAINYARD_DATA_ROOT": str(self.dir / "data"), "TRAINYARD_ADMIN_PASSWORD": "bench-pw-1",
            "DJANGO_SECRET_KEY": "bench-only", "TRAINYARD_LOG_LEVEL": "WARNING", "DATABASE_URL": "",
        })
        self.env.update(db_env or {})

    def start(self) -> None:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            sys.exit("redis-server is not installed (make deps)")
        rport = free_port()
        (self.dir / "redis").mkdir()
        self.procs["redis"] = subprocess.Popen(
            [exe, "--port", str(rport), "--bind", "127.0.0.1", "--dir", str(self.dir / "redis"),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.redis_url = f"redis://127.0.0.1:{rport}/0"
        self.env["REDIS_URL"] = self.redis_url
        self.r = redis.Redis.from_url(self.redis_url)
        self.wait(lambda: self._ping(), 10, "redis")
        for d in ("var", "data"):
            (self.dir / d).mkdir(exist_ok=True)
        for argv in (["migrate", "--noinput", "-v", "0"], ["ensure_admin"]):
            subprocess.run([PY, "manage.py", *argv], cwd=REPO, env=self.env, check=True, capture_output=True)
        self.token = subprocess.run([PY, "manage.py", "api_token", "admin"], cwd=REPO, env=self.env, check=True,
                                    capture_output=True, text=True).stdout.strip()
        out = subprocess.run([PY, "-c", SETUP, str(self.args.jobs), str(self.args.ranks)], cwd=REPO, env=self.env,
                             check=True, capture_output=True, text=True).stdout
        self.jobs = json.loads(out.strip().splitlines()[-1])
        self.port = free_port()
        self.start_proc("daphne", [PY, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
                                   "controlplane.asgi:application"])
        self.start_proc("relay", [PY, "manage.py", "relay", "--workers", str(self.args.relay_workers)])
        self.wait(self._web_ok, 60, "daphne")
        say(f"up: redis {self.redis_url}, daphne :{self.port}, jobs {self.jobs}, dir {self.dir}")
        for job in self.jobs:
            for rank in range(self.args.ranks):
                self.emitters.append(Child(f"emitter-{job['job']}-{rank}", [
                    PY, SCRIPT, "--role", "emitter", "--redis", self.redis_url, "--rank", str(rank),
                    "--attempt", str(job["attempt"]), "--stream", keys.attempt_stream(job['job'], job['attempt'])],
                    self.env, self.dir / "emitters.log"))
            for c in range(self.args.clients):
                self.clients.append(Child(f"client-{job['job']}-{c}", [
                    PY, SCRIPT, "--role", "client", "--port", str(self.port), "--token", self.token,
                    "--job", str(job["job"])], self.env, self.dir / "clients.log"))
        for child in self.emitters + self.clients:
            child.recv()  # ready (clients: snapshot received)

    def _ping(self) -> bool:
        try:
            return self.r.ping()
        except Exception:
            return False

    def _web_ok(self) -> bool:
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/v1/nodes/",
                                     headers={"Authorization": f"Token {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def relay_children(self) -> list[int]:
        """The relay processes `manage.py relay --workers N` runs (none with one worker)."""
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.procs["relay"].pid).children()]
        except psutil.Error:
            return []

    def signal_relay(self, signum: int) -> None:
        """The relay's process and, with --relay-workers, the relay processes it runs."""
        for pid in self.relay_children():
            try:
                os.kill(pid, signum)
            except OSError:
                pass
        self.procs["relay"].send_signal(signum)

    def start_proc(self, name: str, argv: list[str]) -> None:
        self.procs[name] = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=open(self.dir / f"{name}.log", "ab"),
                                            stderr=subprocess.STDOUT)

    def wait(self, cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}; logs in {self.dir}")
            time.sleep(0.1)

    def stop(self) -> None:
        for child in self.emitters + self.clients:
            try:
                child.send({"cmd": "quit"})
            except (OSError, ValueError):
                pass
        for child in self.emitters + self.clients:
            try:
                child.proc.wait(15)
            except subprocess.TimeoutExpired:
                child.proc.kill()
        for name in ("relay", "daphne", "redis"):
            proc = self.procs.get(name)
            if proc and proc.poll() is None:
                if name == "relay":
                    self.signal_relay(signal.SIGCONT)
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

