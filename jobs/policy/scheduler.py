"""Scheduling policy: queue order, gang placement, quotas, backfill, reclaim and start-time
predictions. A pure function of a cluster snapshot: `ClusterView` in, `Decision` out (frozen
dataclasses, no Django, no I/O), fast enough to run every tick (10,000 queued jobs on 1,000
nodes in well under a second; see bench/scheduler.py).

Policies (`ClusterView.policy`):

- ``fifo``: strict first come first served by submission time (priorities ignored, like Kueue's
  StrictFIFO). The head of the queue blocks everyone behind it.
- ``backfill``: FIFO order with EASY backfilling on the jobs' `predicted_s` (the simulator gives
  it the users' declared estimates).
- ``trainyard`` (the default): jobs within their team's quota before borrowers; within each
  group priority, then weighted fair share, then predicted shortest job first (with aging), then
  FIFO; EASY backfilling on predicted run times; quotas with borrowing and reclaim.

Queue order (trainyard). The queue is split in two groups: first every job that fits its
team's entitlement (walking the order below, each team's within-quota running slots plus the
jobs already counted; teams without a quota are always in this group), then the borrowers.
Entitlements are guarantees, so a borrower never takes slots ahead of an entitled job, even
one of lower priority in another team — otherwise the entitled job would reclaim them at once
and the two would swap forever (measured: ~1,000 preemptions per 1,500-job trace before this
rule, ~10-100 after). Within each group: priority (high first); within a priority level teams
take turns by fair share: the next job comes from the team with the lowest
`(usage + committed) / entitlement`, where `usage` is the team's decayed slot-seconds
(`ClusterView.usage`, see fairshare.py), `committed` the slot-seconds its running jobs are
still predicted to use (each capped at one half-life), and the entitlement its quota (a team
without one: an equal share of the schedulable slots among the teams with work). Every job
taken adds its own slots x predicted seconds (capped the same way) to its team's total, so one
team's hundred queued jobs interleave with another's instead of all going first. Within a
team: shortest predicted run first, aged so long jobs cannot starve: the sort key is
`predicted_s / (1 + wait_s / AGING_S)` (a job's effective length halves after an hour of
waiting and is a tenth after nine), then submission, then id.

Placement is gang (every process of a job, or none): one share of `procs_per_node` slots on
each of `nodes` distinct schedulable nodes. Best fit: single-node jobs go to the node with the
fewest free slots that still holds them (ties by name), so whole nodes stay free for large jobs.
Multi-node jobs go to one rack when some rack (`NodeState.rack`) can hold them all (the rack
whose chosen nodes leave the fewest free slots), else best fit over the whole cluster. Nodes
that are not schedulable (DRAINING, CORDONED, QUARANTINED, LOST) take no new work. A restarted
job avoids the nodes its last failure implicated (`avoid`) unless it could never fit on the
others. A job that could not fit even on empty copies of today's schedulable nodes waits
("waiting for nodes") without blocking anyone.

Backfill (EASY). The first job in order that cannot start becomes the *head* and gets a
reservation: its shadow time (when enough running jobs will have ended, by their predicted
ends, for it to fit) and the nodes it will use then. A later job may start now only if it
ends (now + predicted_s) by the shadow time, or uses only slots of the reserved nodes that the
head will not need (per-node spare). So a backfilled job never delays the head's predicted
start. The reservation takes, among equally good nodes, those that are busy now and will have
freed up by then, so that nodes free now stay available to backfill. A running job past its
predicted end is assumed to run on for half the time it has run (`OVERDUE_FACTOR`); one that
is stopping (`preemptible=False`) to end `STOP_GRACE_S` from now. When the head cannot fit even
after every known running job ends (slots held by something the view does not describe), the
queue is strict behind it. Under ``fifo`` nobody passes the head.

Quotas. `Quotas.team_slots` are entitlements in slots. A team's running jobs are classified
each tick from the current quotas: in start order (oldest first), a job is within quota when
the team's within-quota slots so far plus its own fit the quota, otherwise it is *borrowing*
(so lowering a quota turns the newest jobs beyond it into borrowers). Jobs being stopped do
not count. A placement is borrowing when the team's within-quota slots plus the job's exceed
its quota; borrowing only ever uses idle slots (it never preempts). A team absent from
`team_slots` has no quota: never borrowing, never reclaimed. `user_slots` are hard caps on a
user's running slots. A team or user (``"user:<name>"``) in `over_budget` has spent its
device-hours for the window: its jobs wait.

Reclaim (trainyard). When a job of a team within its quota (within-quota slots + the job's
<= quota) cannot start now, and would not fit either once the running jobs predicted to end
within `RECLAIM_WAIT_S` have ended, borrowing jobs of *other* teams are preempted until it
fits, topology included. Victims may have any priority (what they hold is beyond their own
team's entitlement); candidates in order lowest priority first, then most recently started
(least work lost), then largest; taken until the job fits, then pruned (each earlier choice
dropped if the job still fits without it), so the set is minimal in that order. Nothing is
preempted when even all candidates would not make it fit. Preemption is
cooperative: the victims checkpoint and exit later. Until then the view carries them as
`preemptible=False` with `preempted_for` set, and each tick first considers the jobs
preemptions are in flight for: such a job starts as soon as it fits, and meanwhile holds the
free slots its planned placement needs, so nobody backfills into them and it is never
reclaimed for twice.

Start-time predictions (`predict_starts`): see its docstring.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from .fairshare import DEFAULT_HALF_LIFE_S, entitlements

POLICIES = ("fifo", "backfill", "trainyard")
# A running job past its predicted end: its prediction was wrong, and with heavy-tailed run
# times the longer a job has run the longer it is likely to go on (a job 2 h into a predicted
# 1 h is more likely a 4 h job than one about to end). Assume it runs on for half of the time it
# has run so far, and at least OVERDUE_GRACE_S.
OVERDUE_GRACE_S = 60.0
OVERDUE_FACTOR = 0.5
# A job being stopped (preempted or cancelled): the runtime saves a checkpoint and exits; its
# slots are expected back this long from now (an assumption, generous for the demo models).
STOP_GRACE_S = 30.0
# Reclaim only when the within-quota job would otherwise wait longer than this for running jobs
# to end by their predicted times: preempting costs the victim the work since its last
# checkpoint (10 minutes at most with the default cadence) and a restart, so it only pays when
# the wait it saves is longer.
RECLAIM_WAIT_S = 600.0
# Aging of the shortest-job-first key: predicted_s / (1 + wait_s / AGING_S).
AGING_S = 3600.0
# predict_starts: how many queued jobs behind the head the forward simulation considers for
# backfill at each event (like Slurm's bf_max_job_test; deeper jobs wait their turn).
ETA_DEPTH = 64


# ---------------------------------------------------------------- the contract

@dataclass(frozen=True)
class NodeState:
    name: str
    address: str
    slots: int
    used_slot_ids: frozenset[int]
    schedulable: bool = True  # READY and not quarantined; DRAINING/CORDONED/QUARANTINED/LOST take no new work
    rack: str | None = None   # the node's `rack` label

    @property
    def free_slot_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.slots) if i not in self.used_slot_ids)


@dataclass(frozen=True)
class QueuedJob:
    id: int
    priority: int
    nodes: int
    procs_per_node: int
    avoid: frozenset[str] = frozenset()  # nodes a restart should avoid if it can
    team: str | None = None
    user: str = ""
    submitted_at: float = 0.0   # epoch s
    predicted_s: float = 3600.0  # predicted run time (predictor.py)

    @property
    def slots(self) -> int:
        return self.nodes * self.procs_per_node


@dataclass(frozen=True)
class RunningJob:
    id: int
    team: str | None
    user: str
    slots: int
    priority: int
    nodes: tuple[tuple[str, tuple[int, ...]], ...]  # (node name, slot ids) per share
    started_at: float
    predicted_end: float
    preemptible: bool = True          # False while it is being preempted or stopped
    preempted_for: int | None = None  # the queued job an in-flight preemption frees its slots for


@dataclass(frozen=True)
class Quotas:
    team_slots: Mapping[str, int] = field(default_factory=dict)  # entitlement per team; absent = no quota
    user_slots: Mapping[str, int] = field(default_factory=dict)  # hard cap per user; absent = none
    over_budget: frozenset[str] = frozenset()  # teams, and "user:<name>", whose device-hours are spent


@dataclass(frozen=True)
class ClusterView:
    now: float
    nodes: tuple[NodeState, ...]
    running: tuple[RunningJob, ...] = ()
    queue: tuple[QueuedJob, ...] = ()
    quotas: Quotas = Quotas()
    usage: Mapping[str, float] = field(default_factory=dict)  # decayed slot-seconds per team (fairshare.py)
    policy: str = "trainyard"  # fifo | backfill | trainyard
    half_life_s: float = DEFAULT_HALF_LIFE_S  # caps the slot-seconds a job adds to its team's fair-share total
    reclaim_wait_s: float = RECLAIM_WAIT_S  # see RECLAIM_WAIT_S (settings.TRAINYARD_RECLAIM_WAIT_S)


@dataclass(frozen=True)
class Share:
    node: str
    address: str
    node_rank: int
    slot_ids: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    job_id: int
    shares: tuple[Share, ...]
    borrowing: bool = False


@dataclass(frozen=True)
class Preemption:
    job_id: int
    reason: str  # shown on the job page
    for_job: int | None


@dataclass(frozen=True)
class Decision:
    placements: tuple[Placement, ...]
    preemptions: tuple[Preemption, ...] = ()
    waiting: dict = field(default_factory=dict)  # job id -> human reason it did not start
    order: tuple[int, ...] = ()  # queue order used (position = index + 1)
    borrowing: frozenset[int] = frozenset()  # running jobs borrowing under the current quotas


# ---------------------------------------------------------------- free slots

class _Free:
    """Free slots per node, bucketed by how many are available, for best fit in O(slots per node).

    Nodes are indexed in name order; `buckets[k]` is the sorted list of schedulable nodes with
    exactly k available slots (free minus `hold`s), and per rack the same. An *overlay*
    ({node index: extra slots}) describes a hypothetical state (slots that running jobs will
    free) without copying; a *limit* ({node index: max slots}) caps what a job may take there.
    """

    __slots__ = ("names", "index", "address", "sched", "capacity", "ids", "avail", "maxs", "buckets",
                 "rack_of", "racks", "total", "ge")

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
        self.buckets: list[list[int]] = [[] for _ in range(self.maxs + 1)]
        self.rack_of = [n.rack if n.schedulable else None for n in nodes]
        self.racks: dict[str, list[list[int]]] = {}
        for i, (a, ok, rack) in enumerate(zip(self.avail, self.sched, self.rack_of)):
            if not ok:
                continue
            self.buckets[a].append(i)
            if rack is not None:
                if rack not in self.racks:
                    self.racks[rack] = [[] for _ in range(self.maxs + 1)]
                self.racks[rack][a].append(i)
        self.racks = dict(sorted(self.racks.items()))
        self.total = sum(self.avail)
        # ge[k]: schedulable nodes with at least k slots available (k = 0..maxs, plus a 0 past the end)
        self.ge = [0] * (self.maxs + 2)
        for k in range(self.maxs, -1, -1):
            self.ge[k] = self.ge[k + 1] + len(self.buckets[k])

    def _set(self, i: int, new: int) -> None:
        old = self.avail[i]
        if old == new:
            return
        b = self.buckets[old]
        del b[bisect_left(b, i)]
        insort(self.buckets[new], i)
        ge = self.ge
        if new > old:
            for k in range(old + 1, new + 1):
                ge[k] += 1
        else:
            for k in range(new + 1, old + 1):
                ge[k] -= 1
        rack = self.rack_of[i]
        if rack is not None:
            rb = self.racks[rack]
            del rb[old][bisect_left(rb[old], i)]
            insort(rb[new], i)
        self.avail[i] = new
        self.total += new - old

    def take(self, i: int, k: int) -> tuple[int, ...]:
        ids = self.ids[i]
        got = tuple(ids[:k])
        del ids[:k]
        self._set(i, self.avail[i] - k)
        return got

    def hold(self, i: int, k: int) -> None:
        """Keep k available slots of node i from anyone else this tick."""
        self._set(i, self.avail[i] - k)

    def release(self, i: int, slot_ids: Sequence[int]) -> None:
        self.ids[i] = sorted(self.ids[i] + list(slot_ids))
        if self.sched[i]:
            self._set(i, self.avail[i] + len(slot_ids))

    def level(self, i: int, overlay: Mapping[int, int] | None) -> int:
        return self.avail[i] + (overlay.get(i, 0) if overlay else 0)

    def count_fit(self, ppn: int, exclude=None, overlay: Mapping[int, int] | None = None) -> int:
        """How many schedulable nodes (not excluded) have at least ppn slots available (with overlay)."""
        if ppn > self.maxs:
            return 0
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
            for i in buckets[k]:
                if overlay and i in overlay:
                    continue
                if exclude and i in exclude:
                    continue
                if limit and i in limit and limit[i] < ppn:
                    continue
                yield k, i

    def choose(self, n: int, ppn: int, exclude=None, limit: Mapping[int, int] | None = None,
               overlay: Mapping[int, int] | None = None) -> list[int] | None:
        """Nodes for a gang of n shares of ppn slots, or None: best fit, one rack first."""
        if n * ppn > self.total + (sum(overlay.values()) if overlay else 0) or ppn > self.maxs:
            return None
        if not (exclude or limit or overlay):  # the common case: no per-node conditions
            if self.ge[ppn] < n:
                return None
            if n == 1:
                for k in range(ppn, self.maxs + 1):
                    b = self.buckets[k]
                    if b:
                        return [b[0]]
        elif self.count_fit(ppn, exclude, overlay) < n:
            return None
        og = rog = None
        if overlay:
            og, rog = {}, {}
            for i in sorted(overlay, key=lambda i: (self.avail[i], i)):
                if not self.sched[i]:
                    continue
                k = self.avail[i] + overlay[i]
                og.setdefault(k, []).append(i)
                if self.rack_of[i] is not None:
                    rog.setdefault(self.rack_of[i], {}).setdefault(k, []).append(i)
        if n > 1 and self.racks:
            best = None
            for rack, rb in self.racks.items():
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


# ---------------------------------------------------------------- helpers

def fits_cluster(nodes: Iterable[NodeState], nodes_needed: int, procs_per_node: int) -> bool:
    """Could the job ever run on these nodes (all of them empty), whatever their status?"""
    return sum(1 for n in nodes if n.slots >= procs_per_node) >= nodes_needed


def _fmt_s(s: float) -> str:
    if s < 90:
        return "a minute" if s >= 30 else "under a minute"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def _fit_counts(nodes: Iterable[NodeState]) -> list[int]:
    """[k] = how many schedulable nodes have at least k slots (empty), k = 0..max slots."""
    sizes = [n.slots for n in nodes if n.schedulable]
    out = [0] * (max(sizes, default=0) + 1)
    for s in sizes:
        out[s] += 1
    for k in range(len(out) - 2, -1, -1):
        out[k] += out[k + 1]
    return out


def _expected_end(r: RunningJob, now: float) -> float:
    if not r.preemptible:
        return min(r.predicted_end, now + STOP_GRACE_S) if r.predicted_end > now else now + STOP_GRACE_S
    if r.predicted_end > now:
        return r.predicted_end
    return now + max(OVERDUE_GRACE_S, OVERDUE_FACTOR * (now - r.started_at))


def running_borrowing(running: Iterable[RunningJob], team_slots: Mapping[str, int]) -> frozenset[int]:
    """Running jobs that are borrowing under the current quotas: per team in start order, a job
    stays within quota while the team's within-quota slots plus its own fit the quota (jobs
    being stopped are left out)."""
    return frozenset(_classify(running, team_slots)[0])


def _classify(running: Iterable[RunningJob], team_slots: Mapping[str, int]):
    borrowing: set[int] = set()
    within: dict[str | None, int] = {}
    for r in sorted(running, key=lambda r: (r.started_at, r.id)):
        if not r.preemptible or r.team not in team_slots:
            continue
        used = within.get(r.team, 0)
        if used + r.slots <= team_slots[r.team]:
            within[r.team] = used + r.slots
        else:
            borrowing.add(r.id)
    return borrowing, within


def team_usage(view: ClusterView) -> dict:
    """Per team: {"quota": slots or None, "in_use": running slots, "borrowed": running slots
    beyond the quota (see running_borrowing), "queued": queued slots} — for the quota page."""
    q = view.quotas.team_slots
    borrowing = running_borrowing(view.running, q)
    out: dict = {}

    def row(t):
        return out.setdefault(t, {"quota": q.get(t) if t is not None else None, "in_use": 0, "borrowed": 0,
                                  "queued": 0})
    for t in q:
        row(t)
    for r in view.running:
        row(r.team)["in_use"] += r.slots
        if r.id in borrowing:
            row(r.team)["borrowed"] += r.slots
    for j in view.queue:
        row(j.team)["queued"] += j.slots
    return out


# ---------------------------------------------------------------- queue order

def _as_view(view_or_jobs) -> ClusterView:
    if isinstance(view_or_jobs, ClusterView):
        return view_or_jobs
    return ClusterView(0.0, (), (), tuple(view_or_jobs))


def queue_order(view_or_jobs: ClusterView | Iterable[QueuedJob]) -> list[QueuedJob]:
    """The queue in the order the policy considers it (queue positions are index + 1). Given a
    bare list of jobs, orders it as `trainyard` with no usage and no running jobs."""
    view = _as_view(view_or_jobs)
    if view.policy not in POLICIES:
        raise ValueError(f"unknown policy {view.policy!r}; one of {', '.join(POLICIES)}")
    if view.policy != "trainyard":
        return sorted(view.queue, key=lambda j: (j.submitted_at, j.id))
    now, horizon = view.now, view.half_life_s
    teams = {j.team for j in view.queue} | {r.team for r in view.running}
    total = sum(n.slots for n in view.nodes if n.schedulable) or 1
    ent = {t: max(e, 0.01) for t, e in entitlements(view.quotas.team_slots, teams, total).items()}
    score = {t: float(view.usage.get(t, 0.0)) for t in teams}
    for r in view.running:
        score[r.team] += r.slots * min(max(r.predicted_end - now, 0.0), horizon)
    groups: dict[int, dict[str | None, list]] = {}
    for j in view.queue:
        wait = now - j.submitted_at
        key = j.predicted_s / (1.0 + wait / AGING_S) if wait > 0 else j.predicted_s
        groups.setdefault(j.priority, {}).setdefault(j.team, []).append((key, j.submitted_at, j.id, j))
    team_q = view.quotas.team_slots
    within = dict(_classify(view.running, team_q)[1])
    out: list[QueuedJob] = []
    borrowers: list[QueuedJob] = []
    for prio in sorted(groups, reverse=True):
        heap = []
        for t, jobs in groups[prio].items():
            jobs.sort(key=lambda x: x[:3], reverse=True)  # pop() from the end takes the next
            heap.append((score[t] / ent[t], "" if t is None else t, t))
        heapq.heapify(heap)
        while heap:
            _, name, t = heap[0]
            jobs = groups[prio][t]
            j = jobs.pop()[3]
            if t in team_q and within.get(t, 0) + j.slots > team_q[t]:
                borrowers.append(j)
            else:
                out.append(j)
                if t in team_q:
                    within[t] = within.get(t, 0) + j.slots
            score[t] += j.slots * min(j.predicted_s, horizon)
            if jobs:
                heapq.heapreplace(heap, (score[t] / ent[t], name, t))
            else:
                heapq.heappop(heap)
    out += borrowers
    return out


# ---------------------------------------------------------------- one tick

@dataclass
class _Reservation:
    job: QueuedJob
    shadow: float | None  # None: cannot be predicted (strict behind it)
    spare: dict  # reserved node index -> slots later jobs running past the shadow may still take


class _Tick:
    def __init__(self, view: ClusterView):
        if view.policy not in POLICIES:
            raise ValueError(f"unknown policy {view.policy!r}; one of {', '.join(POLICIES)}")
        self.view = view
        self.now = view.now
        self.free = _Free(view.nodes)
        q = view.quotas
        self.team_q = q.team_slots
        self.caps = q.user_slots
        self.over = q.over_budget
        self.borrowing_running, self.within = _classify(view.running, self.team_q)
        self.team_total: dict[str | None, int] = {}
        self.user_run: dict[str, int] = {}
        for r in view.running:
            self.user_run[r.user] = self.user_run.get(r.user, 0) + r.slots
            if r.preemptible:
                self.team_total[r.team] = self.team_total.get(r.team, 0) + r.slots
        # capacity of schedulable nodes per slots-per-share, for "could it ever fit"
        self.fit_count = _fit_counts(view.nodes)
        self.placements: list[Placement] = []
        self.preemptions: list[Preemption] = []
        self.waiting: dict[int, str] = {}
        self.taken: set[int] = set()        # running jobs preempted this tick
        self.reclaim_failed: set = set()    # (team, nodes, ppn) that found no victims this tick
        self._candidates: list[RunningJob] | None = None
        self._sorted_ends: list | None = None
        self.placed_ends: list = []  # (end, job id, shares) of this tick's placements

    # -- gates
    def _gate(self, job: QueuedJob) -> str | None:
        if job.team is not None and job.team in self.over:
            return f"team {job.team} has used its device-hours for the current window"
        if job.user and f"user:{job.user}" in self.over:
            return f"user {job.user} has used their device-hours for the current window"
        cap = self.caps.get(job.user)
        if cap is not None:
            used = self.user_run.get(job.user, 0)
            if used + job.slots > cap:
                return (f"user {job.user} is at their cap: {used} of {cap} slot(s) in use, "
                        f"this job needs {job.slots}")
        return None

    def _ever(self, nodes: int, ppn: int, skip: int = 0) -> bool:
        fc = self.fit_count
        return ppn < len(fc) and fc[max(ppn, 0)] - skip >= nodes

    def _exclude(self, job: QueuedJob) -> tuple[set[int] | None, bool]:
        """(node indices to keep the job off, could it ever fit on today's schedulable nodes)."""
        ever = self._ever(job.nodes, job.procs_per_node)
        if not job.avoid or not ever:
            return None, ever
        free = self.free
        ex = {free.index[a] for a in job.avoid if a in free.index}
        skip = sum(1 for i in ex if free.sched[i] and free.capacity[i] >= job.procs_per_node)
        return (ex if ex and self._ever(job.nodes, job.procs_per_node, skip) else None), ever

    def _is_borrowing(self, job: QueuedJob) -> bool:
        q = self.team_q.get(job.team) if job.team is not None else None
        return q is not None and self.within.get(job.team, 0) + job.slots > q

    def _claim(self, job: QueuedJob, borrowing: bool) -> None:
        self.user_run[job.user] = self.user_run.get(job.user, 0) + job.slots
        self.team_total[job.team] = self.team_total.get(job.team, 0) + job.slots
        if not borrowing and job.team in self.team_q:
            self.within[job.team] = self.within.get(job.team, 0) + job.slots

    def _commit(self, job: QueuedJob, picked: list[int], borrowing: bool) -> None:
        f = self.free
        shares = tuple(Share(f.names[i], f.address[i], rank, f.take(i, job.procs_per_node))
                       for rank, i in enumerate(picked))
        self.placements.append(Placement(job.id, shares, borrowing))
        # it ends by its prediction too: a reservation made later in this tick counts on that
        self.placed_ends.append((self.now + max(job.predicted_s, 0.0), job.id,
                                 tuple((s.node, s.slot_ids) for s in shares)))
        self._claim(job, borrowing)

    # -- reclaim
    def _victims(self) -> list[RunningJob]:
        if self._candidates is None:
            self._candidates = sorted(
                (r for r in self.view.running if r.id in self.borrowing_running),
                key=lambda r: (r.priority, -r.started_at, -r.slots, -r.id))
        return self._candidates

    def _overlay_of(self, shares: Iterable[tuple[str, tuple[int, ...]]],
                    into: dict[int, int] | None = None) -> dict[int, int]:
        """{node index: slots} that these (node name, slot ids) shares would give back."""
        delta = {} if into is None else into
        idx, sched = self.free.index, self.free.sched
        for name, slot_ids in shares:
            i = idx.get(name)
            if i is not None and sched[i]:
                delta[i] = delta.get(i, 0) + len(slot_ids)
        return delta

    def _ends(self) -> list:
        """(expected end, job id, shares) of the running jobs and this tick's placements, by end;
        not the victims of in-flight or new preemptions (their slots go to the jobs they are for)."""
        if self._sorted_ends is None:
            self._sorted_ends = sorted(
                ((_expected_end(r, self.now), r.id, r.nodes) for r in self.view.running
                 if r.id not in self.taken and r.preempted_for is None),
                key=lambda x: x[:2])
        ends = [e for e in self._sorted_ends if e[1] not in self.taken]
        if self.placed_ends:
            ends = list(heapq.merge(ends, sorted(self.placed_ends, key=lambda x: x[:2]), key=lambda x: x[:2]))
        return ends

    def _fits_by(self, job: QueuedJob, exclude, deadline: float) -> bool:
        """Would the job fit once the jobs predicted to end by `deadline` have ended?"""
        delta: dict[int, int] = {}
        for end, _, shares in self._ends():
            if end > deadline:
                break
            self._overlay_of(shares, delta)
        return self.free.count_fit(job.procs_per_node, exclude, delta) >= job.nodes

    def _reclaim(self, job: QueuedJob, exclude) -> tuple[list[RunningJob], dict[int, int]] | None:
        key = (job.team, job.nodes, job.procs_per_node)
        if not exclude and key in self.reclaim_failed:
            return None
        if self._fits_by(job, exclude, self.now + self.view.reclaim_wait_s):
            return None
        cands = [r for r in self._victims()
                 if r.id not in self.taken and r.team != job.team]
        if not cands or self.free.total + sum(r.slots for r in cands) < job.slots:
            if not exclude:
                self.reclaim_failed.add(key)
            return None
        f, n, ppn = self.free, job.nodes, job.procs_per_node
        chosen: list[RunningJob] = []
        delta: dict[int, int] = {}
        for r in cands:
            chosen.append(r)
            self._overlay_of(r.nodes, delta)
            if f.count_fit(ppn, exclude, delta) >= n:
                break
        else:
            if not exclude:
                self.reclaim_failed.add(key)
            return None
        for r in reversed(chosen[:-1]):  # prune: drop earlier choices the job fits without
            rest = [c for c in chosen if c is not r]
            d2 = self._overlay_of(s for c in rest for s in c.nodes)
            if f.count_fit(ppn, exclude, d2) >= n:
                chosen, delta = rest, d2
        return chosen, delta

    def _hold_plan(self, job: QueuedJob, exclude, delta: dict[int, int]) -> bool:
        plan = self.free.choose(job.nodes, job.procs_per_node, exclude, overlay=delta)
        if plan is None:
            return False
        for i in plan:
            self.free.hold(i, min(job.procs_per_node, self.free.avail[i]))
        return True

    # -- EASY reservation
    def _reserve(self, job: QueuedJob, exclude) -> _Reservation:
        f, n, ppn = self.free, job.nodes, job.procs_per_node
        delta: dict[int, int] = {}
        count = f.count_fit(ppn, exclude)
        for end, _, shares in self._ends():
            for name, slot_ids in shares:
                i = f.index.get(name)
                if i is None or not f.sched[i]:
                    continue
                before = f.avail[i] + delta.get(i, 0)
                delta[i] = delta.get(i, 0) + len(slot_ids)
                if before < ppn <= before + len(slot_ids) and not (exclude and i in exclude):
                    count += 1
            if count >= n:
                plan = f.choose(n, ppn, exclude, overlay=delta)
                if plan is not None:
                    return _Reservation(job, end, {i: f.level(i, delta) - ppn for i in plan})
        return _Reservation(job, None, {})

    # -- the pass
    def run(self) -> Decision:
        view, f = self.view, self.free
        order = queue_order(view)
        done: set[int] = set()
        inflight: dict[int, list[RunningJob]] = {}
        for r in view.running:
            if r.preempted_for is not None:
                inflight.setdefault(r.preempted_for, []).append(r)
        # 0. jobs that preemptions are in flight for: first claim on what is free, and on what their
        #    victims will free
        for job in (j for j in order if j.id in inflight):
            if self._gate(job) is not None:
                continue
            exclude, ever = self._exclude(job)
            if not ever:
                continue
            borrowing = self._is_borrowing(job)
            picked = f.choose(job.nodes, job.procs_per_node, exclude)
            if picked is not None:
                self._commit(job, picked, borrowing)
                done.add(job.id)
            elif self._hold_plan(job, exclude, self._overlay_of(s for r in inflight[job.id] for s in r.nodes)):
                self._claim(job, borrowing)
                self.waiting[job.id] = ("waiting for job(s) " + ", ".join(str(r.id) for r in inflight[job.id])
                                        + " to checkpoint and stop (preempted for this job)")
                done.add(job.id)
        head: _Reservation | None = None
        for job in order:
            if job.id in done:
                continue
            head = self._step(job, head)
        return Decision(tuple(self.placements), tuple(self.preemptions), self.waiting,
                        tuple(j.id for j in order), frozenset(self.borrowing_running))

    def _step(self, job: QueuedJob, head: _Reservation | None) -> _Reservation | None:
        f, pol = self.free, self.view.policy
        reason = self._gate(job)
        if reason:
            self.waiting[job.id] = reason
            return head
        exclude, ever = self._exclude(job)
        if not ever:
            self.waiting[job.id] = (f"needs {job.nodes} schedulable node(s) with {job.procs_per_node} "
                                    f"slot(s) each; waiting for nodes")
            return head
        if head is not None and (pol == "fifo" or head.shadow is None):
            self.waiting[job.id] = f"behind job {head.job.id} in the queue"
            return head
        borrowing = self._is_borrowing(job)
        limit = None
        if head is not None and self.now + job.predicted_s > head.shadow:
            limit = head.spare
        picked = f.choose(job.nodes, job.procs_per_node, exclude, limit)
        if picked is not None:
            self._commit(job, picked, borrowing)
            if limit:
                for i in picked:
                    if i in limit:
                        limit[i] -= job.procs_per_node
            return head
        if pol == "trainyard" and not borrowing and job.team in self.team_q:
            got = self._reclaim(job, exclude)
            if got is not None and self._hold_plan(job, exclude, got[1]):
                self._preempt(job, got[0])
                self._claim(job, borrowing)
                return head
        avoiding = f" (avoiding {', '.join(sorted(job.avoid))})" if exclude else ""
        if head is None:
            head = self._reserve(job, exclude)
            eta = (f"; expected to start in about {_fmt_s(head.shadow - self.now)}"
                   if head.shadow is not None and pol != "fifo" else "")
            self.waiting[job.id] = "waiting for free slots" + avoiding + eta
        elif limit and f.choose(job.nodes, job.procs_per_node, exclude) is not None:
            self.waiting[job.id] = (f"waiting: starting now would delay job {head.job.id}, which is "
                                    f"next{avoiding}")
        else:
            self.waiting[job.id] = f"waiting for free slots (job {head.job.id} is next){avoiding}"
        return head

    def _preempt(self, job: QueuedJob, victims: list[RunningJob]) -> None:
        quota = self.team_q[job.team]
        for r in victims:
            self.taken.add(r.id)
            q = self.team_q.get(r.team, 0)
            over = self.team_total.get(r.team, 0) - q
            self.preemptions.append(Preemption(r.id, (
                f"reclaimed: team {job.team} needs its quota back for job {job.id} "
                f"(team {r.team} is {over} slot(s) over its quota of {q}; team {job.team}'s quota is {quota})"),
                job.id))
            self.team_total[r.team] = self.team_total.get(r.team, 0) - r.slots
        self.waiting[job.id] = ("reclaiming quota: preempting borrowing job(s) "
                                + ", ".join(str(r.id) for r in victims))


def schedule(view: ClusterView | Iterable[NodeState], queue: Iterable[QueuedJob] | None = None) -> Decision:
    """One scheduling tick. `schedule(nodes, queue)` (the old call) means a view at time 0 with
    no running jobs, no quotas and the trainyard policy."""
    if queue is not None:
        view = ClusterView(0.0, tuple(view), (), tuple(queue))
    return _Tick(view).run()


# ---------------------------------------------------------------- start-time predictions

def _sorted_walk(heap: list):
    """Yield a binary heap's items in order without changing it: O(k log k) for the first k."""
    if not heap:
        return
    frontier = [(heap[0], 0)]
    n = len(heap)
    while frontier:
        item, i = heapq.heappop(frontier)
        yield item
        for c in (2 * i + 1, 2 * i + 2):
            if c < n:
                heapq.heappush(frontier, (heap[c], c))


def predict_starts(view: ClusterView, *, depth: int = ETA_DEPTH, max_jobs: int | None = None) -> dict[int, float]:
    """Predicted start (epoch s) per queued job: the policy run forward in time over predicted
    run times. Event-driven: time jumps from one predicted end to the next (a heap of running
    jobs' ends, overdue and stopping ones as in `schedule`); at each event the queue is walked
    in `queue_order` with the same gang/best-fit/rack placement and EASY rule as `schedule`:
    the head starts when it fits; its shadow time comes from walking the heap of ends lazily
    (no re-sort), and only the next `depth` jobs behind it are considered for backfill at each
    event (deeper ones move up as jobs start, like Slurm's bf_max_job_test). Jobs that
    preemptions are in flight for go first. Users' caps are honoured (a capped job waits for
    its user's jobs to end). No new preemptions are assumed, and the order is today's.

    Cost: O((R + Q) log R) heap work plus O(depth) per event for backfill, not a re-run of
    `schedule` per event: 10,000 queued jobs behind 6,400 running ones on 1,000 nodes take
    1-2 s on the 2-core dev machine (bench/scheduler.py; a tick takes ~0.2 s), so the services
    refresh the ETAs every few seconds outside the tick (beat), write only those that moved
    (`eta_changes`), and can use `max_jobs`, which stops once the first N jobs in order have
    theirs (500: ~0.4 s), for a quicker refresh of the front of the queue.

    Jobs with no prediction are left out: over budget, over their user's cap on their own, or
    never fitting on today's schedulable nodes."""
    now = view.now
    f = _Free(view.nodes)
    caps, over = view.quotas.user_slots, view.quotas.over_budget
    user_run: dict[str, int] = {}
    ends: list = []
    for seq, r in enumerate(view.running):
        user_run[r.user] = user_run.get(r.user, 0) + r.slots
        shares = tuple((f.index[name], ids) for name, ids in r.nodes if name in f.index)
        ends.append((_expected_end(r, now), seq, r.user, r.slots, shares))
    heapq.heapify(ends)
    seq = len(ends)
    inflight = {r.preempted_for for r in view.running if r.preempted_for is not None}
    order = queue_order(view)
    if inflight:
        order = [j for j in order if j.id in inflight] + [j for j in order if j.id not in inflight]
    tick = _Tick.__new__(_Tick)  # reuse its avoid/fit helpers without building a whole tick
    tick.free = f
    tick.fit_count = _fit_counts(view.nodes)
    jobs: list[QueuedJob] = []
    excl: list = []
    for j in order:
        if (j.team is not None and j.team in over) or (j.user and f"user:{j.user}" in over):
            continue
        if caps.get(j.user) is not None and j.slots > caps[j.user]:
            continue
        ex, ever = tick._exclude(j)
        if ever:
            jobs.append(j)
            excl.append(ex)
    eta: dict[int, float] = {}
    window: list[int] = []
    nxt = 0
    deferred: dict[str, list[int]] = {}
    head = None  # [job index, shadow, spare]
    t = now

    def start(idx: int, picked: list[int]) -> None:
        nonlocal seq
        j = jobs[idx]
        shares = tuple((i, f.take(i, j.procs_per_node)) for i in picked)
        eta[j.id] = t
        user_run[j.user] = user_run.get(j.user, 0) + j.slots
        seq += 1
        heapq.heappush(ends, (t + max(j.predicted_s, 1.0), seq, j.user, j.slots, shares))

    def reserve(idx: int):
        j, ex = jobs[idx], excl[idx]
        n, ppn = j.nodes, j.procs_per_node
        delta: dict[int, int] = {}
        count = f.count_fit(ppn, ex)
        for end, _, _, _, shares in _sorted_walk(ends):
            for i, ids in shares:
                if not f.sched[i]:
                    continue
                before = f.avail[i] + delta.get(i, 0)
                delta[i] = delta.get(i, 0) + len(ids)
                if before < ppn <= before + len(ids) and not (ex and i in ex):
                    count += 1
            if count >= n:
                plan = f.choose(n, ppn, ex, overlay=delta)
                if plan is not None:
                    return [idx, end, {i: f.level(i, delta) - ppn for i in plan}]
        return None

    slots_of = [j.slots for j in jobs]
    shape_of = [(j.nodes, j.procs_per_node) for j in jobs]
    pred_of = [j.predicted_s for j in jobs]
    capped = [j.user in caps for j in jobs]
    choose = f.choose
    while True:
        while len(window) < depth and nxt < len(jobs):
            window.append(nxt)
            nxt += 1
        if not window and not ends:
            break
        failed: set = set()  # (nodes, ppn, runs past the shadow) that did not fit in this pass
        k = 0
        while k < len(window):
            idx = window[k]
            if capped[idx]:
                user = jobs[idx].user
                if user_run.get(user, 0) + slots_of[idx] > caps[user]:
                    deferred.setdefault(user, []).append(idx)
                    del window[k]
                    if head is not None and head[0] == idx:
                        head = None
                    continue
            if head is not None and head[0] != idx:  # a backfill candidate
                total = f.total
                if total == 0:
                    break
                if slots_of[idx] <= total:
                    long = t + pred_of[idx] > head[1]
                    n, ppn = shape_of[idx]
                    key = (n, ppn, long)
                    ex = excl[idx]
                    if ex or key not in failed:
                        limit = head[2] if long else None
                        picked = choose(n, ppn, ex, limit)
                        if picked is not None:
                            start(idx, picked)
                            if limit:
                                for i in picked:
                                    if i in limit:
                                        limit[i] -= ppn
                            del window[k]
                            continue
                        if not ex:
                            failed.add(key)
                k += 1
                continue
            if head is not None and t < head[1]:
                k += 1  # the head cannot fit before its shadow time: nothing ends sooner than predicted here
                continue
            n, ppn = shape_of[idx]
            picked = choose(n, ppn, excl[idx]) if slots_of[idx] <= f.total else None
            if picked is not None:
                start(idx, picked)
                del window[k]
                head = None
                continue
            head = reserve(idx)
            if head is None:  # cannot start even after every predicted end: no prediction
                del window[k]
                continue
            k += 1
        if (max_jobs is not None and len(eta) >= max_jobs) or not ends:
            break
        if not window and nxt >= len(jobs) and not deferred:
            break
        t = ends[0][0]
        while ends and ends[0][0] <= t:
            _, _, user, slots, shares = heapq.heappop(ends)
            for i, ids in shares:
                f.release(i, ids)
            user_run[user] -= slots
            waiting = deferred.get(user)
            if waiting:  # give back as many of the user's capped jobs as the cap now allows, in order
                room = caps[user] - user_run[user]
                waiting.sort()
                while waiting and jobs[waiting[0]].slots <= room:
                    room -= jobs[waiting[0]].slots
                    insort(window, waiting.pop(0))
                if not waiting:
                    del deferred[user]
    return eta


def eta_changes(old: Mapping[int, float], new: Mapping[int, float], *, tolerance_s: float = 30.0) -> dict:
    """What to write after a refresh: job id -> new ETA (None: no longer predicted) for the
    jobs whose prediction appeared, disappeared or moved by more than `tolerance_s`."""
    out: dict = {}
    for jid, t in new.items():
        before = old.get(jid)
        if before is None or abs(before - t) > tolerance_s:
            out[jid] = t
    for jid in old:
        if jid not in new:
            out[jid] = None
    return out
