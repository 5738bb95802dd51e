"""The relay in this process under cProfile, draining the backlog bench/telemetry.py's throughput phase
writes: where its time goes per sample, without daphne, ranks or clients competing for the cores.

A redis-server and the database (SQLite in a temporary directory, or --postgres: Debian's server as in
the tests) are set up as bench/telemetry_stack.py does (migrate, jobs and attempts through
jobs.services); the backlog is XADDed first, then `Relay.step()` runs until every entry is
committed and acknowledged, with the real ChannelsPublisher (no socket listens: group_send to an
empty group). Prints the drain rate, the raw XADD rate of the same backlog and the top functions.

    python bench/relay_profile.py [--postgres] [--ranks 2] [--samples 200000] [--top 30] [--no-profile]
                                  [--batch 500] [--ended]

--ended: the jobs' attempts end before the backlog is written (a relay working through the streams
of attempts that ended while it was behind or down: each round's samples go into the ended attempt's
knowledge record). Drains the same backlog twice, side by side on two sets of jobs, without the
profiler: rewriting the records after every round (as the relay did) and at most every
LATE_REFRESH_S (as it does); prints both and the ratio.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _path in (str(REPO), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from telemetry_roles import sample  # noqa: E402
from telemetry_stack import SETUP, free_port  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--postgres", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="ranks per job in the backlog (the jobs have 2, as the bench's)")
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--entry-samples", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--sort", default="tottime")
    ap.add_argument("--no-profile", action="store_true", help="time the drain only")
    ap.add_argument("--dump", help="write the cProfile stats to this file (pstats)")
    ap.add_argument("--batch", type=int, default=500, help="entries a stream per round (the relay's own default: 32)")
    ap.add_argument("--ended", action="store_true", help="the attempts end first: late samples, twice (see above)")
    ap.add_argument("--gc", default="relay", choices=["relay", "auto", "off"],
                    help="relay: collections between rounds as run_forever does (RoundCollector); auto: Python's "
                         "own; off: none")
    return ap.parse_args()


def setup(args, work: Path, procs: list) -> tuple[dict, list[dict]]:
    """A redis-server, the database migrated, the jobs: (the environment, the jobs' ids)."""
    rport = free_port()
    procs.append(subprocess.Popen([shutil.which("redis-server"), "--port", str(rport), "--bind", "127.0.0.1",
                                   "--dir", str(work), "--save", "", "--appendonly", "yes",
                                   "--appendfsync", "everysec"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    env = {"PYTHONPATH": str(REPO), "DJANGO_SETTINGS_MODULE": "controlplane.settings",
           "TRAINYARD_VAR_DIR": str(work / "var"), "TRAINYARD_DB": str(work / "db.sqlite3"),
           "TRAINYARD_DATA_ROOT": str(work / "data"), "TRAINYARD_ADMIN_PASSWORD": "bench-pw-1",
           "DJANGO_SECRET_KEY": "bench-only", "TRAINYARD_LOG_LEVEL": "WARNING", "DATABASE_URL": "",
           "REDIS_URL": f"redis://127.0.0.1:{rport}/0",
           "TRAINYARD_KEPT_LOG_ROOT": str(work / "keptlogs")}
    if args.postgres:
        from tests.postgres import PostgresServer

        server = PostgresServer().start()
        procs.append(server)
        env["DATABASE_URL"] = server.create_database("prof")
    os.environ.update(env)
    for d in ("var", "data"):
        (work / d).mkdir(exist_ok=True)
    py = sys.executable
    for argv in (["migrate", "--noinput", "-v", "0"], ["ensure_admin"]):
        subprocess.run([py, "manage.py", *argv], cwd=REPO, env=os.environ, check=True, capture_output=True)
    jobs = args.jobs * (2 if args.ended else 1)
    out = subprocess.run([py, "-c", SETUP, str(jobs), "2"], cwd=REPO, env=os.environ,
                         check=True, capture_output=True, text=True).stdout
    return env, json.loads(out.strip().splitlines()[-1])


def backlog(args, jobs: list[dict]) -> list[tuple[str, list[str]]]:
    """(stream, entries' JSON) per job: --samples samples over --ranks ranks, --entry-samples an entry."""
    from trainyard import keys

    payloads = []
    per_stream = args.samples // args.jobs
    for job in jobs:
        entries = []
        for base in range(1, per_stream // args.ranks + 1, args.entry_samples):
            for rank in range(args.ranks):
                batch = [sample(rank, base + k, job["attempt"], time.time()) for k in range(args.entry_samples)]
                entries.append(json.dumps(batch, separators=(",", ":")))
        payloads.append((keys.attempt_stream(job["job"], job["attempt"]), entries))
    return payloads


def end_attempts(jobs: list[dict]) -> None:
    """Each job's attempt ends (the node reports the ranks' exit 0), as if before the relay caught up."""
    from jobs import services
    from jobs.models import Attempt

    for job in jobs:
        services.attempt_node_exit(job["attempt"], node_name="bench-node", result={
            "attempt_id": job["attempt"], "node": "bench-node", "exit_code": 0, "signal": None, "stopped": False,
            "failures": [], "log_tail": {}})
        assert Attempt.objects.get(pk=job["attempt"]).status == Attempt.Status.ENDED


def drain(args, r, payloads: list) -> dict:
    """XADD the backlog, then Relay.step() until it is all committed and acknowledged; the figures."""
    from jobs.telemetry.relay import Relay

    total = sum(len(e) for _, e in payloads) * args.entry_samples
    relay = Relay(consumer="relay-1", batch=args.batch)
    t0 = time.perf_counter()
    pipe = r.pipeline(transaction=False)
    for n, (stream, entries) in enumerate((s, e) for s, es in payloads for e in es):
        pipe.xadd(stream, {"type": "metrics", "data": entries})
        if n % 200 == 199:
            pipe.execute()
    pipe.execute()
    xadd_s = time.perf_counter() - t0
    relay.discover()
    prof = None if args.no_profile else cProfile.Profile()
    collector = None
    if args.gc == "off":
        import gc

        gc.disable()
    elif args.gc == "relay":
        from jobs.telemetry.relay import RoundCollector

        collector = RoundCollector()
    t0 = time.perf_counter()
    cpu0, main0 = time.process_time(), time.thread_time()
    if prof:
        prof.enable()
    rounds = 0
    while sum(r.xlen(s) for s, _ in payloads):
        relay.step()
        if collector:
            collector.between_rounds()
        rounds += 1
    relay.close()  # timed too: it writes what is pending (the stats, the ended attempts' records)
    if prof:
        prof.disable()
    drain_s = time.perf_counter() - t0
    cpu_s, main_s = time.process_time() - cpu0, time.thread_time() - main0
    figures = {"database": "postgresql" if args.postgres else "sqlite", "ranks_per_job": args.ranks,
               "samples": total, "rounds": rounds, "raw_xadd_samples_per_s": round(total / xadd_s),
               "relay_samples_per_s": round(total / drain_s), "relay_vs_xadd": round(xadd_s / drain_s, 3),
               "relay_cpu_us_per_sample": round(1e6 * cpu_s / total, 2),
               "relay_main_thread_us_per_sample": round(1e6 * main_s / total, 2),
               "profiled": prof is not None, "loadavg": [round(x, 2) for x in os.getloadavg()]}
    if prof:
        print(json.dumps(figures))
        if args.dump:
            prof.dump_stats(args.dump)
        pstats.Stats(prof, stream=sys.stdout).sort_stats(args.sort).print_stats(args.top)
    return figures


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="trainyard-relayprof-"))
    procs: list = []
    try:
        env, jobs = setup(args, work, procs)
        import django

        django.setup()
        import redis

        r = redis.Redis.from_url(env["REDIS_URL"])
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        if not args.ended:
            figures = drain(args, r, backlog(args, jobs))
            if args.no_profile:  # (with the profile, drain printed them before its table)
                print(json.dumps(figures))
            return
        from jobs.telemetry import relay as relay_module

        args.no_profile = True
        end_attempts(jobs)
        runs = {}
        for (name, late_s), half in zip((("every_round", 0.0), ("relay", relay_module.LATE_REFRESH_S)),
                                        (jobs[:args.jobs], jobs[args.jobs:])):
            relay_module.LATE_REFRESH_S = late_s
            runs[name] = {"late_refresh_s": late_s, **drain(args, r, backlog(args, half))}
        print(json.dumps({"ended": True, "batch": args.batch, **runs, "relay_vs_every_round": round(
            runs["relay"]["relay_samples_per_s"] / runs["every_round"]["relay_samples_per_s"], 2),
            "cpu_every_round_vs_relay": round(runs["every_round"]["relay_cpu_us_per_sample"]
                                              / runs["relay"]["relay_cpu_us_per_sample"], 2)}))
    finally:
        for p in procs:
            if isinstance(p, subprocess.Popen):
                p.terminate()
                p.wait(10)
            else:
                p.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
