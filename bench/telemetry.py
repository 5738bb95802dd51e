"""Live telemetry path, end to end with real processes: rank -> Redis Stream -> relay -> SQLite
(or PostgreSQL with --postgres) + Channels -> daphne -> websocket client.

Everything is real and runs on 127.0.0.1: a redis-server (AOF everysec, as `make run`), the
database migrated by `manage.py migrate`, jobs and attempts created through `jobs.services`
(job_submit, schedule_tick, attempt_ranks: the relay drops samples of unknown attempts), the
relay (`manage.py relay`), daphne serving `controlplane.asgi`, simulated ranks (one process per
rank, each with the runtime's own `trainyard.sdk.reporter.Reporter`, sample `ts` = emit time)
and websocket clients (one process per client, the `websockets` package, token auth, no Origin,
acking every message, as docs/architecture.md section 7 asks non-browser clients to).

Measured, in one run so the figures compare side by side:
- latency: receive time at the websocket client - `ts` at the rank, per sample, at each rate in
  --rates (samples/s in total over all ranks), p50/p90/p99/max. The first --warmup-s of traffic
  (stream discovery, first snapshot) is not in any phase.
- throughput: the relay is paused (SIGSTOP) while a backlog of --drain-samples samples is
  XADDed as fast as one pipelined client can (`raw_xadd_samples_per_s`: the ceiling), then
  resumed; the relay's rate to DB (+ Channels fan-out to the connected clients) is backlog /
  time until every entry is committed and acked (entries are XDELed only after commit).
  Also the rate the relay sustained during the highest latency phase.
- memory: RSS of the relay and daphne sampled over a --mem-s run at --mem-rate samples/s:
  start, end, max and the least-squares slope in MiB/min.

Prints ONE JSON object on stdout; progress goes to stderr. Stops by itself.
    python bench/telemetry.py            # ~14 min on 2 cores (10 min of it the memory run)
    python bench/telemetry.py --quick    # ~2 min: short phases, 40 s memory run
    python bench/telemetry.py --quick --postgres   # + the drain phase on PostgreSQL, and the ratio
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
PY = sys.executable


def say(*args) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(sorted_vals, q: float):
    if not sorted_vals:
        return None
    i = min(len(sorted_vals) - 1, max(0, int(round(q / 100 * (len(sorted_vals) - 1)))))
    return round(sorted_vals[i], 2)


def sample(rank: int, step: int, attempt: int, ts: float) -> dict:
    """The runtime's per-step sample (workers/runtime/trainer.py), plausible values."""
    step_s = 0.04 + random.random() * 0.002
    return {"rank": rank, "step": step, "ts": ts, "loss": 5.5 / (1 + step * 1e-3),
            "samples_per_s": 16 / step_s, "tokens_per_s": 16 * 128 / step_s, "step_s": step_s,
            "data_s": 0.001, "compute_s": step_s - 0.008, "comm_s": 0.006, "optim_s": 0.001,
            "bytes_sent": 1_048_576, "mem_bytes": 512_000_000 + step, "attempt": attempt}


# ------------------------------------------------------------------ role: emitter (one rank)
def run_emitter(args) -> None:
    """One simulated rank. Commands on stdin (one JSON per line), one JSON reply per command."""
    from trainyard.sdk.reporter import Reporter

    rep = Reporter(args.redis, args.stream, rank=args.rank, attempt=args.attempt)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        rate, total, step = cmd["rate"], int(cmd["rate"] * cmd["duration"]), cmd["start_step"]
        sent0 = rep.sent_samples
        t0 = time.time() + max(0.0, cmd.get("start_at", 0) - time.time())
        time.sleep(max(0.0, t0 - time.time()))
        n = 0
        while n < total:  # open loop: emit on schedule whatever the rest of the system does
            due = min(total, int((time.time() - t0) * rate) + 1)
            while n < due:
                rep.metric(sample(args.rank, step + n, args.attempt, time.time()))
                n += 1
            wait = t0 + n / rate - time.time()
            if wait > 0:  # at least 1 ms: a 5k steps/s rank emits ~5 samples a wake (ts still = emit time)
                time.sleep(max(wait, 0.001))
        emit_s = time.time() - t0
        deadline = time.monotonic() + 30
        while (rep.buffered or not rep._inbox.empty()) and time.monotonic() < deadline:
            time.sleep(0.005)
        print(json.dumps({"emitted": n, "sent": rep.sent_samples - sent0, "emit_s": emit_s,
                          "dropped": rep.dropped_samples, "last_step": step + n - 1}), flush=True)
    rep.close()


# ------------------------------------------------------------------ role: websocket client
def run_client(args) -> None:
    asyncio.run(_client(args))


async def _client(args) -> None:
    from websockets.asyncio.client import connect

    loop = asyncio.get_running_loop()
    cmds: asyncio.Queue = asyncio.Queue()

    def read_stdin():
        for line in sys.stdin:
            loop.call_soon_threadsafe(cmds.put_nowait, json.loads(line))
        loop.call_soon_threadsafe(cmds.put_nowait, {"cmd": "quit"})

    threading.Thread(target=read_stdin, daemon=True).start()
    st = {"min_step": 1 << 62, "lat": array("f"), "count": 0, "messages": 0, "windows": 0,
          "window_samples": 0, "errors": 0, "bytes": 0}
    url = f"ws://127.0.0.1:{args.port}/ws/jobs/{args.job}/"
    async with connect(url, additional_headers={"Authorization": f"Token {args.token}"},
                       max_size=None, max_queue=None, compression=None, open_timeout=30) as ws:
        async def receiver():
            async for raw in ws:
                now = time.time()
                msg = json.loads(raw)
                seq = msg.get("seq")
                if seq is not None:
                    await ws.send(json.dumps({"type": "ack", "seq": seq}))
                kind = msg.get("type")
                if kind == "snapshot":
                    print(json.dumps({"ready": True}), flush=True)
                    continue
                st["messages"] += 1
                st["bytes"] += len(raw)
                if kind == "telemetry":
                    lo, lat = st["min_step"], st["lat"]
                    for s in msg["samples"]:
                        if s["step"] >= lo:
                            lat.append((now - s["ts"]) * 1000.0)
                    st["count"] = len(st["lat"])
                elif kind == "window":
                    st["windows"] += 1
                    st["window_samples"] += sum(1 for s in msg["samples"] if s["step"] >= st["min_step"])
                elif kind == "error":
                    st["errors"] += 1

        task = asyncio.create_task(receiver())
        while True:
            cmd = await cmds.get()
            if cmd["cmd"] == "phase":
                st.update(min_step=cmd["min_step"], lat=array("f"), count=0, messages=0, windows=0,
                          window_samples=0, errors=0, bytes=0)
                print(json.dumps({"ok": True}), flush=True)
            elif cmd["cmd"] == "peek":
                print(json.dumps({"count": st["count"], "window_samples": st["window_samples"]}), flush=True)
            elif cmd["cmd"] == "report":
                lat = sorted(st["lat"])
                print(json.dumps({"count": len(lat), "messages": st["messages"], "windows": st["windows"],
                                  "window_samples": st["window_samples"], "errors": st["errors"],
                                  "bytes": st["bytes"], "p50_ms": pct(lat, 50), "p90_ms": pct(lat, 90),
                                  "p99_ms": pct(lat, 99), "max_ms": pct(lat, 100),
                                  "alive": not task.done()}), flush=True)
            elif cmd["cmd"] == "quit":
                task.cancel()
                return


# ------------------------------------------------------------------ orchestration
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


class Bench:
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

    # ---------------------------------------------------------- processes
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
        self.start_proc("relay", [PY, "manage.py", "relay"])
        self.wait(self._web_ok, 60, "daphne")
        say(f"up: redis {self.redis_url}, daphne :{self.port}, jobs {self.jobs}, dir {self.dir}")
        for job in self.jobs:
            for rank in range(self.args.ranks):
                self.emitters.append(Child(f"emitter-{job['job']}-{rank}", [
                    PY, __file__, "--role", "emitter", "--redis", self.redis_url, "--rank", str(rank),
                    "--attempt", str(job["attempt"]), "--stream", f"trainyard:job:{job['job']}"],
                    self.env, self.dir / "emitters.log"))
            for c in range(self.args.clients):
                self.clients.append(Child(f"client-{job['job']}-{c}", [
                    PY, __file__, "--role", "client", "--port", str(self.port), "--token", self.token,
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
                    proc.send_signal(signal.SIGCONT)
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ---------------------------------------------------------- measurements
    def backlog(self) -> int:
        return sum(self.r.xlen(f"trainyard:job:{j['job']}") for j in self.jobs)

    def cpu(self) -> dict:
        """CPU seconds so far: relay, daphne, redis, the simulated ranks and clients together, and
        the whole machine (busy time over all cores): `other` = work that is not this bench's."""
        import psutil

        def used(pid):
            try:
                t = psutil.Process(pid).cpu_times()
                return t.user + t.system
            except psutil.Error:
                return 0.0

        out = {name: used(self.procs[name].pid) for name in ("relay", "daphne", "redis")}
        if self.db_pid:  # the PostgreSQL server and its backends (the relay's among them)
            try:
                server = psutil.Process(self.db_pid)
                out["postgres"] = used(self.db_pid) + sum(used(c.pid) for c in server.children(recursive=True))
            except psutil.Error:
                out["postgres"] = 0.0
        out["ranks"] = sum(used(c.proc.pid) for c in self.emitters)
        out["clients"] = sum(used(c.proc.pid) for c in self.clients)
        me = os.times()
        out["bench"] = me.user + me.system
        m = psutil.cpu_times()
        out["machine"] = m.user + m.nice + m.system + m.irq + m.softirq + m.steal
        return out

    @staticmethod
    def cpu_percent(cpu0: dict, cpu1: dict, wall: float) -> dict:
        """Percent of one core over `wall` s; `other` is what the rest of the machine used."""
        out = {k: round(100 * (cpu1[k] - cpu0[k]) / wall, 1) for k in cpu1}
        ours = sum(v for k, v in out.items() if k != "machine")
        out["other"] = round(max(0.0, out["machine"] - ours), 1)
        return out

    def clients_phase(self, min_step: int) -> None:
        for c in self.clients:
            c.ask({"cmd": "phase", "min_step": min_step})

    def wait_clients(self, expected_per_job: dict[int, int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = True
            for c, job in zip(self.clients, [j for j in self.jobs for _ in range(self.args.clients)]):
                got = c.ask({"cmd": "peek"})
                if got["count"] + got["window_samples"] < expected_per_job[job["job"]]:
                    done = False
            if done:
                return
            time.sleep(0.2)

    def client_reports(self) -> dict:
        reps = [c.ask({"cmd": "report"}) for c in self.clients]
        lat = {}
        # Percentiles over all clients: each client's own percentiles, and the worst of them.
        for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms"):
            vals = [r[key] for r in reps if r[key] is not None]
            lat[key] = max(vals) if vals else None
        return {"worst_client": lat, "clients": reps,
                "received": sum(r["count"] for r in reps),
                "window_messages": sum(r["windows"] for r in reps)}

    def emit(self, rate: float, duration: float, rss_every: float | None = None) -> dict:
        """All ranks emit `rate` samples/s in total for `duration` s, then every client gets
        everything (or 15 s pass). Returns the phase's figures."""
        per_rank = rate / len(self.emitters)
        start_step = self.step
        self.clients_phase(start_step)
        cpu0, t0 = self.cpu(), time.monotonic()
        start_at = time.time() + 0.2
        for e in self.emitters:
            e.send({"cmd": "run", "rate": per_rank, "duration": duration, "start_step": start_step,
                    "start_at": start_at})
        rss: list[tuple[float, float, float]] = []
        backlog_max = 0
        if rss_every:
            rss, backlog_max = self.sample_rss(duration + 0.2, rss_every)
        else:
            end = time.monotonic() + duration + 0.2
            while time.monotonic() < end:
                backlog_max = max(backlog_max, self.backlog())
                time.sleep(0.25)
        results = [e.recv() for e in self.emitters]
        t_emitted = time.monotonic()
        backlog_end = self.backlog()
        self.wait(lambda: self.backlog() == 0, 120, "relay to drain")
        t_drained = time.monotonic()
        self.step = max(r["last_step"] for r in results) + 1
        sent_per_job = {}
        for e, r in zip(self.emitters, results):
            job = int(e.name.split("-")[1])
            sent_per_job[job] = sent_per_job.get(job, 0) + r["sent"]
        self.wait_clients(sent_per_job, 15)
        cpu1 = self.cpu()
        wall = time.monotonic() - t0
        sent = sum(r["sent"] for r in results)
        out = {
            "target_samples_per_s": rate, "duration_s": duration,
            "emitted_samples_per_s": round(sent / max(r["emit_s"] for r in results), 1),
            "sent": sent, "dropped_at_reporter": sum(r["dropped"] for r in results),
            "backlog_entries_max": backlog_max, "backlog_entries_at_end": backlog_end,
            "drain_after_emit_s": round(t_drained - t_emitted, 2),
            "cpu_percent": self.cpu_percent(cpu0, cpu1, wall),
        }
        out.update(self.client_reports())
        out["received_fraction"] = round(out["received"] / (sent * self.args.clients), 4) if sent else None
        if rss:
            out["rss"] = rss
        return out

    def sample_rss(self, duration: float, every: float) -> list:
        import psutil

        procs = {n: psutil.Process(self.procs[n].pid) for n in ("relay", "daphne")}
        t0 = time.monotonic()
        out, backlog_max, next_rss = [], 0, 0.0
        while True:  # RSS every `every` s, the relay's backlog every 0.5 s
            now = time.monotonic() - t0
            backlog_max = max(backlog_max, self.backlog())
            if now >= next_rss or now >= duration:
                out.append((round(now, 1), *(round(p.memory_info().rss / 2**20, 2) for p in procs.values())))
                next_rss += every
            if now >= duration:
                return out, backlog_max
            time.sleep(min(0.5, max(0.05, duration - now)))

    def throughput(self, n_samples: int, entry_samples: int) -> dict:
        """Pause the relay, XADD a backlog as fast as possible (the ceiling), resume, time the drain."""
        relay = self.procs["relay"]
        per_stream = n_samples // len(self.jobs)
        start_step = self.step
        self.clients_phase(start_step)
        relay.send_signal(signal.SIGSTOP)
        try:
            # Payloads are serialised up front: this measures Redis taking entries, not json.dumps.
            payloads = []
            for job in self.jobs:
                entries = []
                steps_per_rank = per_stream // self.args.ranks
                for base in range(0, steps_per_rank, entry_samples):
                    for rank in range(self.args.ranks):
                        batch = [sample(rank, start_step + base + k, job["attempt"], time.time())
                                 for k in range(min(entry_samples, steps_per_rank - base))]
                        entries.append(json.dumps(batch, separators=(",", ":")))
                payloads.append((f"trainyard:job:{job['job']}", entries))
            total = sum(len(e) for _, e in payloads) * entry_samples
            t0 = time.perf_counter()
            pipe = self.r.pipeline(transaction=False)
            queued = 0
            for stream, entries in payloads:
                for data in entries:
                    pipe.xadd(stream, {"type": "metrics", "data": data})
                    queued += 1
                    if queued % 200 == 0:
                        pipe.execute()
            pipe.execute()
            xadd_s = time.perf_counter() - t0
        finally:
            cpu0 = self.cpu()
            t1 = time.monotonic()
            relay.send_signal(signal.SIGCONT)
        entries_total = self.backlog()
        self.wait(lambda: self.backlog() == 0, 600, "relay to drain the backlog")
        drain_s = time.monotonic() - t1
        cpu1 = self.cpu()
        self.step = start_step + per_stream // self.args.ranks + 1
        expected = {j["job"]: total // len(self.jobs) for j in self.jobs}
        self.wait_clients(expected, 30)
        ws_s = time.monotonic() - t1
        out = {
            "backlog_samples": total, "backlog_entries": entries_total, "samples_per_entry": entry_samples,
            "raw_xadd_samples_per_s": round(total / xadd_s), "raw_xadd_entries_per_s": round(entries_total / xadd_s),
            "relay_drain_s": round(drain_s, 2), "relay_samples_per_s": round(total / drain_s),
            "all_clients_done_s": round(ws_s, 2),
            "cpu_percent": self.cpu_percent(cpu0, cpu1, drain_s),
        }
        reps = self.client_reports()
        out["client_received_live"] = reps["received"]
        out["client_received_in_windows"] = sum(c["window_samples"] for c in reps["clients"])
        out["client_window_messages"] = reps["window_messages"]
        out["relay_vs_ceiling"] = round(out["relay_samples_per_s"] / out["raw_xadd_samples_per_s"], 3)
        return out


def slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points) or 1.0
    return round(60 * sum((p[0] - mx) * (p[1] - my) for p in points) / sxx, 3)


def memory_summary(rss: list) -> dict:
    out = {}
    for i, name in ((1, "relay"), (2, "daphne")):
        pts = [(p[0], p[i]) for p in rss]
        half = [q for q in pts if q[0] >= pts[-1][0] / 2]
        out[name] = {"start_rss_mib": pts[0][1], "end_rss_mib": pts[-1][1], "max_rss_mib": max(q[1] for q in pts),
                     "slope_mib_per_min": slope_mib_per_min(pts),
                     "slope_second_half_mib_per_min": slope_mib_per_min(half)}
    step = max(1, len(rss) // 20)
    out["series_s_relay_daphne_mib"] = rss[::step] + ([rss[-1]] if (len(rss) - 1) % step else [])
    return out


def postgres_drain(args, sqlite: dict | None) -> dict:
    """The throughput (drain) phase again, on a real PostgreSQL server (tests/postgres.py: Debian's
    server in a temporary directory, fsync off as in the tests, so the figure is the relay's and
    the database's CPU, not the disk's), next to SQLite's figure and the ratio."""
    from tests.postgres import PostgresServer, postgres_bin_dir

    server = PostgresServer().start()
    try:
        url = server.create_database("bench")
        bench = Bench(args, db_env={"DATABASE_URL": url}, db_pid=server.proc.pid)
        try:
            bench.start()
            bench.emit(1000, args.warmup_s)
            say(f"throughput on PostgreSQL: backlog of {args.drain_samples} samples")
            pg = bench.throughput(args.drain_samples, args.entry_samples)
            say(f"  {pg}")
        finally:
            bench.stop()
    finally:
        server.stop()
    out = {"server": str(postgres_bin_dir()), "settings": "fsync=off synchronous_commit=off", "throughput": pg}
    if sqlite:
        out["relay_samples_per_s"] = {"sqlite": sqlite["relay_samples_per_s"], "postgres": pg["relay_samples_per_s"]}
        out["postgres_vs_sqlite"] = round(pg["relay_samples_per_s"] / sqlite["relay_samples_per_s"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~2 min: 8 s phases, 40 s memory run, smaller backlog")
    ap.add_argument("--rates", default="1000,5000,20000", help="total samples/s of the latency phases")
    ap.add_argument("--phase-s", type=float, help="seconds per latency phase (30; quick: 8)")
    ap.add_argument("--mem-s", type=float, help="seconds of the memory run (600; quick: 40)")
    ap.add_argument("--mem-rate", type=float, default=5000)
    ap.add_argument("--drain-samples", type=int, help="backlog for the throughput run (600000; quick: 200000)")
    ap.add_argument("--entry-samples", type=int, default=10,
                    help="samples per stream entry in the backlog (a rank at 1k steps/s, flushing every 10 ms)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="simulated ranks per job (one process each)")
    ap.add_argument("--clients", type=int, default=1, help="websocket clients per job (one process each)")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--skip", default="", help="comma list of phases to skip: latency,throughput,memory")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, database)")
    ap.add_argument("--postgres", action="store_true",
                    help="then the throughput phase again on a real PostgreSQL server (Debian's postgresql), "
                         "with both relay rates and their ratio")
    # internal roles
    ap.add_argument("--role", choices=["emitter", "client"])
    ap.add_argument("--redis")
    ap.add_argument("--stream")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--attempt", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--token")
    ap.add_argument("--job", type=int)
    args = ap.parse_args()
    if args.role == "emitter":
        return run_emitter(args)
    if args.role == "client":
        return run_client(args)

    args.phase_s = args.phase_s or (8.0 if args.quick else 30.0)
    args.mem_s = args.mem_s or (40.0 if args.quick else 600.0)
    args.drain_samples = args.drain_samples or (200_000 if args.quick else 600_000)
    skip = set(filter(None, args.skip.split(",")))
    t_start = time.monotonic()
    bench = Bench(args)
    result: dict = {"bench": "telemetry", "quick": args.quick, "cores": os.cpu_count(),
                    "loadavg_before": [round(x, 2) for x in os.getloadavg()],
                    "config": {"jobs": args.jobs, "ranks_per_job": args.ranks, "clients_per_job": args.clients,
                               "phase_s": args.phase_s, "mem_s": args.mem_s, "mem_rate": args.mem_rate,
                               "drain_samples": args.drain_samples, "entry_samples": args.entry_samples,
                               "warmup_s": args.warmup_s}}
    try:
        bench.start()
        say(f"warm-up {args.warmup_s} s at 1000 samples/s")
        bench.emit(1000, args.warmup_s)
        if "latency" not in skip:
            result["latency"] = {}
            for rate in [float(x) for x in args.rates.split(",")]:
                say(f"latency phase: {rate:.0f} samples/s for {args.phase_s} s")
                ph = bench.emit(rate, args.phase_s)
                result["latency"][str(int(rate))] = ph
                say(f"  p50 {ph['worst_client']['p50_ms']} ms p99 {ph['worst_client']['p99_ms']} ms, "
                    f"received {ph['received_fraction']}, cpu {ph['cpu_percent']}")
        if "throughput" not in skip:
            say(f"throughput: backlog of {args.drain_samples} samples")
            result["throughput"] = bench.throughput(args.drain_samples, args.entry_samples)
            say(f"  {result['throughput']}")
        if "memory" not in skip:
            say(f"memory run: {args.mem_rate:.0f} samples/s for {args.mem_s} s")
            ph = bench.emit(args.mem_rate, args.mem_s, rss_every=max(1.0, args.mem_s / 120))
            rss = ph.pop("rss")
            result["memory"] = memory_summary(rss) | {"phase": ph}
            say(f"  relay {result['memory']['relay']} daphne {result['memory']['daphne']}")
    finally:
        bench.stop()
    if args.postgres:
        result["postgres"] = postgres_drain(args, result.get("throughput"))
        say(f"  relay on PostgreSQL vs SQLite: {result['postgres'].get('relay_samples_per_s')}")
    lat = result.get("latency", {})
    targets = {}
    if "1000" in lat:
        targets["p99_1k_le_100ms"] = (lat["1000"]["worst_client"]["p99_ms"] or 1e9) <= 100
    if "20000" in lat:
        targets["p99_20k_le_250ms"] = (lat["20000"]["worst_client"]["p99_ms"] or 1e9) <= 250
        targets["sustained_20k_received_all"] = lat["20000"]["received_fraction"] == 1.0
    if "throughput" in result:
        targets["relay_ge_20k_per_s"] = result["throughput"]["relay_samples_per_s"] >= 20_000
    result["targets_met"] = targets
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
