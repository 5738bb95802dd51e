"""Start-time predictions: the policy run forward in time over predicted run times
(`predict_starts`), and which predictions moved enough to write (`eta_changes`)."""
from __future__ import annotations

import heapq
from bisect import insort
from operator import attrgetter
from typing import Mapping

from jobs.scheduling.policy.cluster import ClusterView, QueuedJob, expected_end, gc_paused
from jobs.scheduling.policy.order import queue_order
from jobs.scheduling.policy.placement import Eligibility, FreeSlots, exclusion, reserve

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


def _predictable(view: ClusterView, free: FreeSlots) -> tuple[list[QueuedJob], list, list[int], list]:
    """The queued jobs that can get a prediction, in the order they are considered (those that
    preemptions are in flight for first), the nodes each must avoid, and each one's fit key, the
    backfill pass's "did not fit" key: a small int, one per shape and requirement (device, GPU
    memory, labels, pool: the same nodes excluded for every job with it), or its own when it
    avoids nodes of its own (then nothing else shares its fate); and per fit key (nodes, ppn,
    exclusion)."""
    caps, over = view.quotas.user_slots, view.quotas.over_budget
    inflight = {r.preempted_for for r in view.running if r.preempted_for is not None}
    order = queue_order(view)
    if inflight:
        order = [j for j in order if j.id in inflight] + [j for j in order if j.id not in inflight]
    eligibility = Eligibility(free, view.nodes)
    users_over = {o[5:] for o in over if o.startswith("user:")}
    # (shape, requirement) -> (exclusion, ever, fit key) of the jobs that avoid no node of their own
    same: dict = {}
    jobs: list[QueuedJob] = []
    excl: list = []
    fit_key: list[int] = []
    key_shape: list = []
    for j in order:
        if over and ((j.team is not None and j.team in over) or (j.user and j.user in users_over)):
            continue
        cap = caps.get(j.user)
        if cap is not None and j.slots > cap:
            continue
        key = (j.nodes, j.procs_per_node, j.device, j.gpu_memory_bytes, j.labels, j.pool)
        got = None if j.avoid else same.get(key)
        if got is None:
            hard, fit_count = eligibility.of(j)
            ex, ever, avoiding = exclusion(free, fit_count, j, hard)
            got = same.get(key) if not avoiding else None
            if got is None:
                got = (ex, ever, len(key_shape))
                key_shape.append((j.nodes, j.procs_per_node, ex))
                if not avoiding:
                    same[key] = got
        if got[1]:
            jobs.append(j)
            excl.append(got[0])
            fit_key.append(got[2])
    return jobs, excl, fit_key, key_shape


class _Forward:
    """The forward simulation's state: free slots, the jobs holding slots (a heap of their end
    times, `ends`, and per end time, `ending`, their (user, slots, shares) in the order they took
    slots: a heap of floats sifts several times faster than one of tuples), the window of jobs
    considered at each event, the head's reservation ([job index, shadow, spare]) and the
    predictions so far."""

    def __init__(self, view: ClusterView):
        self.t = view.now
        self.free = f = FreeSlots(view.nodes)
        self.caps = view.quotas.user_slots
        self.user_run: dict[str, int] = {}
        self.ending: dict[float, list] = {}
        for r in view.running:
            self.user_run[r.user] = self.user_run.get(r.user, 0) + r.slots
            self.ending.setdefault(expected_end(r, view.now), []).append((r.user, r.slots, f.shares_of(r.nodes)))
        self.ends = list(self.ending)
        heapq.heapify(self.ends)
        self.jobs, self.excl, self.fit_key, self.key_shape = _predictable(view, f)
        # per job index, read at every event: plain lists beat attribute and property lookups
        self.shape_of = list(map(attrgetter("nodes", "procs_per_node"), self.jobs))
        self.slots_of = [n * ppn for n, ppn in self.shape_of]
        self.pred_of = list(map(attrgetter("predicted_s"), self.jobs))
        self.capped = [user in self.caps for user in map(attrgetter("user"), self.jobs)]
        self.eta: dict[int, float] = {}
        self.window: list[int] = []
        self.nxt = 0
        self.deferred: dict[str, list[int]] = {}  # user -> indices of jobs waiting for their cap
        self.head: list | None = None
        # After a pass that walked the whole window and changed nothing while the head waited for
        # its shadow time (backfill starts of uncapped users aside): the window's backfill
        # candidates by fit key, [least and most predicted_s], with the uncapped jobs refill adds
        # since. Until the head changes, a pass can only start something once a candidate fits
        # (`_may_start`); None: the next pass walks.
        self.idle: dict | None = None

    def refill(self, depth: int) -> None:
        while len(self.window) < depth and self.nxt < len(self.jobs):
            self.window.append(self.nxt)
            if self.idle is not None and not self.capped[self.nxt]:
                self._note(self.idle, self.nxt)  # a new candidate: no cap check pending
            else:
                self.idle = None
            self.nxt += 1

    def _note(self, shapes: dict, idx: int) -> None:
        pred = self.pred_of[idx]
        got = shapes.get(self.fit_key[idx])
        if got is None:
            shapes[self.fit_key[idx]] = [pred, pred]
        elif pred < got[0]:
            got[0] = pred
        elif pred > got[1]:
            got[1] = pred

    def _idle_shapes(self, head: list) -> dict:
        """_note for each backfill candidate, inline (a pass's whole window, 60,000 times at 10k/100k)."""
        shapes: dict = {}
        pred_of, fit_key, h = self.pred_of, self.fit_key, head[0]
        for idx in self.window:
            if idx == h:
                continue
            pred = pred_of[idx]
            got = shapes.get(fit_key[idx])
            if got is None:
                shapes[fit_key[idx]] = [pred, pred]
            elif pred < got[0]:
                got[0] = pred
            elif pred > got[1]:
                got[1] = pred
        return shapes

    def _may_start(self, head: list) -> bool:
        """Could a pass now start a backfill candidate? False only when none can fit: not on the
        free slots (count_fit), nor, for those running past the shadow, within the head's spare.
        Between idle passes the users' running slots only fall, so no cap check would bite."""
        f, t, shadow, key_shape = self.free, self.t, head[1], self.key_shape
        for key, (least, most) in self.idle.items():
            n, ppn, ex = key_shape[key]
            fit = f.count_fit(ppn, ex)
            if fit < n:
                continue
            if t + least <= shadow or (t + most > shadow and fit - f.limited(ppn, ex, None, head[2]) >= n):
                return True
        return False

    def exhausted(self) -> bool:
        return not self.window and self.nxt >= len(self.jobs) and not self.deferred

    def start(self, idx: int, picked: list[int]) -> None:
        j = self.jobs[idx]
        ppn = j.procs_per_node
        shares = ((picked[0], self.free.take(picked[0], ppn)),) if len(picked) == 1 else tuple(
            (i, self.free.take(i, ppn)) for i in picked)
        self.eta[j.id] = self.t
        self.user_run[j.user] = self.user_run.get(j.user, 0) + j.slots
        end = self.t + max(j.predicted_s, 1.0)
        got = self.ending.get(end)
        if got is None:
            self.ending[end] = [(j.user, j.slots, shares)]
            heapq.heappush(self.ends, end)
        else:
            got.append((j.user, j.slots, shares))

    def reserve(self, idx: int) -> list | None:
        j = self.jobs[idx]
        ending = self.ending
        got = reserve(self.free, j.nodes, j.procs_per_node, self.excl[idx],
                      ((end, e[2]) for end in _sorted_walk(self.ends) for e in ending[end]))
        return None if got is None else [idx, *got]

    def _start_or_reserve(self, idx: int) -> list | None:
        """The head's turn: start it if it fits (None: the next job is the head), else reserve for
        it; None too when it could not start even after every predicted end (no prediction)."""
        n, ppn = self.shape_of[idx]
        picked = self.free.choose(n, ppn, self.excl[idx]) if self.slots_of[idx] <= self.free.total else None
        if picked is not None:
            self.start(idx, picked)
            return None
        return self.reserve(idx)

    def walk(self) -> None:
        """One pass over the window at time t: start the head when it fits (else reserve for it),
        backfill behind it, set aside jobs over their user's cap."""
        head, t = self.head, self.t
        if self.idle is not None and head is not None and t < head[1] and not self._may_start(head):
            return  # the pass would change nothing
        f, jobs, excl = self.free, self.jobs, self.excl
        slots_of, shape_of, pred_of, capped = self.slots_of, self.shape_of, self.pred_of, self.capped
        caps, user_run, choose, fit_key = self.caps, self.user_run, self.free.choose, self.fit_key
        changed = False
        # fit keys that did not fit in this pass, running past the shadow (long) or not: a pass only
        # takes slots, so they would not fit later in it either
        failed_long: set = set()
        failed_short: set = set()
        keep: list[int] = []  # the window after the pass
        for pos, idx in enumerate(self.window):
            if capped[idx]:
                user = jobs[idx].user
                if user_run.get(user, 0) + slots_of[idx] > caps[user]:
                    self.deferred.setdefault(user, []).append(idx)
                    changed = True
                    if head is not None and head[0] == idx:
                        head = None
                    continue
            if head is not None and head[0] != idx:  # a backfill candidate
                total = f.total
                if total == 0:
                    changed = True  # not walked to the end: the jobs after it were not looked at
                    keep += self.window[pos:]
                    break
                if slots_of[idx] <= total:
                    long = t + pred_of[idx] > head[1]
                    failed = failed_long if long else failed_short
                    key = fit_key[idx]
                    if key not in failed:
                        n, ppn = shape_of[idx]
                        limit = head[2] if long else None
                        picked = choose(n, ppn, excl[idx], limit)
                        if picked is not None:
                            self.start(idx, picked)
                            # the candidates passed so far still do not fit (a pass only takes
                            # slots), but a capped user's jobs may now be over their cap
                            changed = changed or capped[idx]
                            if limit:
                                for i in picked:
                                    if i in limit:
                                        limit[i] -= ppn
                            continue
                        failed.add(key)
                keep.append(idx)
            elif head is not None and t < head[1]:
                keep.append(idx)  # the head cannot fit before its shadow time: nothing ends sooner than predicted here
            else:
                changed = True
                head = self._start_or_reserve(idx)
                if head is not None and head[0] == idx:
                    keep.append(idx)
        self.window = keep
        self.head = head
        self.idle = None if changed or head is None or t >= head[1] else self._idle_shapes(head)

    def advance(self) -> None:
        """Jump to the next predicted end: free what ends then, and give back as many of each
        such user's capped jobs as the cap now allows, in order."""
        ends, caps, user_run = self.ends, self.caps, self.user_run
        t = self.t = heapq.heappop(ends)
        for user, slots, shares in self.ending.pop(t):
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
                    self.idle = None
                if not waiting:
                    del self.deferred[user]


@gc_paused
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
    ~0.3 s on the 2-core dev machine, 100,000 behind 64,000 on 10,000 nodes ~4 s (~160,000
    events; bench/scheduler.py; a tick takes ~0.05 s and ~0.7 s), so the services refresh the
    ETAs every few seconds outside the tick (beat), write only those that moved
    (`eta_changes`), and can use `max_jobs`, which stops once the first N jobs in order have
    theirs (500 at 10,000 nodes: ~1 s, most of it ordering the queue), for a quicker refresh of
    the front of the queue.

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
