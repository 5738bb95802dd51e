"""Gang placement: which nodes' slots a job gets, now or at a reserved future time.

Placement is gang (every process of a job, or none): one share of `procs_per_node` slots on
each of `nodes` distinct schedulable nodes. Best fit: single-node jobs go to the node with the
fewest free slots that still holds them (ties by name), so whole nodes stay free for large jobs.
Multi-node jobs go to one rack when some rack (`NodeState.rack`) can hold them all (the rack
whose chosen nodes leave the fewest free slots), else best fit over the whole cluster. Nodes
that are not schedulable (DRAINING, CORDONED, QUARANTINED, LOST) take no new work. A restarted
job avoids the nodes its last failure implicated (`avoid`) unless it could never fit on the
others (`exclusion`). A job runs only on the nodes its device and node selector allow
(`Eligibility`, eligibility.py: a cuda job on nodes that advertise GPUs, one slot per GPU). A
job that could not fit even on empty copies of today's eligible schedulable nodes waits, with
the reason, without blocking anyone.

The EASY reservation (`reserve`) is the same walk for a tick and for the start-time
predictions: add back the slots of running jobs in order of their expected ends until the job
fits; that end is its *shadow time*, and the chosen nodes' slots beyond its need are the
*spare* a backfilled job running past the shadow may still take. Among equally good nodes the
reservation takes those that are busy now and will have freed up by then, so that nodes free
now stay available to backfill.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from typing import Iterable, Mapping, Sequence

from jobs.scheduling.policy.cluster import NodeState, QueuedJob
from jobs.scheduling.policy.eligibility import eligible, restricted

# (node index, slot ids): a share of a job on a node, by the index FreeSlots gives the node
IndexShares = tuple[tuple[int, Sequence[int]], ...]


class PoolExclusion(frozenset):
    """Node indices a job may not use: every node outside FreeSlots pool `pool` (the nodes its
    requirement allows), plus `extra`, members of the pool it avoids."""

    def __new__(cls, items, pool: int, extra=frozenset()):
        self = super().__new__(cls, items)
        self.pool, self.extra = pool, frozenset(extra)
        return self


def _enter(buckets: list, k: int, i: int) -> None:
    if k:
        insort(buckets[k], i)
    else:
        buckets[0].add(i)


def sorted_bucket(buckets: list, k: int) -> list[int]:
    """FreeSlots bucket k (of the cluster's or a rack's) in node order."""
    return sorted(buckets[0]) if k == 0 else buckets[k]


class FreeSlots:
    """Free slots per node, bucketed by how many are available, for best fit in O(slots per node).

    Nodes are indexed in name order; `buckets[k]` is the sorted list of schedulable nodes with
    exactly k available slots (free minus `hold`s), and per rack the same, except `buckets[0]`,
    the full nodes, a set: no gang walks it (ppn >= 1), and on a busy cluster of 10,000 nodes
    most nodes are there, so a sorted list cost a 40 KB memmove each time one filled or freed
    up (`sorted_bucket` gives it in order). An *overlay*
    ({node index: extra slots}) describes a hypothetical state (slots that running jobs will
    free) without copying; a *limit* ({node index: max slots}) caps what a job may take there.
    """

    __slots__ = ("names", "index", "address", "sched", "capacity", "ids", "avail", "maxs", "buckets",
                 "rack_of", "racks", "rack_ge", "total", "ge", "pool_ge", "pool_of", "counts_of", "watch")

    def __init__(self, nodes: Iterable[NodeState]):
        nodes = sorted(nodes, key=lambda n: n.name)
        self.names = [n.name for n in nodes]
        self.index = {n.name: i for i, n in enumerate(nodes)}
        self.address = [n.address for n in nodes]
        self.sched = [n.schedulable for n in nodes]
        self.capacity = [n.slots for n in nodes]
        self.ids = [[s for s in range(n.slots) if s not in n.used_slot_ids] if n.used_slot_ids
                    else list(range(n.slots)) for n in nodes]
        self.maxs = max((n.slots for n in nodes), default=0)
        self.avail = [len(ids) if ok else 0 for ids, ok in zip(self.ids, self.sched)]
        self.buckets: list = [set()] + [[] for _ in range(self.maxs)]
        self.rack_of = [n.rack if n.schedulable else None for n in nodes]
        self.racks: dict[str, list[list[int]]] = {}
        for i, (a, ok, rack) in enumerate(zip(self.avail, self.sched, self.rack_of)):
            if not ok:
                continue
            _enter(self.buckets, a, i)
            if rack is not None:
                if rack not in self.racks:
                    self.racks[rack] = [set()] + [[] for _ in range(self.maxs)]
                _enter(self.racks[rack], a, i)
        self.racks = dict(sorted(self.racks.items()))
        # per rack, its nodes with at least k slots available: a rack that cannot hold a gang is
        # skipped without walking it (choose)
        self.rack_ge: dict[str, list[int]] = {}
        for rack, rb in self.racks.items():
            rge = self.rack_ge[rack] = [0] * (self.maxs + 2)
            for k in range(self.maxs, -1, -1):
                rge[k] = rge[k + 1] + len(rb[k])
        self.total = sum(self.avail)
        # ge[k]: schedulable nodes with at least k slots available (k = 0..maxs, plus a 0 past the end)
        self.ge = [0] * (self.maxs + 2)
        for k in range(self.maxs, -1, -1):
            self.ge[k] = self.ge[k + 1] + len(self.buckets[k])
        # per pool (the nodes one requirement allows, add_pool), its own ge counts
        self.pool_ge: list[list[int]] = []
        self.pool_of: list[list[int]] = [[] for _ in nodes]
        # per node, the ge counts its available slots are counted in: the cluster's, its rack's, its pools'
        self.counts_of = [[self.ge] if rack is None else [self.ge, self.rack_ge[rack]] for rack in self.rack_of]
        # called as watch(i, old, new) when node i's available slots change (OverlayCounts)
        self.watch = None

    def add_pool(self, members: Iterable[int]) -> int:
        """Track ge counts over these node indices too (kept up to date by take/hold/release), so
        count_fit over a PoolExclusion costs what it costs over the whole cluster."""
        pid = len(self.pool_ge)
        ge = [0] * (self.maxs + 2)
        for i in members:
            self.pool_of[i].append(pid)
            self.counts_of[i].append(ge)
            if self.sched[i]:
                for k in range(self.avail[i] + 1):
                    ge[k] += 1
        self.pool_ge.append(ge)
        return pid

    def _set(self, i: int, new: int) -> None:
        old = self.avail[i]
        if old == new:
            return
        rack = self.rack_of[i]
        for buckets in (self.buckets, self.racks[rack]) if rack is not None else (self.buckets,):
            if old:  # leave bucket old, enter bucket new (inline: 300,000 calls in a prediction at 10k/100k)
                b = buckets[old]
                del b[bisect_left(b, i)]
            else:
                buckets[0].remove(i)
            if new:
                insort(buckets[new], i)
            else:
                buckets[0].add(i)
        if new > old:
            for ge in self.counts_of[i]:
                for k in range(old + 1, new + 1):
                    ge[k] += 1
        else:
            for ge in self.counts_of[i]:
                for k in range(new + 1, old + 1):
                    ge[k] -= 1
        self.avail[i] = new
        self.total += new - old
        if self.watch is not None:
            self.watch(i, old, new)

    def take(self, i: int, k: int) -> tuple[int, ...]:
        """Take k free slots of node i (the lowest ids): the slot ids."""
        ids = self.ids[i]
        got = tuple(ids[:k])
        del ids[:k]
        self._set(i, self.avail[i] - k)
        return got

    def hold(self, i: int, k: int) -> None:
        """Keep k available slots of node i from anyone else this tick."""
        self._set(i, self.avail[i] - k)

    def release(self, i: int, slot_ids: Sequence[int]) -> None:
        """Give these slots of node i back (a job ended)."""
        self.ids[i] = sorted(self.ids[i] + list(slot_ids))
        if self.sched[i]:
            self._set(i, self.avail[i] + len(slot_ids))

    def level(self, i: int, overlay: Mapping[int, int] | None) -> int:
        """Slots available on node i in the state the overlay describes."""
        return self.avail[i] + (overlay.get(i, 0) if overlay else 0)

    def shares_of(self, nodes: Sequence[tuple[str, Sequence[int]]]) -> IndexShares:
        """(node name, slot ids) shares as (node index, slot ids), leaving out unknown nodes."""
        index = self.index
        if len(nodes) == 1:  # most running jobs: no generator
            (name, ids), = nodes
            return ((index[name], ids),) if name in index else ()
        return tuple((index[name], ids) for name, ids in nodes if name in index)

    def overlay_of(self, shares: Iterable[tuple[int, Sequence[int]]],
                   into: dict[int, int] | None = None) -> dict[int, int]:
        """{node index: slots} that these shares would give back (schedulable nodes only)."""
        delta = {} if into is None else into
        sched = self.sched
        for i, slot_ids in shares:
            if sched[i]:
                delta[i] = delta.get(i, 0) + len(slot_ids)
        return delta

    def count_fit(self, ppn: int, exclude=None, overlay: Mapping[int, int] | None = None) -> int:
        """How many schedulable nodes (not excluded) have at least ppn slots available (with overlay)."""
        if ppn > self.maxs:
            return 0
        if isinstance(exclude, PoolExclusion):
            return self._count_pool(ppn, exclude, overlay)
        c = self.ge[max(ppn, 0)]
        if overlay:
            for i, extra in overlay.items():
                a = self.avail[i]
                if self.sched[i] and a < ppn <= a + extra:
                    c += 1
        if exclude:
            for i in exclude:
                if self.sched[i] and self.level(i, overlay) >= ppn:
                    c -= 1
        return c

    def _count_pool(self, ppn: int, exclude: PoolExclusion, overlay: Mapping[int, int] | None) -> int:
        pool = exclude.pool
        c = self.pool_ge[pool][max(ppn, 0)]
        if overlay:
            for i, extra in overlay.items():
                a = self.avail[i]
                if self.sched[i] and a < ppn <= a + extra and pool in self.pool_of[i]:
                    c += 1
        for i in exclude.extra:
            if self.sched[i] and self.level(i, overlay) >= ppn:
                c -= 1
        return c

    def limited(self, ppn: int, exclude, overlay, limit) -> int:
        """How many of the nodes count_fit counts the limit keeps the job off."""
        if not limit:
            return 0
        sched, avail = self.sched, self.avail
        return sum(1 for i, cap in limit.items()
                   if cap < ppn and sched[i] and avail[i] + (overlay.get(i, 0) if overlay else 0) >= ppn
                   and not (exclude and i in exclude))

    def _walk(self, ppn: int, buckets: list[list[int]], og: dict[int, list[int]] | None, overlay, exclude, limit):
        """(level, node) candidates holding ppn slots, fullest first (best fit); at equal level the
        nodes that are busiest now (those the overlay frees) first, then by name: a reservation
        made on a future state takes the nodes that will free up, and leaves the ones free now
        to backfill."""
        for k in range(ppn, self.maxs + 1):
            if og:
                for i in og.get(k, ()):
                    if exclude and i in exclude:
                        continue
                    if limit and i in limit and limit[i] < ppn:
                        continue
                    yield k, i
            for i in buckets[k] if k else sorted_bucket(buckets, 0):
                if overlay and i in overlay:
                    continue
                if exclude and i in exclude:
                    continue
                if limit and i in limit and limit[i] < ppn:
                    continue
                yield k, i

    def _levels(self, overlay: Mapping[int, int], ppn: int, by_rack: bool) -> tuple[dict, dict, dict]:
        """The overlay's schedulable nodes by their level (avail + extra), each list by (avail, node):
        over the cluster, per rack (when `by_rack`), and per rack how many reach ppn."""
        og: dict[int, list[int]] = {}
        rog: dict[str, dict[int, list[int]]] = {}
        fit: dict[str, int] = {}
        avail, sched, rack_of = self.avail, self.sched, self.rack_of
        for i in sorted(sorted(overlay), key=avail.__getitem__):  # by (avail, node)
            if not sched[i]:
                continue
            k = avail[i] + overlay[i]
            og.setdefault(k, []).append(i)
            rack = rack_of[i]
            if by_rack and rack is not None:
                rog.setdefault(rack, {}).setdefault(k, []).append(i)
                if k >= ppn:
                    fit[rack] = fit.get(rack, 0) + 1
        return og, rog, fit

    def choose(self, n: int, ppn: int, exclude=None, limit: Mapping[int, int] | None = None,
               overlay: Mapping[int, int] | None = None) -> list[int] | None:
        """Nodes for a gang of n shares of ppn slots, or None: best fit, one rack first."""
        if n * ppn > self.total + (sum(overlay.values()) if overlay else 0) or ppn > self.maxs:
            return None
        if not (exclude or overlay) and self.ge[max(ppn, 0)] < n:
            return None  # too few nodes hold ppn, whatever the limit
        kept_off = self.limited(ppn, exclude, overlay, limit) if limit else 0
        if not kept_off:
            limit = None  # it keeps the job off no node that could take a share: the walk skips none
        if not (exclude or limit or overlay):  # the common case: no per-node conditions
            if self.ge[ppn] < n:
                return None
            if n == 1 and ppn > 0:
                for k in range(ppn, self.maxs + 1):
                    b = self.buckets[k]
                    if b:
                        return [b[0]]
        elif self.count_fit(ppn, exclude, overlay) - kept_off < n:
            return None  # not enough nodes, the limit's included: no walk (it would find none)
        by_rack = n > 1 and self.racks
        og, rog, rog_fit = self._levels(overlay, ppn, by_rack) if overlay else (None, None, {})
        if by_rack:
            best = None
            # at most rack_ge[ppn] nodes of a rack, plus those the overlay lifts to ppn, can take a share
            for rack in [r for r, ge in self.rack_ge.items()
                         if ge[ppn] >= n or (r in rog_fit and ge[ppn] + rog_fit[r] >= n)]:
                rb = self.racks[rack]
                picked, cost = [], 0
                for k, i in self._walk(ppn, rb, rog.get(rack) if rog else None, overlay, exclude, limit):
                    picked.append(i)
                    cost += k
                    if len(picked) == n:
                        break
                if len(picked) == n and (best is None or cost < best[0]):
                    best = (cost, picked)
            if best is not None:
                return sorted(best[1])
        picked = []
        for _, i in self._walk(ppn, self.buckets, og, overlay, exclude, limit):
            picked.append(i)
            if len(picked) == n:
                return sorted(picked)
        return None


class OverlayCounts:
    """A standing overlay on FreeSlots (the slots the jobs ending by a tick's reclaim deadline give
    back; tick.py's `_TickEnds`) and FreeSlots.count_fit(ppn, exclude, overlay=self.delta), but in O(1) plus the excluded
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


def fits_cluster(nodes: Iterable[NodeState], nodes_needed: int, procs_per_node: int) -> bool:
    """Could the job ever run on these nodes (all of them empty), whatever their status?"""
    return sum(1 for n in nodes if n.slots >= procs_per_node) >= nodes_needed


def fit_counts(nodes: Iterable[NodeState]) -> list[int]:
    """[k] = how many schedulable nodes have at least k slots (empty), k = 0..max slots: "could
    the job ever fit on today's schedulable nodes" in O(1)."""
    sizes = [n.slots for n in nodes if n.schedulable]
    out = [0] * (max(sizes, default=0) + 1)
    for s in sizes:
        out[s] += 1
    for k in range(len(out) - 2, -1, -1):
        out[k] += out[k + 1]
    return out


def _ever(fit_count: list[int], nodes: int, ppn: int, skip: int = 0) -> bool:
    return ppn < len(fit_count) and fit_count[max(ppn, 0)] - skip >= nodes


class Eligibility:
    """Per job requirement (device, GPU memory, labels; eligibility.py): the node indices (as
    FreeSlots numbers them) a job may never use, and "could it ever fit" counts over the rest.
    Computed once per distinct requirement in a tick; a plain cpu job costs nothing."""

    def __init__(self, free: FreeSlots, nodes: Iterable[NodeState]):
        self.free = free
        self.nodes = [None] * len(free.names)
        for n in nodes:
            self.nodes[free.index[n.name]] = n
        self.fit_all = fit_counts(nodes)
        # a pool's seats (NodeState.pool) are off limits to every job not of that pool
        self.pools = any(n is not None and n.pool for n in self.nodes)
        self.cache: dict[tuple, tuple[PoolExclusion | None, list[int]]] = {}

    def of(self, job: QueuedJob) -> tuple[PoolExclusion | None, list[int]]:
        """(ineligible node indices or None, fit counts over the eligible schedulable nodes)."""
        if not restricted(job) and not self.pools:
            return None, self.fit_all
        key = (job.device, job.gpu_memory_bytes, job.labels, job.pool)
        got = self.cache.get(key)
        if got is None:
            ok = [eligible(n, job) for n in self.nodes]
            hard = [i for i, yes in enumerate(ok) if not yes]
            exclude = PoolExclusion(hard, self.free.add_pool(i for i, yes in enumerate(ok) if yes)) if hard else None
            got = (exclude, fit_counts(n for n, yes in zip(self.nodes, ok) if yes))
            self.cache[key] = got
        return got


def exclusion(free: FreeSlots, fit_count: list[int], job: QueuedJob,
              hard: PoolExclusion | None = None) -> tuple[set[int] | None, bool, bool]:
    """(node indices to keep the job off, could it ever fit on today's schedulable nodes, does
    it avoid nodes): the nodes it may never use (`hard`, with `fit_count` counted over the
    others), plus those it should avoid, unless avoiding them would leave it no way to fit."""
    ever = _ever(fit_count, job.nodes, job.procs_per_node)
    if not ever:
        return None, False, False
    avoid = ({free.index[a] for a in job.avoid if a in free.index} - (hard or set())) if job.avoid else set()
    skip = sum(1 for i in avoid if free.sched[i] and free.capacity[i] >= job.procs_per_node)
    if not (avoid and _ever(fit_count, job.nodes, job.procs_per_node, skip)):
        return hard, True, False
    if isinstance(hard, PoolExclusion):
        return PoolExclusion(hard | avoid, hard.pool, avoid), True, True
    return set(avoid) | set(hard or ()), True, True


def reserve(free: FreeSlots, nodes: int, ppn: int, exclude,
            ends: Iterable[tuple[float, IndexShares]]) -> tuple[float, dict[int, int]] | None:
    """The EASY reservation of a gang of `nodes` x `ppn` slots: (shadow time, {reserved node
    index: spare slots}), or None when it would not fit even after every end. `ends` are the
    expected ends of the jobs holding slots, (end, their shares), in order of end."""
    delta: dict[int, int] = {}
    count = free.count_fit(ppn, exclude)
    avail, sched = free.avail, free.sched
    for end, shares in ends:
        for i, slot_ids in shares:
            if not sched[i]:
                continue
            before = avail[i] + delta.get(i, 0)
            delta[i] = delta.get(i, 0) + len(slot_ids)
            if before < ppn <= before + len(slot_ids) and not (exclude and i in exclude):
                count += 1
        if count >= nodes:
            plan = free.choose(nodes, ppn, exclude, overlay=delta)
            if plan is not None:
                return end, {i: free.level(i, delta) - ppn for i in plan}
    return None
