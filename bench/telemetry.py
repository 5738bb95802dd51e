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
# This file is the entry point (the CLI, the phases in order, the JSON report); its parts lie
# beside it, imported as siblings (bench/ is sys.path[0] when it runs as a script):
# telemetry_stack.py (the processes: start, stop), telemetry_roles.py (the ranks and websocket
# clients, run as `--role emitter|client` of this script), telemetry_measure.py (the measurements).
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _path in (str(REPO), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from telemetry_measure import Bench, memory_summary, postgres_drain  # noqa: E402
from telemetry_roles import run_client, run_emitter  # noqa: E402
from telemetry_stack import say  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~2 min: 8 s phases, 40 s memory run, smaller backlog")
    ap.add_argument("--rates", default="1000,5000,20000", help="total samples/s of the latency phases")
    ap.add_argument("--phase-s", type=float, help="seconds per latency phase (30; quick: 8)")
    ap.add_argument("--mem-s", type=float, help="seconds of the memory run (600; quick: 40)")
    ap.add_argument("--mem-rate", type=float, default=5000)
    ap.add_argument("--drain-samples", type=int, help="backlog for the throughput run (600000; quick: 200000)")
    ap.add_argument("--entry-samples", type=int, default=10,
                    help="samples per stream entry in the backlog (a rank at 1k steps/s, flushing every 10 ms)")
    ap.add_argument("--drain-ranks", type=int,
                    help="ranks per job in the throughput backlog (default --ranks): the relay's per-step rollup "
                         "costs per (attempt, step), so 2 ranks at 25k steps/s each is its worst case, and a "
                         "1,024-rank job at 100 steps/s its intended one")
    ap.add_argument("--relay-workers", type=int, default=1,
                    help="relay processes (manage.py relay --workers): each reads its share of the streams")
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
    return ap.parse_args()


def run_phases(bench: Bench, args, skip: set[str], result: dict) -> None:
    """The warm-up, then the latency, throughput and memory phases not in `skip`, into `result`."""
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


def targets_met(result: dict) -> dict:
    lat = result.get("latency", {})
    targets = {}
    if "1000" in lat:
        targets["p99_1k_le_100ms"] = (lat["1000"]["worst_client"]["p99_ms"] or 1e9) <= 100
    if "20000" in lat:
        targets["p99_20k_le_250ms"] = (lat["20000"]["worst_client"]["p99_ms"] or 1e9) <= 250
        targets["sustained_20k_received_all"] = lat["20000"]["received_fraction"] == 1.0
    if "throughput" in result:
        targets["relay_ge_20k_per_s"] = result["throughput"]["relay_samples_per_s"] >= 20_000
    return targets


def main() -> None:
    args = parse_args()
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
                               "drain_ranks": args.drain_ranks or args.ranks, "relay_workers": args.relay_workers,
                               "warmup_s": args.warmup_s}}
    try:
        bench.start()
        run_phases(bench, args, skip, result)
    finally:
        bench.stop()
    if args.postgres:
        result["postgres"] = postgres_drain(args, result.get("throughput"))
        say(f"  relay on PostgreSQL vs SQLite: {result['postgres'].get('relay_samples_per_s')}")
    result["targets_met"] = targets_met(result)
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
