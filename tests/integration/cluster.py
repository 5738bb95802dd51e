"""A real single-machine Trainyard for integration tests: redis-server, daphne, a Celery control
worker + beat, the relay and two node agents (node-a on 127.0.0.1, node-b on 127.0.0.2), each a
separate process, talking over a Redis on a free port. Nothing is faked or run eagerly."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from tests import postgres
from tests.conftest import REPO, RedisServer, free_port

PY = sys.executable


def start_daphne(env: dict, workdir: Path, probe: str = "/accounts/login/") -> tuple[subprocess.Popen, int]:
    """daphne serving the control plane on a free loopback port, logging to workdir/web.log;
    returns once `probe` answers (a RuntimeError with the log if it dies or 60 s pass)."""
    port = free_port()
    log = open(workdir / "web.log", "ab")
    proc = subprocess.Popen([PY, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "controlplane.asgi:application"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=2).request("GET", probe)
            return proc, port
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError((workdir / "web.log").read_text()) from None
            time.sleep(0.2)


class Cluster:
    _live: set["Cluster"] = set()  # started and not stopped: another cluster's stop leaves them alone

    def __init__(self, workdir: Path, *, slots: int = 2, web_workers: int = 1, redis_tls: bool = False):
        self.dir = Path(workdir)
        self.slots = slots
        self.web_workers = web_workers
        self.host = "127.0.0.1"  # where the web server listens (tests/integration/test_multihost.py: a test host)
        self.node_addresses = {"node-a": "127.0.0.1", "node-b": "127.0.0.2"}
        # Redis with make run's ACL users: the control plane's processes use self.redis.url, each agent its own.
        self.redis = RedisServer(self.dir / "redis", acl_nodes=["node-a", "node-b"], tls=redis_tls)
        self.port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ)
        self.env.update({
            "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "TRAINYARD_VAR_DIR": str(self.dir / "var"),
            "TRAINYARD_DATA_ROOT": str(self.dir / "data"), "TRAINYARD_RUN_DIR": str(self.dir / "agents"),
            "TRAINYARD_CHECKPOINT_ROOT": str(self.dir / "ckpt"), "TRAINYARD_ADMIN_PASSWORD": "integration-pw-1",
            "REDIS_URL": "", "DJANGO_SECRET_KEY": "integration-tests-only",
        })
        # Under `make test-postgres` (tests/postgres.py): a database of its own on the session's server,
        # shared by every process of this cluster. Otherwise a SQLite file (TRAINYARD_DB).
        self.env.update(postgres.fresh_database_env(self.dir / "db.sqlite3"))
        self.token = ""

    # ------------------------------------------------------------ processes
    def commands(self) -> dict[str, list[str]]:
        agent = [PY, "-m", "workers.agent", "--slots", str(self.slots), "--labels", "rack=r1"]
        return {
            # as make run starts it: controlplane.serve's daphne worker(s) on one socket
            "web": [PY, "-m", "controlplane.serve", "--workers", str(self.web_workers), "-b", self.host,
                    "-p", str(self.port)],
            "control": [PY, "-m", "celery", "-A", "controlplane", "worker", "-Q", "control,control.beat", "-n", "control@%h",
                        "-c", "2", "-l", "INFO", "--without-gossip", "--without-mingle"],
            # notifications (jobs/notify/): their own worker, so a hung webhook receiver never holds a tick's slot
            "notify": [PY, "-m", "celery", "-A", "controlplane", "worker", "-Q", "control.notify", "-n", "notify@%h",
                       "-c", "2", "-l", "INFO", "--without-gossip", "--without-mingle"],
            "beat": [PY, "-m", "celery", "-A", "controlplane", "beat", "-l", "INFO",
                     "-s", str(self.dir / "celerybeat-schedule")],
            "relay": [PY, "manage.py", "relay"],
            **{name: agent + ["--name", name, "--address", addr, "--credential-file",
                              str(self.dir / "credentials" / name)] for name, addr in self.node_addresses.items()},
        }

    def start_proc(self, name: str) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "ab")
        env = dict(self.env, REDIS_URL=self.redis.user_url(name)) if name.startswith("node-") else self.env
        proc = subprocess.Popen(self.commands()[name], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def kill_proc(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(30)

    def start(self) -> "Cluster":
        Cluster._live.add(self)
        self.redis.start()
        self.env["REDIS_URL"] = self.redis.url
        for d in ("var", "data", "agents", "ckpt"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        self.token = self.prepare_database()
        for name in self.commands():
            self.start_proc(name)
        self.wait_web()
        self.wait_for(lambda: {n["name"] for n in self.get("/api/v1/nodes/")["results"]
                               if n["status"] == "READY"} == {"node-a", "node-b"}, 90, "both agents to register")
        return self

    def prepare_database(self) -> str:
        """Migrate, the admin, and the two agents registered by staff like any node (issue 16):
        node_add writes each credential 0600 under credentials/. Returns the admin's API token.
        One process runs the management commands (tests/integration/prepare.py)."""
        nodes = [f"{name}={addr}={self.dir / 'credentials' / name}" for name, addr in self.node_addresses.items()]
        out = subprocess.run([PY, "-m", "tests.integration.prepare", *nodes, "--slots", str(self.slots)],
                             cwd=REPO, env=self.env, check=True, capture_output=True, text=True)
        return out.stdout.strip()

    def stop(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.terminate()
        Cluster._live.discard(self)
        keep = {self.redis.proc.pid} if self.redis.proc else set()
        keep |= postgres.session_server_pids()  # the session's PostgreSQL server outlives every cluster
        for other in Cluster._live:  # a cluster shared by a package (tests/browser) outlives this module's
            keep |= other.pids()
        keep |= self.outliving_pids()
        children = [p for p in psutil.Process().children(recursive=True) if p.pid not in keep]
        _, alive = psutil.wait_procs(children, timeout=10)
        for p in alive:
            print(f"cluster.stop: {p.pid} {p.name()} ignored SIGTERM for 10 s; killing it")
            try:
                p.kill()
            except psutil.Error:
                pass
        # Attempts run in their own sessions; make sure nothing of this cluster outlives it.
        for p in psutil.process_iter(["cmdline"]):
            if any(str(self.dir) in part for part in (p.info["cmdline"] or [])):
                try:
                    p.kill()
                except psutil.Error:
                    pass
        self.redis.stop()

    def outliving_pids(self) -> set[int]:
        """Processes started under this test that outlive this cluster and are stopped by their own
        fixture (a Slurm cluster's daemons and what they run: tests/integration/test_slurm_jobs.py)."""
        return set()

    def launch_payloads(self, attempt_id: int) -> dict[str, dict]:
        """node -> the Launch the control plane sends for this attempt (its sealed secrets included),
        from the database, as jobs.attempts.services.launch.launch_resend builds it."""
        code = ("import json, django; django.setup()\n"
                "from jobs.models import Attempt\n"
                "from jobs.attempts.services.launch import launch_payload\n"
                f"a = Attempt.objects.select_related('job').get(pk={int(attempt_id)})\n"
                "allocs = list(a.allocations.select_related('node').order_by('node_rank'))\n"
                "print(json.dumps({x.node.name: launch_payload(a.job, a, x, rdzv_host=allocs[0].node.address, "
                "nnodes=len(allocs), local_addr=x.node.address) for x in allocs}))")
        out = subprocess.run([PY, "-c", code], cwd=REPO, env=self.env, check=True, capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def pids(self) -> set[int]:
        """This cluster's Redis and processes, with their descendants."""
        roots = [p.pid for p in self.procs.values()] + ([self.redis.proc.pid] if self.redis.proc else [])
        pids = set(roots)
        for pid in roots:
            try:
                pids |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
            except psutil.Error:
                pass
        return pids

    def logs(self, tail: int = 60, first: str = "") -> str:
        """The last lines of every process's log: `first`'s (the process a failure waited on), then
        the agents' and the relay's (a failure's report is cut in the middle when long), beat's
        ticks last and shorter."""
        def order(f: Path) -> tuple[int, str]:
            if f.name == first:
                return (-1, f.name)
            return ({"beat.log": 3, "web.log": 2, "control.log": 1}.get(f.name, 0), f.name)

        out = []
        for f in sorted(self.dir.glob("*.log"), key=order):
            lines = f.read_text(errors="replace").splitlines()[-(10 if f.name == "beat.log" else tail):]
            out.append(f"==== {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def job_state(self, job_id: int) -> str:
        """One job as a failure report wants it: status and why, each attempt's outcome and failure,
        the last events."""
        try:
            j = self.job(job_id)
            events = self.get(f"/api/v1/jobs/{job_id}/events/?page_size=200")
        except Exception as exc:  # the web server may be what is broken
            return f"job {job_id}: unreadable ({exc!r})"
        rows = events.get("results", events) if isinstance(events, dict) else events
        attempts = [(a.get("number"), a.get("status"), a.get("outcome"), (a.get("failure") or {}).get("message"),
                     [(r.get("node"), r.get("pid")) for r in a.get("ranks", [])]) for a in j.get("attempts", [])]
        lines = [f"job {job_id}: {j.get('status')} ({j.get('status_reason')!r}) step {j.get('step')}",
                 f"attempts: {attempts}"]
        lines += [f"  {e.get('created_at')} {e.get('kind')}: {str(e.get('message'))[:300]}" for e in rows[-15:]]
        return "\n".join(lines)

    # ------------------------------------------------------------ HTTP
    def request(self, method: str, path: str, body=None, token: str | None = None) -> tuple[int, dict | list]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://{self.host}:{self.port}{path}", data=data, method=method, headers={
            "Authorization": f"Token {token or self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def get(self, path: str):
        status, body = self.request("GET", path)
        assert status == 200, (path, status, body)
        return body

    def api_ok(self, path: str) -> bool:
        try:
            return self.request("GET", path)[0] == 200
        except OSError:
            return False

    def submit(self, spec: dict) -> dict:
        status, body = self.request("POST", "/api/v1/jobs/", spec)
        assert status == 201, body
        return body

    def job(self, job_id: int) -> dict:
        return self.get(f"/api/v1/jobs/{job_id}/")

    def metrics(self, job_id: int) -> list[dict]:
        return self.get(f"/api/v1/jobs/{job_id}/metrics/?per_rank=1&limit=10000")  # every rank's samples

    def wait_web(self, timeout_s: float = 90, what: str = "web server") -> None:
        """Until the API answers. The launcher (controlplane.serve) binds the port chosen when the
        cluster was made; if something took that port meanwhile (it was free, not held), the
        launcher says "cannot listen on" and exits 2: then a fresh port, up to twice. A web server
        that exits otherwise fails here at once, its own log first."""
        deadline, moves = time.monotonic() + timeout_s, 0
        while time.monotonic() < deadline:
            if self.api_ok("/api/v1/nodes/"):
                return
            web = self.procs.get("web")
            if web is not None and web.poll() is not None:
                last = ((self.dir / "web.log").read_text(errors="replace").splitlines() or [""])[-1]
                if "cannot listen on" in last and moves < 2:
                    moves += 1
                    self.port = free_port()
                    self.start_proc("web")
                    continue
                raise AssertionError(f"the web server exited with {web.returncode} before it answered\n"
                                     f"{self.logs(first='web.log')}")
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.logs(first='web.log')}")

    def wait_for(self, cond, timeout_s: float, what: str, interval_s: float = 0.2, job_id: int | None = None):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            time.sleep(interval_s)
        state = self.job_state(job_id) + "\n" if job_id is not None else ""
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{state}{self.logs()}")

    def wait_status(self, job_id: int, statuses: set[str], timeout_s: float = 240) -> dict:
        return self.wait_for(lambda: (j := self.job(job_id))["status"] in statuses and j, timeout_s,
                             f"job {job_id} to reach {statuses}", job_id=job_id)

    def wait_running_ranks(self, job_id: int, world: int, timeout_s: float = 120) -> dict:
        def ready():
            j = self.job(job_id)
            if j["status"] in {"SUCCEEDED", "FAILED", "CANCELLED"}:  # it will never be RUNNING again
                raise AssertionError(f"job {job_id} ended before it was seen running with {world} ranks "
                                     f"(a test job too short for a loaded machine?)\n{self.job_state(job_id)}")
            att = j["attempts"][-1] if j["attempts"] else None
            return j["status"] == "RUNNING" and att and len(att["ranks"]) == world and j
        return self.wait_for(ready, timeout_s, f"job {job_id} running with {world} ranks", job_id=job_id)


def attempt_processes(attempt_id: int) -> list[psutil.Process]:
    """torchrun, its wrapper and the ranks of one attempt, found by the rendezvous id on their command line."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if f"attempt-{attempt_id}" in cmd or any(f"attempt-{attempt_id}/" in c for c in cmd):
            out.append(p)
    return out
