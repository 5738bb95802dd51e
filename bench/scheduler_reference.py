"""The scheduler tick as it was before issue 26 part 4 (jobs/scheduling/policy/tick.py at f181a2f),
frozen: the reference that bench/scheduler.py times the new tick against and that
tests/jobs/scheduling/policy/test_tick_equivalence.py compares its decisions with.

Its `_Tick._ends` rebuilt the list of expected ends (running jobs' filtered, this tick's
placements re-sorted and merged) for every within-quota job that could not start, through
`_reclaim` -> `fits_by`: quadratic in the placements (a fill tick at 10,000 nodes and 100,000
queued jobs did not finish in 10 minutes). Not used by production code.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable

from jobs.scheduling.policy import elastic
from jobs.scheduling.policy.cluster import ClusterView, Decision, NodeState, Placement, Preemption, QueuedJob, RunningJob, Share, check_policy, expected_end
from order_reference import queue_order
from jobs.scheduling.policy.eligibility import unservable_reason
from placement_reference import Eligibility, FreeSlots, exclusion, reserve
from jobs.scheduling.policy.quotas import classify
from jobs.scheduling.policy.reclaim import fits_by, pick_victims, victim_order


@dataclass
class _Reservation:
    job: QueuedJob
    shadow: float | None  # None: cannot be predicted (strict behind it)
    spare: dict  # reserved node index -> slots later jobs running past the shadow may still take


def _fmt_s(s: float) -> str:
    if s < 90:
        return "a minute" if s >= 30 else "under a minute"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


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
        self._sorted_ends: list | None = None
        self.placed_ends: list = []  # (end, job id, shares) of this tick's placements

    def _exclusion(self, job: QueuedJob) -> tuple[set[int] | None, bool, bool]:
        """placement.exclusion over the nodes the job may use (its device and labels)."""
        hard, fit = self.eligibility.of(job)
        return exclusion(self.free, fit, job, hard)

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
        if job.user and f"user:{job.user}" in self.over:
            return f"user {job.user} has used their device-hours for the current window"
        cap = self.caps.get(job.user)
        if cap is not None:
            used = self.user_run.get(job.user, 0)
            if used + job.slots > cap:
                return (f"user {job.user} is at their cap: {used} of {cap} slot(s) in use, "
                        f"this job needs {job.slots}")
        return None

    def _is_borrowing(self, job: QueuedJob) -> bool:
        return self.ledger.borrows(job.team, job.slots)

    def _claim(self, job: QueuedJob, borrowing: bool) -> None:
        self.user_run[job.user] = self.user_run.get(job.user, 0) + job.slots
        self.team_total[job.team] = self.team_total.get(job.team, 0) + job.slots
        if not borrowing:
            self.ledger.add_within(job.team, job.slots)

    def _commit(self, job: QueuedJob, picked: list[int], borrowing: bool, reason: str = "") -> None:
        f = self.free
        shares = tuple(Share(f.names[i], f.address[i], rank, f.take(i, job.procs_per_node))
                       for rank, i in enumerate(picked))
        self.placements.append(Placement(job.id, shares, borrowing, reason))
        # it ends by its prediction too: a reservation made later in this tick counts on that
        self.placed_ends.append((self.now + max(job.predicted_s, 0.0), job.id,
                                 tuple((i, s.slot_ids) for i, s in zip(picked, shares))))
        self._claim(job, borrowing)

    def _ends(self) -> list:
        """(expected end, shares) of the running jobs and this tick's placements, by end; not
        the victims of in-flight or new preemptions (their slots go to the jobs they are for)."""
        if self._sorted_ends is None:
            self._sorted_ends = sorted(
                ((expected_end(r, self.now), r.id, self.shares[r.id]) for r in self.view.running
                 if r.id not in self.taken and r.preempted_for is None),
                key=lambda x: x[:2])
        ends = [e for e in self._sorted_ends if e[1] not in self.taken]
        if self.placed_ends:
            ends = list(heapq.merge(ends, sorted(self.placed_ends, key=lambda x: x[:2]), key=lambda x: x[:2]))
        return [(end, shares) for end, _, shares in ends]

    # -- reclaim
    def _reclaim(self, job: QueuedJob, exclude) -> tuple[list[RunningJob], dict[int, int]] | None:
        key = (job.team, job.nodes, job.procs_per_node)
        if not exclude and key in self.reclaim_failed:
            return None
        if fits_by(self.free, job, exclude, self._ends(), self.now + self.view.reclaim_wait_s):
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
        got = reserve(self.free, job.nodes, job.procs_per_node, exclude, self._ends())
        return _Reservation(job, None, {}) if got is None else _Reservation(job, *got)

    # -- the pass
    def run(self) -> Decision:
        order = queue_order(self.view)
        done = self._inflight_first(order)
        head: _Reservation | None = None
        for job in order:
            if job.id in done:
                continue
            head = self._step(job, head)
        self._grow(order, head)
        return Decision(tuple(self.placements), tuple(self.preemptions), self.waiting,
                        tuple(j.id for j in order), frozenset(self.borrowing_running))

    def _inflight_first(self, order: list[QueuedJob]) -> set[int]:
        """Jobs that preemptions are in flight for: first claim on what is free, and on what their
        victims will free. Returns the ids dealt with (started, or holding their plan)."""
        f = self.free
        done: set[int] = set()
        inflight: dict[int, list[RunningJob]] = {}
        for r in self.view.running:
            if r.preempted_for is not None:
                inflight.setdefault(r.preempted_for, []).append(r)
        for job in (j for j in order if j.id in inflight):
            if self._gate(job) is not None:
                continue
            exclude, ever, _ = self._exclusion(job)
            if not ever:
                continue
            borrowing = self._is_borrowing(job)
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
        reason = self._gate(job)
        if reason:
            self.waiting[job.id] = reason
            self.blocked.add(job.id)
            return head
        queued = job
        job, exclude, ever, avoids = self._shape(job)
        if not ever:
            self.blocked.add(job.id)
            self.waiting[job.id] = (unservable_reason(self.view.nodes, job) or
                                    f"needs {job.nodes} schedulable node(s) with {job.procs_per_node} "
                                    f"slot(s) each") + "; waiting for nodes"
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
            self.waiting[job.id] = f"waiting for free slots (job {head.job.id} is next){avoiding}"
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
                                                            self._ends())
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
        waiting = [j for j in order if j.id in self.waiting and j.id not in self.blocked]
        growable = (r for r in self.view.running if r.elastic is not None and r.preemptible
                    and r.id not in self.taken and len(r.nodes) < r.elastic.nodes)
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
            self.taken.add(r.id)
            self.preemptions.append(Preemption(r.id, elastic.grow_reason(cur, cur + n, n * e.procs_per_node),
                                               None, resize_to=cur + n))

    def _preempt(self, job: QueuedJob, victims: list[RunningJob]) -> None:
        quota = self.team_q[job.team]
        for r in victims:
            self.taken.add(r.id)
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


def reference_schedule(view: ClusterView | Iterable[NodeState], queue: Iterable[QueuedJob] | None = None) -> Decision:
    """One scheduling tick. `schedule(nodes, queue)` (the old call) means a view at time 0 with
    no running jobs, no quotas and the trainyard policy."""
    if queue is not None:
        view = ClusterView(0.0, tuple(view), (), tuple(queue))
    return _Tick(view).run()
