"""Scheduler benchmark: tick cost at scale, start-time predictions, and the three policies side by
side on synthetic traces. Prints one JSON object on stdout (progress on stderr).

    python bench/scheduler.py                      # both sections, ~3-6 min on 2 cores
    python bench/scheduler.py --skip policies,elastic   # the tick and scaling sections (~1 min)
    python bench/scheduler.py --skip policies,elastic --tick-nodes 10000 --tick-jobs 100000 --repeat 1
    python bench/scheduler.py --skip tick --seeds 1,2,3,4,5 --jobs 3000

`tick`: 1,000 nodes x 8 slots (racks of 40) and 10,000 queued jobs from 4 teams with quotas.
- `fill`: an empty cluster and a queue where most jobs fit (85% 1 slot, 10% 2, 5% 4): one
  `schedule()` tick, its placements and placements/s;
- `busy`: the cluster full of the jobs `fill` placed (predicted ends over the next hours) and
  10,000 new jobs (1-64 slots, multi-node included): a tick that places little and mostly
  decides who waits (head reservation, backfill checks, reclaim checks), and `predict_starts`
  for all 10,000 (plus `max_jobs=500`, the cheap refresh of the front of the queue).
Each against the baseline, the scheduler this one replaced (priority + FIFO, strict queue,
first fit: `legacy_schedule` below, verbatim), on the same nodes and queue: `tick_ratio` =
new / old time; and against the reference, this scheduler before issue 26 part 4
(scheduler_reference.py, predict_reference.py: the same decisions, quadratic in the placements):
`reference_*_s`, `reference_ratio`. Baseline and reference run once each in a forked child,
null past `--reference-timeout`. Times are medians of `--repeat` runs. Targets: a tick < 1 s,
>= 10,000 placements/s, predict_starts of the queue < 5 s, also at
`--tick-nodes 10000 --tick-jobs 100000`.

`scaling`: the fill and busy ticks and predict_starts, new and reference, at `--scale-nodes`
and `--tick-nodes` (queue = 10 x nodes; bench/scheduler_scaling.py), and the growth exponent
k of time ~ nodes^k of each between the smallest and the largest scale.

`policies`: for each seed, `bench/tracegen.py` writes a trace of `--jobs` jobs at offered load
`--load` for a cluster of `--nodes` x `--slots-per-node`, and `jobs.scheduling.simulation.simulate` replays it
under fifo, backfill and trainyard (entitlements: equal shares). Per seed and on average:
avg/p50/p99 JCT, average wait, utilization, preemptions, each team's share of its entitlement,
and trainyard's JCT reduction against fifo and backfill. Targets: >= 30% lower average JCT than
fifo and >= 15% lower than backfill at equal or better utilization (within 1 point), every team
with demand >= 90% of its entitlement.

`elastic`: for each seed, the same trace with every multi-node job elastic down to a quarter of
its slots (`tracegen.make_elastic`, at least one node), replayed under trainyard as elastic and
with every job at its most nodes (fixed), side by side: avg/p99 JCT, wait, utilization, resizes,
and `elastic_over_fixed` ratios (below 1 is better for JCT and wait).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from jobs.scheduling.policy import ClusterView, NodeState, Quotas, QueuedJob, RunningJob, predict_starts, queue_order, schedule  # noqa: E402
from jobs.scheduling.simulation import SimConfig, TraceJob, simulate  # noqa: E402

import tracegen  # noqa: E402
from scheduler_scaling import bench_scaling, capped as _capped, ratio as _ratio, reference_figures  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the baseline (the old scheduler, verbatim)

@dataclass(frozen=True)
class _LShare:
    node: str
    address: str
    node_rank: int
    slot_ids: tuple[int, ...]


@dataclass(frozen=True)
class _LPlacement:
    job_id: int
    shares: tuple


def _legacy_place(job, free, nodes):
    chosen = [n for n in nodes if n.schedulable and len(free[n.name]) >= job.procs_per_node][: job.nodes]
    if len(chosen) < job.nodes:
        return None
    return _LPlacement(job.id, tuple(
        _LShare(n.name, n.address, rank, free[n.name][: job.procs_per_node]) for rank, n in enumerate(chosen)))


def legacy_schedule(nodes, queue):
    nodes = sorted(nodes, key=lambda n: n.name)
    free = {n.name: n.free_slot_ids for n in nodes}
    empty = {n.name: tuple(range(n.slots)) for n in nodes}
    placements, waiting, blocked_by = [], {}, None
    for job in sorted(queue, key=lambda j: (-j.priority, j.id)):
        if blocked_by is not None:
            waiting[job.id] = f"behind job {blocked_by} in the queue"
            continue
        usable = nodes
        if job.avoid:
            without = [n for n in nodes if n.name not in job.avoid]
            if _legacy_place(job, empty, without) is not None:
                usable = without
        placement = _legacy_place(job, free, usable)
        if placement is not None:
            placements.append(placement)
            for share in placement.shares:
                free[share.node] = tuple(i for i in free[share.node] if i not in share.slot_ids)
            continue
        if _legacy_place(job, empty, usable) is None:
            waiting[job.id] = "waiting for nodes"
            continue
        waiting[job.id] = "waiting for free slots"
        blocked_by = job.id
    return placements, waiting


# ---------------------------------------------------------------- tick section

TEAMS = ("vision", "nlp", "speech", "rl")


def _timed(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _queue(rng: random.Random, n: int, first_id: int, now: float, sizes) -> tuple[QueuedJob, ...]:
    jobs = []
    for i in range(n):
        slots = rng.choices([s for s, _ in sizes], [w for _, w in sizes])[0]
        nodes, ppn = (1, slots) if slots <= 8 else (slots // 8, 8)
        jobs.append(QueuedJob(first_id + i, rng.choice([0, 1, 1, 1, 2]), nodes, ppn, team=rng.choice(TEAMS),
                              user=f"u{rng.randrange(200)}", submitted_at=now - rng.uniform(0, 7200),
                              predicted_s=rng.lognormvariate(7.5, 1.2)))
    return tuple(jobs)


def tick_views(n_nodes: int, n_jobs: int, seed: int, schedule_fn=None) -> tuple[ClusterView, ClusterView]:
    """The tick section's two views: `fill` (empty nodes, a queue that mostly fits) and `busy`
    (everything `fill` placed now running, by `schedule_fn`'s decision, and a new queue)."""
    rng = random.Random(seed)
    now = 1.7e9
    nodes = tuple(NodeState(f"n{i:04d}", f"10.{i // 250}.{i % 250}.1", 8, frozenset(), True, f"r{i // 40:02d}")
                  for i in range(n_nodes))
    quotas = Quotas({t: n_nodes * 8 // len(TEAMS) for t in TEAMS}, {f"u{i}": 400 for i in range(0, 200, 7)})
    fill_q = _queue(rng, n_jobs, 1, now, ((1, 85), (2, 10), (4, 5)))
    fill_view = ClusterView(now, nodes, (), fill_q, quotas, {t: rng.uniform(0, 1e7) for t in TEAMS})
    d = (schedule_fn or schedule)(fill_view)
    byid = {j.id: j for j in fill_q}
    used: dict[str, set[int]] = {n.name: set() for n in nodes}
    running = []
    for p in d.placements:
        j = byid[p.job_id]
        shares = tuple((s.node, s.slot_ids) for s in p.shares)
        for name, ids in shares:
            used[name].update(ids)
        started = now - rng.uniform(0, 3600)
        running.append(RunningJob(j.id, j.team, j.user, j.slots, j.priority, shares, started,
                                  now + rng.lognormvariate(7.5, 1.2) - 300))
    busy_nodes = tuple(NodeState(n.name, n.address, n.slots, frozenset(used[n.name]), True, n.rack) for n in nodes)
    busy_q = _queue(rng, n_jobs, 100_000, now, ((1, 55), (2, 10), (4, 12), (8, 13), (16, 6), (32, 3), (64, 1)))
    return fill_view, ClusterView(now, busy_nodes, tuple(running), busy_q, quotas, fill_view.usage)


def bench_tick(args) -> dict:
    fill_view, busy_view = tick_views(args.tick_nodes, args.tick_jobs, args.seed)
    nodes, fill_q, busy_q = fill_view.nodes, fill_view.queue, busy_view.queue
    log(f"tick/fill: {len(nodes)} nodes, {len(fill_q)} queued")
    t_fill, d = _timed(lambda: schedule(fill_view), args.repeat)
    old_fill = _capped(lambda: len(legacy_schedule(nodes, fill_q)[0]), args.reference_timeout)
    running = busy_view.running
    log(f"tick/busy: {len(running)} running, {len(busy_q)} queued")
    t_busy, d_busy = _timed(lambda: schedule(busy_view), args.repeat)
    old_busy = _capped(lambda: len(legacy_schedule(busy_view.nodes, busy_q)[0]), args.reference_timeout)
    t_order, _ = _timed(lambda: queue_order(busy_view), args.repeat)
    log("tick/predict_starts")
    t_eta, eta = _timed(lambda: predict_starts(busy_view), max(1, args.repeat // 2))
    t_eta_front, eta_front = _timed(lambda: predict_starts(busy_view, max_jobs=500), args.repeat)
    horizon = sorted(v - fill_view.now for v in eta.values())
    log("tick/reference (the tick and predictions before issue 26 part 4)")
    ref = reference_figures(fill_view, busy_view, args.reference_timeout)
    return {
        "nodes": len(nodes), "slots_per_node": 8, "queued": args.tick_jobs, "repeat": args.repeat,
        "fill": {
            "tick_s": round(t_fill, 4), "placements": len(d.placements),
            "placements_per_s": round(len(d.placements) / t_fill),
            "baseline_tick_s": old_fill[0], "baseline_placements": old_fill[1],
            "tick_ratio": _ratio(t_fill, old_fill[0]),
            "reference_tick_s": ref["fill_s"], "reference_ratio": _ratio(t_fill, ref["fill_s"]),
        },
        "busy": {
            "running": len(running), "tick_s": round(t_busy, 4), "placements": len(d_busy.placements),
            "preemptions": len(d_busy.preemptions),
            "baseline_tick_s": old_busy[0], "baseline_placements": old_busy[1],
            "tick_ratio": _ratio(t_busy, old_busy[0]),
            "reference_tick_s": ref["busy_s"], "reference_ratio": _ratio(t_busy, ref["busy_s"]),
            "queue_order_s": round(t_order, 4),
        },
        "predict_starts": {
            "jobs": len(eta), "s": round(t_eta, 3), "jobs_per_s": round(len(eta) / t_eta),
            "front_500_s": round(t_eta_front, 4), "front_500_jobs": len(eta_front),
            "eta_p50_h": round(horizon[len(horizon) // 2] / 3600, 2) if horizon else None,
            "eta_max_h": round(horizon[-1] / 3600, 2) if horizon else None,
            "ratio_to_one_tick": round(t_eta / t_busy, 2),
            "reference_s": ref["predict_s"], "reference_ratio": _ratio(t_eta, ref["predict_s"]),
        },
        "reference_timeout_s": args.reference_timeout,
        "targets_met": {
            "tick_under_1s": max(t_fill, t_busy) < 1.0,
            "placements_per_s_10k": len(d.placements) / t_fill >= 10_000,
            "predict_starts_under_5s": t_eta < 5.0,
        },
    }


# ---------------------------------------------------------------- policies section

POLICIES = ("fifo", "backfill", "trainyard")
KEYS = ("avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_wait_s", "makespan_s", "utilization", "preemptions",
        "lost_slot_s", "min_share_of_entitlement")


def bench_policies(args) -> dict:
    slots = args.nodes * args.slots_per_node
    per_seed = {}
    for seed in args.seeds:
        rows = tracegen.generate(args.jobs, seed, cluster_slots=slots, load=args.load)
        trace = [TraceJob(r["job_id"], r["submit_s"], r["user"], r["team"], r["slots"], r["duration_s"],
                          r["estimate_s"], r["priority"]) for r in rows]
        res = {}
        for policy in POLICIES:
            t = time.perf_counter()
            r = simulate(trace, SimConfig(policy=policy, nodes=args.nodes, slots_per_node=args.slots_per_node))
            wall = time.perf_counter() - t
            log(f"policies: seed {seed} {policy}: avg JCT {r['avg_jct_s']:.0f} s, utilization {r['utilization']:.3f}, "
                f"{r['ticks']} ticks in {wall:.1f} s")
            res[policy] = {k: r[k] for k in KEYS}
            res[policy]["share_of_entitlement"] = {t: v["share_of_entitlement"] for t, v in r["teams"].items()}
            res[policy]["sim_wall_s"] = round(wall, 2)
        f, b, y = (res[p]["avg_jct_s"] for p in POLICIES)
        res["trainyard_vs_fifo_jct_reduction"] = round(1 - y / f, 4)
        res["trainyard_vs_backfill_jct_reduction"] = round(1 - y / b, 4)
        res["trainyard_minus_best_baseline_utilization"] = round(
            res["trainyard"]["utilization"] - max(res["fifo"]["utilization"], res["backfill"]["utilization"]), 4)
        res["targets_met"] = {
            "jct_30pct_below_fifo": res["trainyard_vs_fifo_jct_reduction"] >= 0.30,
            "jct_15pct_below_backfill": res["trainyard_vs_backfill_jct_reduction"] >= 0.15,
            "utilization_not_worse": res["trainyard_minus_best_baseline_utilization"] >= -0.01,
            "every_team_90pct_of_entitlement": (res["trainyard"]["min_share_of_entitlement"] or 1.0) >= 0.90,
        }
        per_seed[str(seed)] = res
    def mean(key):
        return round(statistics.mean(per_seed[s][key] for s in per_seed), 4)
    return {
        "trace": {"jobs": args.jobs, "load": args.load, "generator": "bench/tracegen.py"},
        "cluster": {"nodes": args.nodes, "slots_per_node": args.slots_per_node, "entitlements": "equal shares"},
        "seeds": per_seed,
        "mean_trainyard_vs_fifo_jct_reduction": mean("trainyard_vs_fifo_jct_reduction"),
        "mean_trainyard_vs_backfill_jct_reduction": mean("trainyard_vs_backfill_jct_reduction"),
        "seeds_meeting_all_targets": sum(all(r["targets_met"].values()) for r in per_seed.values()),
    }


ELASTIC_KEYS = ("avg_jct_s", "p99_jct_s", "avg_wait_s", "makespan_s", "utilization", "preemptions", "resizes",
                "elastic_jobs")


def bench_elastic(args) -> dict:
    per_seed = {}
    for seed in args.seeds:
        rows = tracegen.make_elastic(tracegen.generate(args.jobs, seed, cluster_slots=args.nodes * args.slots_per_node,
                                                       load=args.load), args.slots_per_node)
        trace = [TraceJob(r["job_id"], r["submit_s"], r["user"], r["team"], r["slots"], r["duration_s"],
                          r["estimate_s"], r["priority"], r.get("min_slots")) for r in rows]
        res = {}
        for name, elastic in (("elastic", True), ("fixed", False)):
            r = simulate(trace, SimConfig(nodes=args.nodes, slots_per_node=args.slots_per_node, elastic=elastic))
            res[name] = {k: r[k] for k in ELASTIC_KEYS}
            log(f"elastic: seed {seed} {name}: avg JCT {r['avg_jct_s']:.0f} s, utilization {r['utilization']:.4f}, "
                f"{r['resizes']} resizes")
        res["elastic_over_fixed"] = {k: round(res["elastic"][k] / res["fixed"][k], 4) if res["fixed"][k] else None
                                     for k in ("avg_jct_s", "p99_jct_s", "avg_wait_s", "utilization")}
        per_seed[str(seed)] = res
    return {
        "trace": {"jobs": args.jobs, "load": args.load, "elastic": "multi-node jobs down to slots / 4, at least one node"},
        "seeds": per_seed,
        "mean_elastic_over_fixed": {k: round(statistics.mean(per_seed[s]["elastic_over_fixed"][k] for s in per_seed), 4)
                                    for k in ("avg_jct_s", "avg_wait_s", "utilization")},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: tick, scaling, policies, elastic")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="seed of the tick section's synthetic cluster")
    ap.add_argument("--tick-nodes", type=int, default=1000)
    ap.add_argument("--tick-jobs", type=int, default=10_000)
    ap.add_argument("--scale-nodes", default="1000,3000",
                    help="scaling section: node counts (queue = 10 x nodes), with --tick-nodes added")
    ap.add_argument("--reference-timeout", type=float, default=30.0,
                    help="seconds each reference (and legacy baseline) run may take before it is reported as null")
    ap.add_argument("--seeds", default="1,2,3", help="trace seeds of the policies section")
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--slots-per-node", type=int, default=8)
    args = ap.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.scale_nodes = [int(s) for s in args.scale_nodes.split(",") if s.strip()] + [args.tick_nodes]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    out = {"bench": "scheduler", "python": sys.version.split()[0], "cpus": os.cpu_count()}
    known = {}
    if "tick" not in skip:
        out["tick"] = tick = bench_tick(args)
        if args.tick_jobs == args.tick_nodes * 10:
            known[(args.tick_nodes, args.tick_jobs)] = {
                "fill_s": tick["fill"]["tick_s"], "busy_s": tick["busy"]["tick_s"], "predict_s": tick["predict_starts"]["s"],
                "reference_fill_s": tick["fill"]["reference_tick_s"], "reference_busy_s": tick["busy"]["reference_tick_s"],
                "reference_predict_s": tick["predict_starts"]["reference_s"]}
    if "scaling" not in skip:
        out["scaling"] = bench_scaling(args, tick_views, known)
    if "policies" not in skip:
        out["policies"] = bench_policies(args)
    if "elastic" not in skip:
        out["elastic"] = bench_elastic(args)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
