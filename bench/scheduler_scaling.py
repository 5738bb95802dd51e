"""bench/scheduler.py's reference figures and scaling section: the tick and the start-time
predictions as they were before issue 26 part 4 (scheduler_reference.py, predict_reference.py)
timed on the same views as today's, each in a forked child with a time limit (the old fill tick
at 10,000 nodes / 100,000 queued jobs did not finish in 10 minutes), and how each grows with the
cluster: the exponent of time ~ nodes^k between the smallest and the largest scale measured.
"""
from __future__ import annotations

import math
import multiprocessing
import sys
import time

from predict_reference import reference_predict_starts
from scheduler_reference import reference_schedule

from jobs.scheduling.policy import predict_starts, schedule


def _child(conn, fn) -> None:
    t = time.perf_counter()
    out = fn()
    conn.send((time.perf_counter() - t, out))
    conn.close()


def capped(fn, timeout: float) -> tuple[float | None, object]:
    """(seconds, fn's result) of fn run once in a forked child, or (None, None) past `timeout`."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn))
    proc.start()
    child.close()
    got = parent.recv() if parent.poll(timeout) else None
    if got is None:
        proc.kill()
    proc.join()
    return (None, None) if got is None else (round(got[0], 4), got[1])


def ratio(new: float, old: float | None) -> float | None:
    return None if not old else round(new / old, 4)


def reference_figures(fill_view, busy_view, timeout: float) -> dict:
    """The reference's fill and busy tick and predict_starts seconds (None: past `timeout`)."""
    return {
        "fill_s": capped(lambda: len(reference_schedule(fill_view).placements), timeout)[0],
        "busy_s": capped(lambda: len(reference_schedule(busy_view).placements), timeout)[0],
        "predict_s": capped(lambda: len(reference_predict_starts(busy_view)), timeout)[0],
    }


def _exponent(points: list[dict], key: str, timeout: float):
    """k in time ~ nodes^k from the smallest to the largest scale; a reference that timed out
    at the largest gives a lower bound (its time was at least the timeout)."""
    first, last = points[0], points[-1]
    if first[key] is None or first["nodes"] == last["nodes"]:
        return None
    span = math.log(last["nodes"] / first["nodes"])
    if last[key] is None:
        return f">= {math.log(timeout / first[key]) / span:.2f} (timed out at {last['nodes']} nodes)"
    return round(math.log(last[key] / first[key]) / span, 2)


def bench_scaling(args, tick_views, known: dict) -> dict:
    """New and reference fill tick, busy tick and predict_starts at each scale (queue = 10 x
    nodes); `known`: figures the tick section already measured, by (nodes, jobs)."""
    points = []
    for n in sorted(set(args.scale_nodes)):
        jobs = n * 10
        got = known.get((n, jobs)) or _measure(n, jobs, args, tick_views)
        points.append({"nodes": n, "queued": jobs, **got})
    out = {"points": points, "reference_timeout_s": args.reference_timeout, "exponent": {}}
    for key in ("fill_s", "busy_s", "predict_s"):
        out["exponent"][key[:-2]] = _exponent(points, key, args.reference_timeout)
        out["exponent"][f"reference_{key[:-2]}"] = _exponent(points, f"reference_{key}", args.reference_timeout)
    return out


def _measure(n: int, jobs: int, args, tick_views) -> dict:
    print(f"scaling: {n} nodes, {jobs} queued", file=sys.stderr, flush=True)
    fill, busy = tick_views(n, jobs, args.seed)
    got = {"fill_s": _once(lambda: schedule(fill)), "busy_s": _once(lambda: schedule(busy)),
           "predict_s": _once(lambda: predict_starts(busy))}
    got.update({f"reference_{k}": v for k, v in reference_figures(fill, busy, args.reference_timeout).items()})
    return got


def _once(fn) -> float:
    t = time.perf_counter()
    fn()
    return round(time.perf_counter() - t, 4)
