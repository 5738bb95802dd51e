"""One scheduling tick: `schedule(view)` walks the queue in `queue_order` and decides who starts
where, who waits and why, and whom to preempt.

Backfill (EASY). The first job in order that cannot start becomes the *head* and gets a
reservation (`placement.reserve`): its shadow time (when enough running jobs will have ended,
by their predicted ends, for it to fit) and the nodes it will use then. A later job may start
now only if it ends (now + predicted_s) by the shadow time, or uses only slots of the reserved
nodes that the head will not need (per-node spare). So a backfilled job never delays the head's
predicted start. A running job past its predicted end, or one being stopped, is expected to end
as `cluster.expected_end` says. When the head cannot fit even after every known running job
ends (slots held by something the view does not describe), the queue is strict behind it.
Under ``fifo`` nobody passes the head.

Before the queue walk, the jobs that preemptions are in flight for (reclaim.py) have the first
claim on what is free and on what their victims will free: such a job starts as soon as it
fits, and meanwhile holds the free slots its planned placement needs.

The expected ends (`_TickEnds`) are kept current as the tick places and preempts, so no queued
job pays for the whole list: the reservation walks them lazily in order of end, and reclaim's
"would it fit once the jobs ending by the deadline (now + `reclaim_wait_s`, one per tick) have
ended" (reclaim.py's `fits_by`) reads a standing overlay's counts (`placement.OverlayCounts`),
updated when a placement adds an end, a preemption removes one and a node's free slots change.
At 10,000 nodes and 100,000 queued jobs the tick used to rebuild, re-sort and merge the ends
for each within-quota job that could not start: quadratic in the placements (bench/scheduler.py).
"""
from __future__ import annotations

import heapq
from operator import attrgetter, itemgetter
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Iterator

from jobs.scheduling.policy import elastic
from jobs.scheduling.policy.cluster import ClusterView, Decision, NodeState, Placement, Preemption, QueuedJob, RunningJob, Share, check_policy, expected_end, gc_paused
from jobs.scheduling.policy.order import queue_order
from jobs.scheduling.policy.eligibility import unservable_reason
from jobs.scheduling.policy.placement import Eligibility, FreeSlots, IndexShares, OverlayCounts, exclusion, reserve
from jobs.scheduling.policy.quotas import classify
from jobs.scheduling.policy.reclaim import pick_victims, victim_order


@dataclass
class _Reservation:
    job: QueuedJob
    shadow: float | None  # None: cannot be predicted (strict behind it)
    spare: dict  # reserved node index -> slots later jobs running past the shadow may still take

    @cached_property
    def next(self) -> str:
        """The reason of a job waiting behind this head (one string for the 100,000 of a busy queue)."""
        return f"waiting for free slots (job {self.job.id} is next)"

    @cached_property
    def strict(self) -> str:
        """The reason of a job that may not pass this head (fifo, or a head that cannot be predicted)."""
        return f"behind job {self.job.id} in the queue"


def _fmt_s(s: float) -> str:
    if s < 90:
        return "a minute" if s >= 30 else "under a minute"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


_key = itemgetter(0, 1)  # an end's (end, job id): its order
_END = itemgetter(0)


def _sort_ends(ends: list) -> None:
    """Sort (end, job id, shares) by `_key`: by the end alone when no two are equal (the usual
    case: floats sort three times faster than tuples, 64,000 ends at 10,000 nodes)."""
    firsts = [e[0] for e in ends]
    ends.sort(key=_END if len(set(firsts)) == len(firsts) else _key)
_ID = attrgetter("id")


class _TickEnds:
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
            self._running = list(self._running_src())
            _sort_ends(self._running)
        return self._running

    def place(self, end: float, job_id: int, shares: IndexShares) -> None:
        if self._placed_sorted and self.placed:
            last = self.placed[-1]
            if last[0] > end or (last[0] == end and last[1] > job_id):
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
            _sort_ends(self.placed)
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


class _Tick:
    """The state of one tick's pass over the queue: free slots, quota and cap accounting so far,
    and the decision being built."""

    def __init__(self, view: ClusterView):
        check_policy(view.policy)
        self.view = view
        self.now = view.now
        self.free = FreeSlots(view.nodes)
        q = view.quotas
        self.team_q = q.team_slots
        self.caps = q.user_slots
        self.over = q.over_budget
        self.users_over = {o[5:] for o in self.over if o.startswith("user:")}
        self.gated = bool(self.over)  # else only a capped user's job can be gated (_step)
        self.borrowing_running, self.ledger = classify(view.running, self.team_q)
        self.team_total: dict[str | None, int] = {}
        self.user_run: dict[str, int] = {}
        for r in view.running:
            self.user_run[r.user] = self.user_run.get(r.user, 0) + r.slots
            if r.preemptible:
                self.team_total[r.team] = self.team_total.get(r.team, 0) + r.slots
        self.shares = {r.id: self.free.shares_of(r.nodes) for r in view.running}  # by node index
        # the nodes each job may use, and their capacity per slots-per-share ("could it ever fit")
        self.eligibility = Eligibility(self.free, view.nodes)
        self.placements: list[Placement] = []
        self.preemptions: list[Preemption] = []
        self.waiting: dict[int, str] = {}
        self.taken: set[int] = set()        # running jobs preempted this tick
        self.reclaim_failed: set = set()    # (team, nodes, ppn) that found no victims this tick
        self.shrinking: set[int] = set()    # running elastic jobs reclaim shrinks (rather than stops)
        self.blocked: set[int] = set()      # queued jobs gated or unservable: they want no free slots
        self._candidates: list[RunningJob] | None = None
        self._plain: dict = {}  # (nodes, ppn) -> a plain job's _exclusion (_plain_shape)
        # the expected ends of the running jobs (no preemption in flight) and this tick's placements
        self.ends = _TickEnds(self.free, lambda: ((expected_end(r, self.now), r.id, self.shares[r.id])
                                                 for r in view.running if r.preempted_for is None),
                             self.now + view.reclaim_wait_s)

    def _exclusion(self, job: QueuedJob) -> tuple[set[int] | None, bool, bool]:
        """placement.exclusion over the nodes the job may use (its device and labels)."""
        hard, fit = self.eligibility.of(job)
        return exclusion(self.free, fit, job, hard)

    def _plain_shape(self, job: QueuedJob) -> tuple[set[int] | None, bool, bool]:
        """A plain job's `_exclusion` (no avoid, cpu, no labels or pool, no min_nodes): it depends
        on the job's shape only (fit counts are the tick's), so it is computed once per shape."""
        got = self._plain[(job.nodes, job.procs_per_node)] = self._exclusion(job)
        return got

    def _shape(self, job: QueuedJob) -> tuple[QueuedJob, set[int] | None, bool, bool]:
        """(the job as a gang of the most nodes it could ever get, and its `_exclusion`): an
        elastic job whose most could never fit is treated as one of fewer (elastic.py)."""
        got = self._exclusion(job)
        if got[1] or not job.elastic:
            return (elastic.at_count(job, job.nodes) if job.elastic else job), *got
        for k in range(job.nodes - 1, job.min_nodes - 1, -1):
            top = elastic.at_count(job, k)
            got = self._exclusion(top)
            if got[1]:
                return top, *got
        return job, *got

    # -- gates
    def _gate(self, job: QueuedJob) -> str | None:
        if job.team is not None and job.team in self.over:
            return f"team {job.team} has used its device-hours for the current window"
        if job.user and job.user in self.users_over:
            return f"user {job.user} has used their device-hours for the current window"
        cap = self.caps.get(job.user)
        if cap is not None:
            used = self.user_run.get(job.user, 0)
            if used + job.slots > cap:
                return (f"user {job.user} is at their cap: {used} of {cap} slot(s) in use, "
                        f"this job needs {job.slots}")
        return None

    def _claim(self, job: QueuedJob, borrowing: bool) -> None:
        slots, team = job.nodes * job.procs_per_node, job.team
        self.user_run[job.user] = self.user_run.get(job.user, 0) + slots
        self.team_total[team] = self.team_total.get(team, 0) + slots
        if not borrowing:
            self.ledger.add_within(team, slots)

    def _commit(self, job: QueuedJob, picked: list[int], borrowing: bool, reason: str = "") -> None:
        f, ppn = self.free, job.procs_per_node
        if len(picked) == 1:  # most placements: no generators
            i = picked[0]
            index_shares = ((i, f.take(i, ppn)),)
            shares = (Share(f.names[i], f.address[i], 0, index_shares[0][1]),)
        else:
            index_shares = tuple((i, f.take(i, ppn)) for i in picked)
            shares = tuple(Share(f.names[i], f.address[i], rank, ids) for rank, (i, ids) in enumerate(index_shares))
        self.placements.append(Placement(job.id, shares, borrowing, reason))
        # it ends by its prediction too: a reservation made later in this tick counts on that
        self.ends.place(self.now + max(job.predicted_s, 0.0), job.id, index_shares)
        self._claim(job, borrowing)

    def _take(self, r: RunningJob) -> None:
        """r is preempted (or stopped to grow) this tick: its slots are no longer an end."""
        self.taken.add(r.id)
        if r.preempted_for is None:
            self.ends.take(r.id, expected_end(r, self.now), self.shares[r.id])

    # -- reclaim
    def _reclaim(self, job: QueuedJob, exclude) -> tuple[list[RunningJob], dict[int, int]] | None:
        key = (job.team, job.nodes, job.procs_per_node)
        if not exclude and key in self.reclaim_failed:
            return None
        if self.ends.fits_soon(job.nodes, job.procs_per_node, exclude):  # reclaim.fits_by, kept current
            return None
        if self._candidates is None:
            self._candidates = victim_order(self.view.running, self.borrowing_running)
        cands = [r for r in self._candidates if r.id not in self.taken and r.team != job.team]
        got = elastic.pick_shrinks(self.free, job, exclude, cands, self.shares)
        if got is not None:
            self.shrinking.update(r.id for r in got[0])
            return got
        got = pick_victims(self.free, job, exclude, cands, self.shares)
        if got is None and not exclude:
            self.reclaim_failed.add(key)
        return got

    def _hold_plan(self, job: QueuedJob, exclude, delta: dict[int, int]) -> bool:
        plan = self.free.choose(job.nodes, job.procs_per_node, exclude, overlay=delta)
        if plan is None:
            return False
        for i in plan:
            self.free.hold(i, min(job.procs_per_node, self.free.avail[i]))
        return True

    def _reserve(self, job: QueuedJob, exclude) -> _Reservation:
        got = reserve(self.free, job.nodes, job.procs_per_node, exclude, self.ends.ordered())
        return _Reservation(job, None, {}) if got is None else _Reservation(job, *got)

    # -- the pass
    def run(self) -> Decision:
        order = queue_order(self.view, ledger=self.ledger.copy())  # the running jobs classified once
        done = self._inflight_first(order)
        head: _Reservation | None = None
        for job in (j for j in order if j.id not in done) if done else order:
            head = self._step(job, head)
        self._grow(order, head)
        return Decision(tuple(self.placements), tuple(self.preemptions), self.waiting,
                        tuple(map(_ID, order)), frozenset(self.borrowing_running))

    def _inflight_first(self, order: list[QueuedJob]) -> set[int]:
        """Jobs that preemptions are in flight for: first claim on what is free, and on what their
        victims will free. Returns the ids dealt with (started, or holding their plan)."""
        f = self.free
        done: set[int] = set()
        inflight: dict[int, list[RunningJob]] = {}
        for r in self.view.running:
            if r.preempted_for is not None:
                inflight.setdefault(r.preempted_for, []).append(r)
        for job in (j for j in order if j.id in inflight) if inflight else ():
            if self._gate(job) is not None:
                continue
            exclude, ever, _ = self._exclusion(job)
            if not ever:
                continue
            borrowing = self.ledger.borrows(job.team, job.slots)
            picked = f.choose(job.nodes, job.procs_per_node, exclude)
            if picked is not None:
                self._commit(job, picked, borrowing)
                done.add(job.id)
            elif self._hold_plan(job, exclude, f.overlay_of(s for r in inflight[job.id] for s in self.shares[r.id])):
                self._claim(job, borrowing)
                self.waiting[job.id] = ("waiting for job(s) " + ", ".join(str(r.id) for r in inflight[job.id])
                                        + " to checkpoint and stop (preempted for this job)")
                done.add(job.id)
        return done

    def _step(self, job: QueuedJob, head: _Reservation | None) -> _Reservation | None:
        f, pol = self.free, self.view.policy
        reason = self._gate(job) if self.gated or job.user in self.caps else None
        if reason:
            self.waiting[job.id] = reason
            self.blocked.add(job.id)
            return head
        queued = job
        if job.min_nodes is None and not (job.avoid or job.labels or job.pool) and job.device == "cpu":
            exclude, ever, avoids = self._plain.get((job.nodes, job.procs_per_node)) or self._plain_shape(job)
        else:
            job, exclude, ever, avoids = self._shape(job)
        if not ever:
            self.blocked.add(job.id)
            self.waiting[job.id] = (unservable_reason(self.view.nodes, job) or
                                    f"needs {job.nodes} schedulable node(s) with {job.procs_per_node} "
                                    f"slot(s) each") + "; waiting for nodes"
            return head
        if head is not None and (pol == "fifo" or head.shadow is None):
            self.waiting[job.id] = head.strict
            return head
        borrowing = self.ledger.borrows(job.team, job.slots)
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
        if queued.elastic and self._start_fewer(queued, job, exclude, head, borrowing):
            return head
        if pol == "trainyard" and not borrowing and job.team in self.team_q:
            got = self._reclaim(job, exclude)
            if got is not None and self._hold_plan(job, exclude, got[1]):
                self._preempt(job, got[0])
                self._claim(job, borrowing)
                return head
        avoiding = f" (avoiding {', '.join(sorted(job.avoid))})" if avoids else ""
        if head is None:
            head = self._reserve(job, exclude)
            eta = (f"; expected to start in about {_fmt_s(head.shadow - self.now)}"
                   if head.shadow is not None and pol != "fifo" else "")
            self.waiting[job.id] = "waiting for free slots" + avoiding + eta
        elif limit and f.choose(job.nodes, job.procs_per_node, exclude) is not None:
            self.waiting[job.id] = (f"waiting: starting now would delay job {head.job.id}, which is "
                                    f"next{avoiding}")
        else:
            self.waiting[job.id] = head.next + avoiding
        return head

    def _start_fewer(self, queued: QueuedJob, top: QueuedJob, exclude, head: _Reservation | None,
                     borrowing: bool) -> bool:
        """An elastic job that cannot start on `top.nodes`: start it now on the most nodes free
        when elastic.start_fewer says so (its finish against waiting for them); True if it did."""
        for k in range(top.nodes - 1, queued.min_nodes - 1, -1):
            job = elastic.at_count(queued, k)
            limit = head.spare if head is not None and self.now + job.predicted_s > head.shadow else None
            picked = self.free.choose(k, job.procs_per_node, exclude, limit)
            if picked is None:
                continue
            got = None if queued.restart_now else reserve(self.free, top.nodes, top.procs_per_node, exclude,
                                                            self.ends.ordered())
            reason = elastic.start_fewer(queued, top.nodes, k, self.now, got[0] if got else None)
            if reason is None:  # the most it can get now does not pay: fewer would pay less
                return False
            self._commit(job, picked, borrowing, reason)
            for i in picked if limit else ():
                if i in limit:
                    limit[i] -= job.procs_per_node
            return True
        return False

    def _grow(self, order: list[QueuedJob], head: _Reservation | None) -> None:
        """Grow running elastic jobs onto free nodes nobody with a better claim waits for
        (elastic.py): a cooperative stop that restarts at once on more nodes."""
        growable = [r for r in self.view.running if r.elastic is not None and r.preemptible
                    and r.id not in self.taken and len(r.nodes) < r.elastic.nodes]
        waiting = [j for j in order if j.id in self.waiting and j.id not in self.blocked] if growable else []
        for r in sorted(growable, key=lambda r: (-r.priority, r.started_at, r.id)):
            e, cur = r.elastic, len(r.nodes)
            if r.predicted_end - self.now < self.view.grow_min_left_s or elastic.blocks_grow(r, waiting):
                continue
            if head is not None and head.shadow is None:
                return  # the queue is strict behind a head that cannot be predicted
            exclude = elastic.with_nodes(self.eligibility.of(e)[0], {i for i, _ in self.shares[r.id]})
            limit = head.spare if head is not None and r.predicted_end > head.shadow else None
            for n in range(e.nodes - cur, 0, -1):
                picked = self.free.choose(n, e.procs_per_node, exclude, limit)
                if picked is not None:
                    break
            else:
                continue
            for i in picked:
                self.free.hold(i, e.procs_per_node)
            self._take(r)
            self.preemptions.append(Preemption(r.id, elastic.grow_reason(cur, cur + n, n * e.procs_per_node),
                                               None, resize_to=cur + n))

    def _preempt(self, job: QueuedJob, victims: list[RunningJob]) -> None:
        quota = self.team_q[job.team]
        for r in victims:
            self._take(r)
            q = self.team_q.get(r.team, 0)
            over = self.team_total.get(r.team, 0) - q
            why = (f"reclaimed: team {job.team} needs its quota back for job {job.id} "
                   f"(team {r.team} is {over} slot(s) over its quota of {q}; team {job.team}'s quota is {quota})")
            if r.id in self.shrinking:
                least = r.elastic.min_nodes
                self.preemptions.append(Preemption(r.id, f"{why}; shrinking to {least} node(s)", job.id,
                                                   resize_to=least))
                self.team_total[r.team] = self.team_total.get(r.team, 0) - (len(r.nodes) - least) * (
                    r.elastic.procs_per_node)
                continue
            self.preemptions.append(Preemption(r.id, why, job.id))
            self.team_total[r.team] = self.team_total.get(r.team, 0) - r.slots
        self.waiting[job.id] = ("reclaiming quota: preempting borrowing job(s) "
                                + ", ".join(str(r.id) for r in victims))


@gc_paused
def schedule(view: ClusterView | Iterable[NodeState], queue: Iterable[QueuedJob] | None = None) -> Decision:
    """One scheduling tick. `schedule(nodes, queue)` (the old call) means a view at time 0 with
    no running jobs, no quotas and the trainyard policy."""
    if queue is not None:
        view = ClusterView(0.0, tuple(view), (), tuple(queue))
    return _Tick(view).run()
