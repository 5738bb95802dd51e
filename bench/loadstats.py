"""Pure helpers of bench/load.py: the open-loop timetable, the request mix and the latency summary.

Open loop: request i is due at start + i / rate whatever the server does, and its latency is
measured from that due time, not from when the client got round to sending it, so a stall of the
server (or of the client) shows up in every request that was due during it instead of being hidden
by a client that waits (coordinated omission).
"""
from __future__ import annotations

import math
import random

# The dashboard's reads, with the share of each in the mix (they sum to 1).
MIX = {"job_list": 0.3, "job_detail": 0.25, "metrics": 0.2, "nodes": 0.15, "events": 0.1}


def timetable(rate: float, duration_s: float) -> list[float]:
    """Due times (seconds from the start) of an open-loop schedule: `rate` per second for `duration_s`."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration_s must be positive")
    return [i / rate for i in range(int(round(rate * duration_s)))]


def request_mix(n: int, weights: dict[str, float] = MIX, seed: int = 0) -> list[str]:
    """n request kinds in a shuffled order, each kind's count its weight's share of n (largest
    remainders round), so every run and the baseline send exactly the same mix."""
    total = sum(weights.values())
    exact = {k: n * w / total for k, w in weights.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: exact[k] - counts[k], reverse=True)[:n - sum(counts.values())]:
        counts[k] += 1
    kinds = [k for k in weights for _ in range(counts[k])]
    random.Random(seed).shuffle(kinds)
    return kinds


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(seconds: list[float]) -> dict:
    """{n, p50_ms, p99_ms, max_ms} of latencies given in seconds."""
    def ms(v):
        return None if v is None else round(v * 1000.0, 2)
    return {"n": len(seconds), "p50_ms": ms(percentile(seconds, 50)), "p99_ms": ms(percentile(seconds, 99)),
            "max_ms": ms(max(seconds) if seconds else None)}


def ratio(full: float | None, base: float | None) -> float | None:
    return round(full / base, 2) if full is not None and base else None


def socket_targets(n: int, job_ids: list[int], cluster_every: int = 4) -> list[str]:
    """1 of `cluster_every` sockets on the cluster page (none if 0), the others on the job pages,
    alternating between the jobs."""
    out, k = [], 0
    for i in range(n):
        if cluster_every and i % cluster_every == cluster_every - 1:
            out.append("cluster")
        else:
            out.append(str(job_ids[k % len(job_ids)]))
            k += 1
    return out
