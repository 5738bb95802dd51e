"""Queue order: the order each policy considers the queue in (queue positions are index + 1).

Under ``fifo`` and ``backfill``: submission time, then id. Under ``trainyard`` the queue is split
in two groups: first every job that fits its team's entitlement (walking the order below, each
team's within-quota running slots plus the jobs already counted; teams without a quota are
always in this group), then the borrowers. Entitlements are guarantees, so a borrower never
takes slots ahead of an entitled job, even one of lower priority in another team — otherwise
the entitled job would reclaim them at once and the two would swap forever (measured: ~1,000
preemptions per 1,500-job trace before this rule, ~10-100 after). Within each group: priority
(high first); within a priority level teams take turns by fair share: the next job comes from
the team with the lowest `(usage + committed) / entitlement`, where `usage` is the team's
decayed slot-seconds (`ClusterView.usage`, see fairshare.py), `committed` the slot-seconds its
running jobs are still predicted to use (each capped at one half-life), and the entitlement its
quota (a team without one: an equal share of the schedulable slots among the teams with work).
Every job taken adds its own slots x predicted seconds (capped the same way) to its team's
total, so one team's hundred queued jobs interleave with another's instead of all going first.
Within a team: shortest predicted run first, aged so long jobs cannot starve: the sort key is
`predicted_s / (1 + wait_s / AGING_S)` (a job's effective length halves after an hour of
waiting and is a tenth after nine), then submission, then id.
"""
from __future__ import annotations

import heapq
from operator import attrgetter, itemgetter
from typing import Iterable

from jobs.scheduling.policy.fairshare import entitlements
from jobs.scheduling.policy.cluster import ClusterView, QueuedJob, check_policy, gc_paused
from jobs.scheduling.policy.quotas import QuotaLedger, classify

# Aging of the shortest-job-first key: predicted_s / (1 + wait_s / AGING_S).
AGING_S = 3600.0


def _as_view(view_or_jobs) -> ClusterView:
    if isinstance(view_or_jobs, ClusterView):
        return view_or_jobs
    return ClusterView(0.0, (), (), tuple(view_or_jobs))


# a job's entry in _groups: (aged predicted_s, submitted_at, id, job, slots, fair-share cost); ranked by the first three
_RANK = itemgetter(0, 1, 2)
_FIRST = itemgetter(0)
_FIELDS = attrgetter("priority", "team", "submitted_at", "predicted_s", "id", "nodes", "procs_per_node")


def _groups(queue, now: float, horizon: float) -> dict[int, dict[str | None, list]]:
    """{priority: {team: [entry, ...]}} (entries as _RANK describes, unsorted): the job's fields
    read in one C call each (attrgetter) rather than attribute by attribute, at 100,000 jobs."""
    groups: dict[int, dict[str | None, list]] = {}
    for j, (prio, team, submitted, pred, jid, nodes, ppn) in zip(queue, map(_FIELDS, queue)):
        wait = now - submitted
        slots = nodes * ppn
        entry = (pred / (1.0 + wait / AGING_S) if wait > 0 else pred, submitted, jid, j, slots,
                 slots * (horizon if horizon < pred else pred))  # min(pred, horizon)
        by_team = groups.get(prio)
        if by_team is None:
            by_team = groups[prio] = {}
        jobs = by_team.get(team)
        if jobs is None:
            by_team[team] = [entry]
        else:
            jobs.append(entry)
    return groups


def _rank(jobs: list) -> None:
    """Sort a team's entries so that pop() from the end takes the next: by _RANK, descending. With
    no two aged keys equal (the usual case) the key alone gives that order, and sorts floats
    three times faster than tuples."""
    keys = [e[0] for e in jobs]
    jobs.sort(key=_FIRST if len(set(keys)) == len(keys) else _RANK, reverse=True)


def _take_turn(jobs: list, name: str, quota: int | None, ent: float, rival: tuple | None, score: dict,
               within: dict, t, out: list, borrowers: list) -> tuple | None:
    """Team t takes its next jobs (into `out`, or `borrowers` past its quota: QuotaLedger.take,
    inline) while its fair-share entry stays at or below `rival` (the best other team's). Returns
    its new heap entry, or None when it has no jobs left."""
    s, w = score[t], within.get(t, 0)
    if rival is not None:
        r0, rname = rival[0], rival[1]
    entry = None
    while True:
        _, _, _, j, slots, cost = jobs.pop()
        if quota is None:  # a team without a quota never borrows
            out.append(j)
        elif w + slots > quota:
            borrowers.append(j)
        else:
            w += slots
            out.append(j)
        s += cost
        if not jobs:
            break
        e0 = s / ent
        if rival is not None and (r0 < e0 or (r0 == e0 and rname < name)):  # rival < (e0, name, t)
            entry = (e0, name, t)
            break
    score[t] = s
    if quota is not None and w != within.get(t, 0):
        within[t] = w
    return entry


@gc_paused
def queue_order(view_or_jobs: ClusterView | Iterable[QueuedJob], *, ledger: QuotaLedger | None = None) -> list[QueuedJob]:
    """The queue in the order the policy considers it (queue positions are index + 1). Given a
    bare list of jobs, orders it as `trainyard` with no usage and no running jobs. `ledger`: the
    running jobs' (quotas.classify) when the caller has it (a tick), which this counts into."""
    view = _as_view(view_or_jobs)
    check_policy(view.policy)
    if view.policy != "trainyard":
        return sorted(view.queue, key=lambda j: (j.submitted_at, j.id))
    now, horizon = view.now, view.half_life_s
    groups = _groups(view.queue, now, horizon)
    teams = {t for by_team in groups.values() for t in by_team} | {r.team for r in view.running}
    total = sum(n.slots for n in view.nodes if n.schedulable) or 1
    ent = {t: max(e, 0.01) for t, e in entitlements(view.quotas.team_slots, teams, total).items()}
    score = {t: float(view.usage.get(t, 0.0)) for t in teams}
    for r in view.running:
        score[r.team] += r.slots * min(max(r.predicted_end - now, 0.0), horizon)
    team_slots = view.quotas.team_slots
    within = (ledger or classify(view.running, team_slots)[1]).within
    out: list[QueuedJob] = []
    borrowers: list[QueuedJob] = []
    for prio in sorted(groups, reverse=True):
        by_team = groups[prio]
        heap = []
        for t, jobs in by_team.items():
            _rank(jobs)
            heap.append((score[t] / ent[t], "" if t is None else t, t))
        heapq.heapify(heap)
        while heap:
            _, name, t = heap[0]
            # the team goes on taking jobs while its updated entry stays below every other team's
            rival = min(heap[1:3]) if len(heap) > 1 else None
            entry = _take_turn(by_team[t], name, team_slots.get(t) if t is not None else None, ent[t], rival,
                               score, within, t, out, borrowers)
            if entry is None:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, entry)
    out += borrowers
    return out
