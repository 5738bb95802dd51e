"""Heterogeneous load balancing (train.balance=auto) against an equal split, side by side.

Two ranks, each a `torchrun --nnodes 2 --nproc-per-node 1` agent on 127.0.0.1 (static
rendezvous on a free port), each pinned to a CPU core of its own (os.sched_setaffinity on the
agent, inherited by its worker) with OMP_NUM_THREADS=1, so each rank has one core and the
measurement is not two ranks fighting over both. Rank 1 runs at half speed: the runtime's slow
knob TRAINYARD_SLOW_FACTOR_RANK1=2 (workers/runtime/chaos.py) makes its compute take twice as long
in proportion to its work, like a device of half the speed. A GPT where compute dominates
(default: 2 layers, hidden 128, seq 64, global batch 64: 0.48 M parameters, a few ms of
all-reduce against ~150-300 ms of forward+backward; 64 samples so that one sample is ~5% of the
slow rank's share, not 10%) trains on synthetic tokens:
  equal     train.balance=none: 32 + 32 samples; the fast rank waits for the slow one
  balanced  train.balance=auto: shares follow the measured speeds (trainyard/sdk/balance.py)
Throughput = global_batch / median step interval of rank 0's end-of-step stamps (`ts`), over the
steps after --warmup (the balancer's warm-up and first re-split included in the excluded part).
`wall_samples_per_s` is the same over the elapsed time. The ideal is the sum of the two ranks'
own speeds, each rank's samples / (data_s + compute_s + optim_s) per step (its step without the
time it waited for the other; compute_s includes the slow-down), median over the steady steps
of the same run: what the pair could do if neither ever waited. Runs alternate equal, balanced,
equal, ... (`--pairs`), so drift on a shared machine hits both alike; ratio_balanced_ideal is
within one run, so it holds even when other work changes the speeds between runs.
Output: one JSON object: per-run figures (`equal`, `balanced`: lists, one entry per pair),
`ratio_balanced_equal` and `ratio_balanced_ideal` (medians over pairs; target: balanced >= 0.9
of ideal), `ratio_equal_ideal`, `target_met`.

Usage: python bench/hetero.py [--pairs 3] [--steps 50] [--warmup 15] [--factor 2]
Needs redis-server on PATH and the project venv. ~2-3 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from overhead import REPO, free_port, start_redis, throughput  # bench/ is sys.path[0]


def spec(args, balance: str) -> dict:
    return {
        "name": f"hetero-{balance}",
        "model": {"kind": "gpt", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "seq_len": args.seq_len, "vocab": 256},
        "data": {"kind": "synthetic"},
        "train": {"steps": args.steps, "global_batch": args.global_batch, "lr": 1e-3,
                  "warmup_steps": 0, "lr_schedule": "constant", "seed": 0, "grad_accum": 1,
                  "balance": balance},
        "resources": {"nodes": 2, "procs_per_node": 1, "device": "cpu"},
        "parallel": {"dp": 2, "tp": 1, "pp": 1, "fsdp": False},
        "comm": {"compression": "none", "sync": "allreduce"},
        "checkpoint": {"every_steps": 1_000_000, "async": True, "keep": 1},
    }


def run(args, work: Path, balance: str, job_id: int, redis_url: str) -> dict:
    import redis

    stream = f"trainyard:job:{job_id}"
    port = free_port()
    cores = sorted(os.sched_getaffinity(0))
    pinned = len(cores) >= 2
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               TRAINYARD_SLOW_FACTOR_RANK1=str(args.factor))
    env.pop("TRAINYARD_CHAOS_DIR", None)
    procs = []
    for node in range(2):
        run_dir = work / f"{balance}-node{node}"
        run_dir.mkdir(parents=True)
        (run_dir / "config.json").write_text(json.dumps({
            "job_id": job_id, "attempt_id": job_id, "node": f"node-{node}", "run_dir": str(run_dir),
            "redis_url": redis_url, "stream": stream, "data_root": str(work),
            "checkpoint_dir": str(work / f"ckpt-{balance}"), "spec": spec(args, balance)}))
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                str(port), "-m", "workers.runtime", "--config", str(run_dir / "config.json")]
        log = open(run_dir / "out.log", "w")
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if pinned:  # before the agent spawns its worker (it first imports torch: ~1 s)
            os.sched_setaffinity(proc.pid, {cores[node]})
        procs.append((proc, run_dir))
    for proc, run_dir in procs:
        try:
            rc = proc.wait(args.timeout)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            rc = "timeout"
        if rc != 0:
            sys.exit(f"{balance} run failed ({rc}):\n{(run_dir / 'out.log').read_text()[-3000:]}")
    client = redis.Redis.from_url(redis_url)
    entries = client.xrange(stream)
    client.delete(stream)
    client.close()
    samples, events = [], []
    for _, f in entries:
        data = json.loads(f[b"data"])
        (samples.extend if f[b"type"] == b"metrics" else events.append)(data)
    return summarise(args, samples, events, pinned)


def summarise(args, samples: list[dict], events: list[dict], pinned: bool) -> dict:
    n_total = args.global_batch
    by_rank = {r: sorted((s for s in samples if s["rank"] == r), key=lambda s: s["step"]) for r in (0, 1)}
    if any(len(v) != args.steps for v in by_rank.values()):
        sys.exit(f"expected {args.steps} samples per rank, got {[len(v) for v in by_rank.values()]}")
    sps, wall = throughput([s["ts"] for s in by_rank[0]], n_total, args.warmup)
    steady = {r: v[args.warmup:] for r, v in by_rank.items()}

    def n(s: dict) -> float:
        return s.get("share", 0.5) * n_total

    speeds = [statistics.median(n(s) / (s["data_s"] + s["compute_s"] + s["optim_s"]) for s in steady[r])
              for r in (0, 1)]
    per_sample_ms = [statistics.median(1000 * s["compute_s"] / n(s) for s in steady[r]) for r in (0, 1)]
    return {
        "samples_per_s": round(sps, 2), "wall_samples_per_s": round(wall, 2),
        "rank_speeds": [round(v, 2) for v in speeds], "ideal_samples_per_s": round(sum(speeds), 2),
        "compute_ms_per_sample": [round(v, 3) for v in per_sample_ms],
        "median_step_ms": round(1000 * statistics.median(s["step_s"] for s in steady[0]), 1),
        "steady_counts": [round(statistics.median(n(s) for s in steady[r]), 1) for r in (0, 1)],
        "rebalanced": [{k: e[k] for k in ("step", "counts", "speeds")} for e in events
                       if e.get("kind") == "rebalanced"],
        "pinned": pinned,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3, help="equal/balanced runs, alternating")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=15, help="steps excluded from the throughput")
    p.add_argument("--factor", type=float, default=2.0, help="rank 1's slow factor")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    args = p.parse_args()
    if not 1 <= args.warmup < args.steps - 2:
        p.error("need 1 <= --warmup < --steps - 2")
    load_before = os.getloadavg()
    t0 = time.monotonic()
    equal, balanced = [], []
    with tempfile.TemporaryDirectory(prefix="trainyard-hetero-") as tmp:
        work = Path(tmp)
        redis_proc, redis_url = start_redis(work)
        try:
            for i in range(args.pairs):
                equal.append(run(args, work / f"pair{i}", "none", 2 * i + 1, redis_url))
                balanced.append(run(args, work / f"pair{i}", "auto", 2 * i + 2, redis_url))
                print(f"pair {i + 1}/{args.pairs}: equal {equal[-1]['samples_per_s']} balanced "
                      f"{balanced[-1]['samples_per_s']} ideal {balanced[-1]['ideal_samples_per_s']} "
                      f"samples/s", file=sys.stderr, flush=True)
        finally:
            redis_proc.terminate()
            redis_proc.wait(10)

    def med(xs):
        return round(statistics.median(xs), 4)

    vs_equal = [b["samples_per_s"] / e["samples_per_s"] for e, b in zip(equal, balanced)]
    vs_ideal = [b["samples_per_s"] / b["ideal_samples_per_s"] for b in balanced]
    eq_ideal = [e["samples_per_s"] / e["ideal_samples_per_s"] for e in equal]
    print(json.dumps({
        "equal": equal, "balanced": balanced,
        "ratio_balanced_equal": med(vs_equal), "ratios_balanced_equal": [round(r, 4) for r in vs_equal],
        "ratio_balanced_ideal": med(vs_ideal), "ratios_balanced_ideal": [round(r, 4) for r in vs_ideal],
        "ratio_equal_ideal": med(eq_ideal),
        "target_met": med(vs_ideal) >= 0.9,
        "config": {"pairs": args.pairs, "steps": args.steps, "warmup": args.warmup,
                   "slow_factor_rank1": args.factor, "global_batch": args.global_batch,
                   "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                   "seq_len": args.seq_len},
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "bench_s": round(time.monotonic() - t0, 1),
    }))


if __name__ == "__main__":
    main()
