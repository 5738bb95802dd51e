"""Elastic node counts (`resources.nodes: {min: M, max: N}`): on how many nodes an elastic job
starts, when a running one grows, and how reclaim shrinks one instead of stopping it.

- **Start**: a queued elastic job takes N nodes when they are free. Otherwise it starts now on
  the most nodes k in [M, N) that are free, when that is predicted to finish sooner than waiting
  for N (its EASY reservation's shadow time for N, + work / N), where work = predicted_s x N
  (`predicted_s` is its run time on N nodes; run time scales as 1 / k): on k it finishes at
  now + work / k, or, when that is past the shadow time, grows to N there (+ RESIZE_COST_S).
  A job that can never get N nodes (fewer eligible nodes) is treated as one of the most it could.
  One stopped to resize or after a lost node (`restart_now`) starts at once on the most free.
- **Grow**: after the queue walk, a running elastic job below N whose predicted end is more than
  `ClusterView.grow_min_left_s` away grows onto free nodes when no queued job of higher priority, or of its
  priority submitted earlier, is waiting (gated jobs aside), and without taking the reserved
  head's slots past its shadow time (as a backfilled job would). Growing is a cooperative stop
  at the next step (it checkpoints, as a preemption does) that restarts at once on more nodes.
- **Shrink for reclaim**: before preempting borrowing jobs whole, reclaim tries shrinking
  borrowing elastic jobs to M (in victim order) and takes that when it frees enough
  (`pick_shrinks`).

The attempt on k nodes runs `JobSpec.at_nodes(k)`: dp follows the count, the global batch stays.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

from jobs.scheduling.policy.cluster import QueuedJob, RunningJob
from jobs.scheduling.policy.placement import FreeSlots, IndexShares, PoolExclusion

# What a resize costs the job, assumed: the cooperative stop, the relaunch and the checkpoint load.
RESIZE_COST_S = 60.0

def at_count(job: QueuedJob, k: int) -> QueuedJob:
    """The job as a fixed gang of k nodes; its predicted run time scales as nodes / k."""
    if k == job.nodes and not job.elastic:
        return job
    return replace(job, nodes=k, min_nodes=None, restart_now=False, predicted_s=job.predicted_s * job.nodes / k)


def fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return "an unknown time"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def start_fewer(job: QueuedJob, most: int, k: int, now: float, wait_shadow: float | None) -> str | None:
    """Why the elastic `job` (as queued: `predicted_s` on `job.nodes`) should start now on k nodes
    rather than wait for `most` (the most it could get) from `wait_shadow` (None: no predicted
    start); None: it should wait. Started now, it runs on k until the shadow time and then grows
    to `most` (paying RESIZE_COST_S), unless it is done on k first."""
    if job.restart_now:
        return (f"restarting at once on {k} of up to {job.nodes} node(s) (elastic, at least "
                f"{job.min_nodes})")
    work = job.predicted_s * job.nodes  # node-seconds
    if wait_shadow is None:
        finish_now, finish_wait = work / k, math.inf
    else:
        ahead = max(0.0, wait_shadow - now)
        finish_wait = ahead + work / most
        finish_now = work / k if work <= ahead * k else ahead + RESIZE_COST_S + (work - ahead * k) / most
    if finish_now >= finish_wait:
        return None
    return (f"started on {k} of {job.nodes} nodes: predicted to finish in {fmt_s(finish_now)} (growing when "
            f"more nodes free up), against {fmt_s(finish_wait)} waiting for {most}")


def with_nodes(exclude, extra: set[int]):
    """`exclude` (None, a set or a PoolExclusion) with these node indices added."""
    if not extra:
        return exclude
    if isinstance(exclude, PoolExclusion):
        return PoolExclusion(exclude | extra, exclude.pool, exclude.extra | extra)
    return set(exclude or ()) | extra


def blocks_grow(r: RunningJob, waiting: list[QueuedJob]) -> QueuedJob | None:
    """The first waiting job that has a better claim on free slots than growing `r` does."""
    e = r.elastic
    for j in waiting:
        if j.priority > r.priority or (j.priority == r.priority and j.submitted_at <= e.submitted_at):
            return j
    return None


def grow_reason(cur: int, to: int, slots: int) -> str:
    return (f"growing from {cur} to {to} node(s): {slots} slot(s) are free and no earlier or "
            f"higher-priority job is waiting for them; it checkpoints and restarts at once on {to}")


def pick_shrinks(free: FreeSlots, job: QueuedJob, exclude, candidates: list[RunningJob],
                 shares: Mapping[int, IndexShares]) -> tuple[list[RunningJob], dict[int, int]] | None:
    """Borrowing elastic jobs (in victim order) whose shrinking to their least nodes makes `job`
    fit, and the {node index: slots} that frees; None when shrinking all of them would not."""
    chosen: list[RunningJob] = []
    delta: dict[int, int] = {}
    for r in candidates:
        e = r.elastic
        if e is None or len(r.nodes) <= (e.min_nodes or e.nodes):
            continue
        chosen.append(r)
        free.overlay_of(shares[r.id][e.min_nodes:], delta)
        if free.count_fit(job.procs_per_node, exclude, delta) >= job.nodes:
            return chosen, delta
    return None
