"""Synthetic GPU-cluster job traces shaped like the public ones (Microsoft Philly, SenseTime
Helios): seeded and deterministic.

    python bench/tracegen.py --jobs 2000 --seed 1 > trace.csv
    python bench/tracegen.py --jobs 2000 --seed 1 --cluster-slots 256 --load 0.9 > trace.csv

Columns: job_id,submit_s,user,team,slots,duration_s,estimate_s,priority (what
`manage.py simulate --trace` reads), and min_slots with `--elastic SHRINK` (multi-node jobs
elastic down to slots / SHRINK).

What it reproduces (Jeon et al., ATC'19, "Analysis of Large-Scale Multi-Tenant GPU Clusters";
Hu et al., SC'21, "Characterization and Prediction of Deep Learning Workloads in Large-Scale
GPU Datacenters"):
- most jobs are small and short: 55% use 1 slot, the tail reaches 64; durations are heavy
  tailed (about half under 30 minutes, one in ten over 4 hours, the longest 2 days), and large
  jobs run longer;
- submissions come in bursts: 60% of submissions are sweeps of 2-20 near-identical jobs from one
  user within a few minutes, on top of Poisson arrivals;
- users resubmit similar jobs: each user has 2-4 templates (slots, typical duration) and a job is
  a template with lognormal noise (sigma 0.5 on duration);
- estimates are 2-10x off, mostly over: each user pads by a habitual factor (log-uniform 2-10
  for 85% of users; 0.6-1.5 for the rest) with per-job noise;
- teams have different loads (40/30/20/10% of the work) and a few priorities (12% low, 8% high).

The arrival times are scaled so the offered load (slot-seconds of work / (cluster slots x span))
is `--load`, i.e. high but finite for the cluster it is meant for.
"""
from __future__ import annotations

import argparse
import csv
import math
import random
import sys

TEAMS = (("vision", 0.4, 6), ("nlp", 0.3, 5), ("speech", 0.2, 4), ("rl", 0.1, 3))  # name, share of jobs, users
SLOTS = ((1, 0.55), (2, 0.10), (4, 0.12), (8, 0.13), (16, 0.06), (32, 0.03), (64, 0.01))
COLUMNS = ("job_id", "submit_s", "user", "team", "slots", "duration_s", "estimate_s", "priority")


def _pick(rng: random.Random, table):
    x, acc = rng.random(), 0.0
    for value, p in table:
        acc += p
        if x < acc:
            return value
    return table[-1][0]


def _loguniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _template(rng: random.Random) -> tuple[int, float]:
    slots = _pick(rng, SLOTS)
    big = slots >= 8
    cls = _pick(rng, (("short", 0.35 if big else 0.55), ("medium", 0.45 if big else 0.35), ("long", 1.0)))
    lo, hi = {"short": (60, 1800), "medium": (1800, 4 * 3600), "long": (4 * 3600, 2 * 86400)}[cls]
    return slots, _loguniform(rng, lo, hi)


def generate(jobs: int, seed: int = 0, *, cluster_slots: int = 256, load: float = 0.9) -> list[dict]:
    rng = random.Random(seed)
    users = []  # (team, user, templates, padding)
    team_users: dict[str, list[int]] = {}
    for team, _, n in TEAMS:
        for u in range(n):
            pad = _loguniform(rng, 2.0, 10.0) if rng.random() < 0.85 else rng.uniform(0.6, 1.5)
            team_users.setdefault(team, []).append(len(users))
            users.append((team, f"{team}-u{u}", [_template(rng) for _ in range(rng.randint(2, 4))], pad))
    team_table = tuple((t, share) for t, share, _ in TEAMS)
    rows = []
    t = 0.0
    while len(rows) < jobs:
        t += rng.expovariate(1.0)  # unit-rate submissions; rescaled below
        team = _pick(rng, team_table)
        # a few heavy users per team (Zipf-like): user i is picked with weight 1/(i+1)
        ids = team_users[team]
        uid = rng.choices(ids, weights=[1.0 / (i + 1) for i in range(len(ids))])[0]
        _, user, templates, pad = users[uid]
        slots, typical = templates[rng.randrange(len(templates))]
        burst = rng.randint(2, 20) if rng.random() < 0.6 else 1
        prio = _pick(rng, ((0, 0.12), (2, 0.08), (1, 1.0)))
        for b in range(min(burst, jobs - len(rows))):
            duration = min(max(30.0, typical * rng.lognormvariate(0.0, 0.5)), 2 * 86400.0)
            estimate = max(60.0, duration * pad * rng.lognormvariate(0.0, 0.25))
            rows.append({"submit": t + b * rng.uniform(0.0, 0.02), "user": user, "team": team, "slots": slots,
                         "duration_s": round(duration), "estimate_s": round(estimate / 60.0) * 60 or 60,
                         "priority": prio})
    work = sum(r["slots"] * r["duration_s"] for r in rows)
    span = work / (cluster_slots * load)
    scale = span / max(r["submit"] for r in rows)
    rows.sort(key=lambda r: r["submit"])
    out = []
    for i, r in enumerate(rows, 1):
        out.append({"job_id": i, "submit_s": round(r["submit"] * scale, 1), "user": r["user"], "team": r["team"],
                    "slots": r["slots"], "duration_s": r["duration_s"], "estimate_s": r["estimate_s"],
                    "priority": r["priority"]})
    return out


def make_elastic(rows: list[dict], slots_per_node: int = 8, shrink: int = 4) -> list[dict]:
    """The trace with every multi-node job (slots > slots_per_node) elastic: `min_slots` its
    slots / shrink, at least one node's worth (resources.nodes {min, max} in the simulator)."""
    return [{**r, "min_slots": max(slots_per_node, r["slots"] // shrink)} if r["slots"] > slots_per_node else r
            for r in rows]


def write_csv(rows: list[dict], f) -> None:
    cols = COLUMNS + (("min_slots",) if any("min_slots" in r for r in rows) else ())
    w = csv.DictWriter(f, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cluster-slots", type=int, default=256, help="slots of the cluster the load is meant for")
    ap.add_argument("--load", type=float, default=0.9, help="offered load: work / (cluster slots x span)")
    ap.add_argument("--elastic", type=int, default=0, metavar="SHRINK",
                    help="make multi-node jobs (over 8 slots) elastic down to slots / SHRINK (column min_slots)")
    a = ap.parse_args(argv)
    rows = generate(a.jobs, a.seed, cluster_slots=a.cluster_slots, load=a.load)
    write_csv(make_elastic(rows, 8, a.elastic) if a.elastic else rows, sys.stdout)


if __name__ == "__main__":
    main()
