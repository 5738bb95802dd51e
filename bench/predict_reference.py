"""Start-time predictions as they were before issue 26 part 4 (jobs/scheduling/policy/predict.py at
f181a2f, over placement_reference.py), frozen: the reference bench/scheduler.py times
`predict_starts` against and tests/jobs/scheduling/policy/test_tick_equivalence.py compares its
predictions with. Not used by production code.
"""
from __future__ import annotations

import heapq
from bisect import insort
from typing import Mapping

from jobs.scheduling.policy.cluster import ClusterView, QueuedJob, expected_end
from order_reference import queue_order
from placement_reference import Eligibility, FreeSlots, exclusion, reserve

# predict_starts: how many queued jobs behind the head the forward simulation considers for
# backfill at each event (like Slurm's bf_max_job_test; deeper jobs wait their turn).
ETA_DEPTH = 64
# eta_changes: a prediction that moved by this much or less is not rewritten. The control plane
# refreshes every 5 s (beat) and the job page shows ETAs to the minute, so smaller moves are
# noise that would cost a database write each.
ETA_TOLERANCE_S = 5.0


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


def _predictable(view: ClusterView, free: FreeSlots) -> tuple[list[QueuedJob], list, list]:
    """The queued jobs that can get a prediction, in the order they are considered (those that
    preemptions are in flight for first), the nodes each must avoid, and what its placement
    depends on besides its shape: its requirement (device, GPU memory, labels: the same nodes
    excluded for every job with it), or None when it also avoids nodes of its own."""
    caps, over = view.quotas.user_slots, view.quotas.over_budget
    inflight = {r.preempted_for for r in view.running if r.preempted_for is not None}
    order = queue_order(view)
    if inflight:
        order = [j for j in order if j.id in inflight] + [j for j in order if j.id not in inflight]
    eligibility = Eligibility(free, view.nodes)
    jobs: list[QueuedJob] = []
    excl: list = []
    deps: list = []
    for j in order:
        if (j.team is not None and j.team in over) or (j.user and f"user:{j.user}" in over):
            continue
        if caps.get(j.user) is not None and j.slots > caps[j.user]:
            continue
        hard, fit_count = eligibility.of(j)
        ex, ever, avoiding = exclusion(free, fit_count, j, hard)
        if ever:
            jobs.append(j)
            excl.append(ex)
            deps.append(None if avoiding else (j.device, j.gpu_memory_bytes, j.labels))
    return jobs, excl, deps


class _Forward:
    """The forward simulation's state: free slots, a heap of (end, seq, user, slots, shares) of
    the jobs holding slots, the window of jobs considered at each event, the head's reservation
    ([job index, shadow, spare]) and the predictions so far."""

    def __init__(self, view: ClusterView):
        self.t = view.now
        self.free = f = FreeSlots(view.nodes)
        self.caps = view.quotas.user_slots
        self.user_run: dict[str, int] = {}
        self.ends: list = []
        for seq, r in enumerate(view.running):
            self.user_run[r.user] = self.user_run.get(r.user, 0) + r.slots
            self.ends.append((expected_end(r, view.now), seq, r.user, r.slots, f.shares_of(r.nodes)))
        heapq.heapify(self.ends)
        self.seq = len(self.ends)
        self.jobs, self.excl, self.deps = _predictable(view, f)
        # per job index, read at every event: plain lists beat attribute and property lookups
        self.slots_of = [j.slots for j in self.jobs]
        self.shape_of = [(j.nodes, j.procs_per_node) for j in self.jobs]
        self.pred_of = [j.predicted_s for j in self.jobs]
        self.capped = [j.user in self.caps for j in self.jobs]
        self.eta: dict[int, float] = {}
        self.window: list[int] = []
        self.nxt = 0
        self.deferred: dict[str, list[int]] = {}  # user -> indices of jobs waiting for their cap
        self.head: list | None = None

    def refill(self, depth: int) -> None:
        while len(self.window) < depth and self.nxt < len(self.jobs):
            self.window.append(self.nxt)
            self.nxt += 1

    def exhausted(self) -> bool:
        return not self.window and self.nxt >= len(self.jobs) and not self.deferred

    def start(self, idx: int, picked: list[int]) -> None:
        j = self.jobs[idx]
        shares = tuple((i, self.free.take(i, j.procs_per_node)) for i in picked)
        self.eta[j.id] = self.t
        self.user_run[j.user] = self.user_run.get(j.user, 0) + j.slots
        self.seq += 1
        heapq.heappush(self.ends, (self.t + max(j.predicted_s, 1.0), self.seq, j.user, j.slots, shares))

    def reserve(self, idx: int) -> list | None:
        j = self.jobs[idx]
        got = reserve(self.free, j.nodes, j.procs_per_node, self.excl[idx],
                      ((e[0], e[4]) for e in _sorted_walk(self.ends)))
        return None if got is None else [idx, *got]

    def walk(self) -> None:
        """One pass over the window at time t: start the head when it fits (else reserve for it),
        backfill behind it, set aside jobs over their user's cap."""
        f, window, jobs, excl, deps, t = self.free, self.window, self.jobs, self.excl, self.deps, self.t
        slots_of, shape_of, pred_of, capped = self.slots_of, self.shape_of, self.pred_of, self.capped
        caps, user_run, choose = self.caps, self.user_run, self.free.choose
        head = self.head
        failed: set = set()  # (nodes, ppn, runs past the shadow, requirement) that did not fit in this pass
        k = 0
        while k < len(window):
            idx = window[k]
            if capped[idx]:
                user = jobs[idx].user
                if user_run.get(user, 0) + slots_of[idx] > caps[user]:
                    self.deferred.setdefault(user, []).append(idx)
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
                    dep = deps[idx]
                    key = (n, ppn, long, dep)
                    ex = excl[idx]
                    if dep is None or key not in failed:
                        limit = head[2] if long else None
                        picked = choose(n, ppn, ex, limit)
                        if picked is not None:
                            self.start(idx, picked)
                            if limit:
                                for i in picked:
                                    if i in limit:
                                        limit[i] -= ppn
                            del window[k]
                            continue
                        if dep is not None:
                            failed.add(key)
                k += 1
                continue
            if head is not None and t < head[1]:
                k += 1  # the head cannot fit before its shadow time: nothing ends sooner than predicted here
                continue
            n, ppn = shape_of[idx]
            picked = choose(n, ppn, excl[idx]) if slots_of[idx] <= f.total else None
            if picked is not None:
                self.start(idx, picked)
                del window[k]
                head = None
                continue
            head = self.reserve(idx)
            if head is None:  # cannot start even after every predicted end: no prediction
                del window[k]
                continue
            k += 1
        self.head = head

    def advance(self) -> None:
        """Jump to the next predicted end: free what ends then, and give back as many of each
        such user's capped jobs as the cap now allows, in order."""
        ends, caps, user_run = self.ends, self.caps, self.user_run
        t = self.t = ends[0][0]
        while ends and ends[0][0] <= t:
            _, _, user, slots, shares = heapq.heappop(ends)
            for i, ids in shares:
                self.free.release(i, ids)
            user_run[user] -= slots
            waiting = self.deferred.get(user)
            if waiting:
                room = caps[user] - user_run[user]
                waiting.sort()
                while waiting and self.jobs[waiting[0]].slots <= room:
                    room -= self.jobs[waiting[0]].slots
                    insort(self.window, waiting.pop(0))
                if not waiting:
                    del self.deferred[user]


def reference_predict_starts(view: ClusterView, *, depth: int = ETA_DEPTH, max_jobs: int | None = None) -> dict[int, float]:
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
    fwd = _Forward(view)
    while True:
        fwd.refill(depth)
        if not fwd.window and not fwd.ends:
            break
        fwd.walk()
        if (max_jobs is not None and len(fwd.eta) >= max_jobs) or not fwd.ends or fwd.exhausted():
            break
        fwd.advance()
    return fwd.eta


def eta_changes(old: Mapping[int, float], new: Mapping[int, float], *,
                tolerance_s: float = ETA_TOLERANCE_S) -> dict:
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
