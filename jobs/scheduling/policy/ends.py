"""When the slots held during a tick are expected back, kept current as the tick places and
preempts, so that no queued job pays for the whole list of ends.

A tick asks two things of the expected ends (tick.py): the EASY reservation walks them in order
of end (`TickEnds.ordered`, lazily: it stops once the head fits), and reclaim asks, for every
within-quota job that cannot start, whether it would fit once the jobs ending by the reclaim
deadline (now + `ClusterView.reclaim_wait_s`, the same for the whole tick) have ended
(`TickEnds.fits_soon`, reclaim.py's `fits_by` in O(excluded nodes)). The second is a standing
overlay (`OverlayCounts`): the slots the jobs ending by the deadline give back, with
"at least k slots" counts over free + overlay, updated when a placement adds an end, a
preemption removes one and when a node's free slots change (FreeSlots calls `moved`). At 10,000
nodes and 100,000 queued jobs the tick used to rebuild and re-sort the ends for each such job:
quadratic in the placements (bench/scheduler.py).
"""
from __future__ import annotations

import heapq
from typing import Iterator

from jobs.scheduling.policy.placement import FreeSlots, IndexShares, PoolExclusion


def _key(e: tuple) -> tuple:
    return e[:2]


class OverlayCounts:
    """FreeSlots.count_fit(ppn, exclude, overlay=self.delta), but in O(1) plus the excluded
    nodes: `ge[k]` (and per pool) counts the schedulable nodes with min(avail + delta, maxs) >= k,
    kept current by `add` (the overlay changes) and `moved` (a node's avail changed)."""

    def __init__(self, free: FreeSlots):
        self.free = free
        self.delta: dict[int, int] = {}
        self.ge = list(free.ge)  # an empty overlay: the free counts themselves
        self.pools: dict[int, list[int]] = {}  # pool -> its ge counts, made on first use

    def _level(self, avail: int, extra: int) -> int:
        return min(avail + extra, self.free.maxs)

    def _shift(self, i: int, old: int, new: int) -> None:
        if old == new:
            return
        arrays = [self.ge]
        if self.pools:
            arrays += [self.pools[p] for p in self.free.pool_of[i] if p in self.pools]
        lo, hi, step = (old + 1, new + 1, 1) if new > old else (new + 1, old + 1, -1)
        for ge in arrays:
            for k in range(lo, hi):
                ge[k] += step

    def moved(self, i: int, old: int, new: int) -> None:
        """Node i's available slots went from old to new (FreeSlots._set)."""
        if self.free.sched[i]:
            d = self.delta.get(i, 0)
            self._shift(i, self._level(old, d), self._level(new, d))

    def add(self, shares: IndexShares, sign: int = 1) -> None:
        """These shares' slots join the overlay (sign -1: leave it)."""
        free = self.free
        for i, slot_ids in shares:
            if not free.sched[i]:
                continue
            old = self.delta.get(i, 0)
            new = old + sign * len(slot_ids)
            self.delta[i] = new
            a = free.avail[i]
            self._shift(i, self._level(a, old), self._level(a, new))

    def _pool(self, pool: int) -> list[int]:
        ge = self.pools.get(pool)
        if ge is None:
            free = self.free
            ge = [0] * (free.maxs + 2)
            for i, of in enumerate(free.pool_of):
                if pool in of and free.sched[i]:
                    for k in range(self._level(free.avail[i], self.delta.get(i, 0)) + 1):
                        ge[k] += 1
            self.pools[pool] = ge
        return ge

    def count_fit(self, ppn: int, exclude=None) -> int:
        free = self.free
        if ppn > free.maxs:
            return 0
        k = max(ppn, 0)
        if isinstance(exclude, PoolExclusion):
            c, out = self._pool(exclude.pool)[k], exclude.extra
        else:
            c, out = self.ge[k], exclude or ()
        for i in out:
            if free.sched[i] and free.avail[i] + self.delta.get(i, 0) >= ppn:
                c -= 1
        return c


class TickEnds:
    """The expected ends of the jobs holding slots in one tick: the running jobs' (not those
    preempted, in flight or this tick: their slots go to the jobs they are for) and this tick's
    placements'. `running`: (end, job id, shares) of the running jobs with no preemption in
    flight, made on first use."""

    def __init__(self, free: FreeSlots, running, deadline: float):
        self.free = free
        self._running_src = running
        self._running: list | None = None
        self.placed: list = []  # (end, job id, shares), sorted on demand
        self._placed_sorted = True
        self.gone: set[int] = set()  # running jobs preempted this tick
        self.deadline = deadline
        self.soon: OverlayCounts | None = None

    def running(self) -> list:
        if self._running is None:
            self._running = sorted(self._running_src(), key=_key)
        return self._running

    def place(self, end: float, job_id: int, shares: IndexShares) -> None:
        if self.placed and _key(self.placed[-1]) > (end, job_id):
            self._placed_sorted = False
        self.placed.append((end, job_id, shares))
        if self.soon is not None and end <= self.deadline:
            self.soon.add(shares)

    def take(self, job_id: int, end: float, shares: IndexShares) -> None:
        """A running job (with no preemption in flight before) is preempted: its end is gone."""
        if job_id in self.gone:
            return
        self.gone.add(job_id)
        if self.soon is not None and end <= self.deadline:
            self.soon.add(shares, -1)

    def ordered(self) -> Iterator[tuple[float, IndexShares]]:
        """(end, shares) in order of (end, job id), the running jobs' before this tick's on a tie."""
        if not self._placed_sorted:
            self.placed.sort(key=_key)
            self._placed_sorted = True
        gone = self.gone
        running = (e for e in self.running() if e[1] not in gone) if gone else iter(self.running())
        ends = heapq.merge(running, self.placed, key=_key) if self.placed else running
        return ((end, shares) for end, _, shares in ends)

    def fits_soon(self, nodes: int, ppn: int, exclude) -> bool:
        """Would a gang of nodes x ppn fit once the jobs ending by the deadline have ended?"""
        if self.soon is None:
            self.soon = soon = OverlayCounts(self.free)
            for end, job_id, shares in self.running():
                if end <= self.deadline and job_id not in self.gone:
                    soon.add(shares)
            for end, _, shares in self.placed:
                if end <= self.deadline:
                    soon.add(shares)
            self.free.watch = soon.moved
        return self.soon.count_fit(ppn, exclude) >= nodes
