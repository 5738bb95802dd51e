"""Reclaim (trainyard): which borrowing jobs to preempt so a within-quota job gets its quota back.

When a job of a team within its quota (within-quota slots + the job's <= quota) cannot start
now, and would not fit either once the running jobs predicted to end within `RECLAIM_WAIT_S`
have ended (`fits_by`), borrowing jobs of *other* teams are preempted until it fits, topology
included. Victims may have any priority (what they hold is beyond their own team's
entitlement); candidates in order lowest priority first, then most recently started (least work
lost), then largest (`victim_order`); taken until the job fits, then pruned (each earlier choice
dropped if the job still fits without it), so the set is minimal in that order
(`pick_victims`). Nothing is preempted when even all candidates would not make it fit.
Preemption is cooperative: the victims checkpoint and exit later. Until then the view carries
them as `preemptible=False` with `preempted_for` set, and each tick first considers the jobs
preemptions are in flight for: such a job starts as soon as it fits, and meanwhile holds the
free slots its planned placement needs, so nobody backfills into them and it is never reclaimed
for twice (see tick.py).
"""
from __future__ import annotations

from typing import Collection, Iterable, Mapping

from jobs.scheduling.policy.cluster import QueuedJob, RunningJob
from jobs.scheduling.policy.placement import FreeSlots, IndexShares


def victim_order(running: Iterable[RunningJob], borrowing: Collection[int]) -> list[RunningJob]:
    """The borrowing running jobs in the order reclaim takes them: lowest priority, then most
    recently started, then largest (then highest id, for a stable order)."""
    return sorted((r for r in running if r.id in borrowing),
                  key=lambda r: (r.priority, -r.started_at, -r.slots, -r.id))


def fits_by(free: FreeSlots, job: QueuedJob, exclude, ends: Iterable[tuple[float, IndexShares]],
            deadline: float) -> bool:
    """Would the job fit once the jobs predicted to end by `deadline` have ended? (`ends`: the
    expected ends of the jobs holding slots, (end, shares), in order of end.)"""
    delta: dict[int, int] = {}
    for end, shares in ends:
        if end > deadline:
            break
        free.overlay_of(shares, delta)
    return free.count_fit(job.procs_per_node, exclude, delta) >= job.nodes


def pick_victims(free: FreeSlots, job: QueuedJob, exclude, candidates: list[RunningJob],
                 shares: Mapping[int, IndexShares]) -> tuple[list[RunningJob], dict[int, int]] | None:
    """The minimal prefix-then-pruned set of `candidates` (in victim order) whose slots make the
    job fit, and the {node index: slots} they free; None when even all of them would not.
    `shares`: each running job's shares by node index."""
    if not candidates or free.total + sum(r.slots for r in candidates) < job.slots:
        return None
    n, ppn = job.nodes, job.procs_per_node
    chosen: list[RunningJob] = []
    delta: dict[int, int] = {}
    for r in candidates:
        chosen.append(r)
        free.overlay_of(shares[r.id], delta)
        if free.count_fit(ppn, exclude, delta) >= n:
            break
    else:
        return None
    for r in reversed(chosen[:-1]):  # prune: drop earlier choices the job fits without
        rest = [c for c in chosen if c is not r]
        d2 = free.overlay_of(s for c in rest for s in shares[c.id])
        if free.count_fit(ppn, exclude, d2) >= n:
            chosen, delta = rest, d2
    return chosen, delta
