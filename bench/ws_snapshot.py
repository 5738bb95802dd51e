"""Websocket connect-to-snapshot time of a job page (issue 26), through a real daphne serving
controlplane.asgi and a websocket client (token auth, as bench/telemetry.py's clients). Prints one JSON
object. Not run in CI.

    python bench/ws_snapshot.py                     # 1,024 ranks x 100,000 steps (~2-3 min to generate)
    python bench/ws_snapshot.py --steps 20000       # quicker

The simulated job: `--steps` MetricStep rows (every standard field but compression_ratio and share reduced
over `--ranks` ranks, one rank the slowest most of the time, a user metric) and the per-rank MetricSample
rows of the last `--rank-window` steps (what retention keeps), written with executemany into a fresh
SQLite database migrated by Django (the relay's own writes are not what is measured).

Measured, `--connects` times (the old path `--old-connects`), p50/p99: `total_ms` from opening the socket to the last frame of
the snapshot (the client pings after the snapshot; the server answers after every chunk of it), and
`first_frame_ms` to the snapshot frame itself.
- `reduced`: today's snapshot (jobs/telemetry/payloads.py chart_telemetry: the reduced steps bucketed to
  ~1,500 points, the named ranks and their recent samples). Goal: total p50 under 300 ms.
- `old_metric_window`: the snapshot before issue 26 (metric_window: every rank at each chosen step,
  4,000 rows), served by a second daphne on bench/ws_snapshot_old.py, over the same job; it reads
  only the per-rank rows, i.e. 1,024 ranks x 2,000 steps (it cannot read further back: those rows are
  gone), and its 4,000 rows hold ~3 steps of 1,024 ranks.
Also the in-process time of each snapshot's database reads (`db_ms`) and the frames' size.
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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PY = sys.executable


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(round(q * (len(s) - 1))))], 1)


def wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def fill(ranks: int, steps: int, window: int) -> dict:
    """The job, its attempt and its telemetry; returns ids and what was written."""
    from django.contrib.auth import get_user_model
    from django.db import connection, transaction
    from django.utils import timezone

    from jobs.models import Attempt, Job, MetricSample, MetricStep
    from jobs.models.telemetry import RANKED_FIELDS, REDUCED_FIELDS

    admin = get_user_model().objects.get(username="admin")
    job = Job.objects.create(name="ws-bench", owner=admin, spec={"name": "ws-bench"}, plan={}, slots=ranks,
                             status=Job.Status.RUNNING)
    # running, at its last step and making progress: the job JSON's health reads the recent per-rank rows
    attempt = Attempt.objects.create(job=job, number=1, status=Attempt.Status.RUNNING, last_step=steps - 1,
                                     last_progress_at=timezone.now())
    Job.objects.filter(pk=job.pk).update(step=steps - 1)
    rnd = random.Random(0)
    slow, fast = 717, 3
    reported = [f for f in REDUCED_FIELDS if f not in ("compression_ratio", "share")]
    cols = ["job_id", "attempt_id", "step", "ts", "ranks", "extra", "extra_rank"]
    for f in REDUCED_FIELDS:
        cols += [f"{f}_n", f"{f}_min", f"{f}_mean", f"{f}_max"]
    for f in RANKED_FIELDS:
        cols += [f"{f}_min_rank", f"{f}_max_rank"]
    sql = (f"INSERT INTO {MetricStep._meta.db_table} ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))})")
    t0 = time.time() - steps
    started = time.monotonic()
    with transaction.atomic(), connection.cursor() as cur:
        batch = []
        for step in range(steps):
            loss = 4.0 - 3.0 * step / steps
            row = [job.pk, attempt.pk, step, t0 + step, ranks, json.dumps({"acc": step / steps}), 0]
            for f in REDUCED_FIELDS:
                if f not in reported:
                    row += [0, None, None, None]
                elif f == "loss":
                    row += [ranks, loss - 0.2, loss, loss + 0.2 + (5.0 if step % 9973 == 0 else 0.0)]
                elif f == "step_s":
                    row += [ranks, 0.18, 0.2, 0.3 + rnd.random() * 0.05]
                else:
                    v = rnd.uniform(1, 2)
                    row += [ranks, v * 0.9, v, v * 1.1]
            for _f in RANKED_FIELDS:
                row += [fast if rnd.random() < 0.6 else rnd.randrange(ranks),
                        slow if rnd.random() < 0.6 else rnd.randrange(ranks)]
            batch.append(row)
            if len(batch) == 5000:
                cur.executemany(sql, batch)
                batch = []
        cur.executemany(sql, batch)
    step_rows_s = time.monotonic() - started
    say(f"{steps} MetricStep rows in {step_rows_s:.0f} s")
    started = time.monotonic()
    table = MetricSample._meta.db_table
    scols = ("job_id", "attempt_id", "rank", "step", "ts", "loss", "samples_per_s", "tokens_per_s", "step_s",
             "data_s", "compute_s", "comm_s", "optim_s", "bytes_sent", "mem_bytes")
    ssql = f"INSERT INTO {table} ({', '.join(scols)}) VALUES ({', '.join(['%s'] * len(scols))})"
    with transaction.atomic(), connection.cursor() as cur:
        for step in range(steps - window, steps):
            loss = 4.0 - 3.0 * step / steps
            cur.executemany(ssql, [(job.pk, attempt.pk, r, step, t0 + step, loss, 16.0, 2048.0,
                                    0.3 if r == slow else 0.2, 0.01, 0.12, 0.05, 0.02, 1 << 20, 1 << 30)
                                   for r in range(ranks)])
    say(f"{window * ranks} MetricSample rows in {time.monotonic() - started:.0f} s")
    return {"job": job.pk, "attempt": attempt.pk, "generate_s": round(time.monotonic() - started + step_rows_s, 1)}


async def connect_once(port: int, token: str, job: int) -> dict:
    from websockets.asyncio.client import connect

    t0 = time.perf_counter()
    frames, size, first = 0, 0, None
    async with connect(f"ws://127.0.0.1:{port}/ws/jobs/{job}/", additional_headers={"Authorization": f"Token {token}"},
                       max_size=None, compression=None, open_timeout=60) as ws:
        async for raw in ws:
            msg = json.loads(raw)
            if msg.get("type") == "pong":
                break
            frames += 1
            size += len(raw)
            if msg.get("type") == "snapshot":
                first = (time.perf_counter() - t0) * 1000
                await ws.send(json.dumps({"type": "ping"}))  # answered after the snapshot's last chunk
            if "seq" in msg:
                await ws.send(json.dumps({"type": "ack", "seq": msg["seq"]}))
    return {"total_ms": (time.perf_counter() - t0) * 1000, "first_frame_ms": first, "frames": frames, "bytes": size}


def measure(port: int, token: str, job: int, n: int) -> dict:
    asyncio.run(connect_once(port, token, job))  # warm: imports, the first connection
    runs = [asyncio.run(connect_once(port, token, job)) for _ in range(n)]
    total = [r["total_ms"] for r in runs]
    first = [r["first_frame_ms"] for r in runs]
    return {"total_p50_ms": pct(total, 0.5), "total_p99_ms": pct(total, 0.99), "total_mean_ms": round(statistics.fmean(total), 1),
            "first_frame_p50_ms": pct(first, 0.5), "first_frame_p99_ms": pct(first, 0.99),
            "frames": runs[-1]["frames"], "bytes": runs[-1]["bytes"], "connects": n}


def db_times(job: int) -> dict:
    """Each snapshot's database reads alone, in this process (median of 5; the old one of 2)."""
    from jobs.runs import payloads as runs_payloads
    from jobs.telemetry import payloads as telemetry_payloads

    def timed(fn, n: int = 5) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1000)
        return round(statistics.median(ts), 1)

    charts = telemetry_payloads.chart_telemetry(job)
    old_rows, _ = telemetry_payloads.metric_window(job, max_points=4000)
    return {
        # chart_telemetry: the charts' reads; job_snapshot: the whole first frame's (the job JSON's health
        # reads the last 20 steps' per-rank rows: jobs/attempts/selectors.py attempt_recent_samples)
        "reduced": {"db_ms": timed(lambda: telemetry_payloads.chart_telemetry(job)),
                    "job_snapshot_db_ms": timed(lambda: runs_payloads.job_snapshot(job)),
                    "points": len(charts["steps"]), "named_samples": len(charts["samples"]),
                    "named": [x["rank"] for x in charts["named"]["slowest"]]},
        "old": {"db_ms": timed(lambda: telemetry_payloads.metric_window(job, max_points=4000), 2),
                "rows": len(old_rows), "steps_charted": len({r["step"] for r in old_rows})},
    }


def start_daphnes(procs: dict, workdir: Path) -> dict[str, int]:
    """daphne on controlplane.asgi (reduced) and on bench/ws_snapshot_old.py (old); their ports."""
    ports = {"reduced": free_port(), "old": free_port()}
    for name, app in (("reduced", "controlplane.asgi:application"), ("old", "bench.ws_snapshot_old:application")):
        procs[name] = subprocess.Popen([PY, "-m", "daphne", "-b", "127.0.0.1", "-p", str(ports[name]), app], cwd=REPO,
                                       env={**os.environ}, stdout=open(workdir / f"daphne-{name}.log", "ab"),
                                       stderr=subprocess.STDOUT)

    def up(port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    for name, port in ports.items():
        wait(lambda port=port: up(port), 60, f"daphne ({name})")
    return ports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--rank-window", type=int, default=2000, help="steps of per-rank samples kept")
    ap.add_argument("--connects", type=int, default=20)
    ap.add_argument("--old-connects", type=int, default=5, help="connects of the old path (seconds each at 1,024 ranks)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="trainyard-ws-bench-"))
    env = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "DJANGO_SETTINGS_MODULE": "controlplane.settings",
           "TRAINYARD_VAR_DIR": str(workdir / "var"), "TRAINYARD_DB": str(workdir / "db.sqlite3"),
           "TRAINYARD_DATA_ROOT": str(workdir / "data"), "TRAINYARD_ADMIN_PASSWORD": "bench-pw-1",
           "DJANGO_SECRET_KEY": "bench-only", "TRAINYARD_LOG_LEVEL": "WARNING", "DATABASE_URL": "",
           "TRAINYARD_MAX_SOCKETS_PER_USER": "0", "TRAINYARD_THROTTLE_USER": "1000000/min"}
    for d in ("var", "data", "redis"):
        (workdir / d).mkdir()
    procs: dict[str, subprocess.Popen] = {}
    try:
        exe = shutil.which("redis-server")
        if exe is None:
            sys.exit("redis-server is not installed (make deps)")
        rport = free_port()
        procs["redis"] = subprocess.Popen([exe, "--port", str(rport), "--bind", "127.0.0.1", "--dir", str(workdir / "redis"),
                                           "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
        env["REDIS_URL"] = f"redis://127.0.0.1:{rport}/0"
        os.environ.update(env)
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection

        call_command("migrate", verbosity=0)
        subprocess.run([PY, "manage.py", "ensure_admin"], cwd=REPO, env={**os.environ}, check=True, capture_output=True)
        token = subprocess.run([PY, "manage.py", "api_token", "admin"], cwd=REPO, env={**os.environ}, check=True,
                               capture_output=True, text=True).stdout.strip().splitlines()[-1]
        say(f"generating {args.steps} steps of {args.ranks} ranks in {workdir}")
        ids = fill(args.ranks, args.steps, args.rank_window)
        with connection.cursor() as cur:
            cur.execute("ANALYZE")

        db = db_times(ids["job"])
        connection.close()

        ports = start_daphnes(procs, workdir)
        say("measuring")
        reduced = measure(ports["reduced"], token, ids["job"], args.connects)
        old = measure(ports["old"], token, ids["job"], args.old_connects)
        print(json.dumps({
            "bench": "ws_snapshot", "db": "sqlite", "ranks": args.ranks, "steps": args.steps,
            "rank_window_steps": args.rank_window, "generate_s": ids["generate_s"], "goal_total_p50_ms": 300,
            "reduced": {**reduced, **db["reduced"]},
            "old_metric_window": {**old, "label": f"before issue 26: metric_window over per-rank rows "
                                                  f"({args.ranks} ranks x {args.rank_window} steps)", **db["old"]},
        }))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
