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
from typing import Iterable

from jobs.scheduling.policy.fairshare import entitlements
from jobs.scheduling.policy.cluster import ClusterView, QueuedJob, check_policy
from jobs.scheduling.policy.quotas import QuotaLedger, classify

# Aging of the shortest-job-first key: predicted_s / (1 + wait_s / AGING_S).
AGING_S = 3600.0


def _as_view(view_or_jobs) -> ClusterView:
    if isinstance(view_or_jobs, ClusterView):
        return view_or_jobs
    return ClusterView(0.0, (), (), tuple(view_or_jobs))


def queue_order(view_or_jobs: ClusterView | Iterable[QueuedJob], *, ledger: QuotaLedger | None = None) -> list[QueuedJob]:
    """The queue in the order the policy considers it (queue positions are index + 1). Given a
    bare list of jobs, orders it as `trainyard` with no usage and no running jobs. `ledger`: the
    running jobs' (quotas.classify) when the caller has it (a tick), which this counts into."""
    view = _as_view(view_or_jobs)
    check_policy(view.policy)
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
        slots = j.slots
        groups.setdefault(j.priority, {}).setdefault(j.team, []).append(
            (key, j.submitted_at, j.id, j, slots, slots * min(j.predicted_s, horizon)))
    team_slots = view.quotas.team_slots
    within = (ledger or classify(view.running, team_slots)[1]).within
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
            quota = team_slots.get(t) if t is not None else None
            # the team goes on taking jobs while its updated entry stays below every other team's
            rival = min(heap[1:3]) if len(heap) > 1 else None
            while True:
                _, _, _, j, slots, cost = jobs.pop()
                if quota is None:  # QuotaLedger.take, inline: a team without a quota never borrows
                    out.append(j)
                elif within.get(t, 0) + slots > quota:
                    borrowers.append(j)
                else:
                    within[t] = within.get(t, 0) + slots
                    out.append(j)
                score[t] += cost
                if not jobs:
                    heapq.heappop(heap)
                    break
                entry = (score[t] / ent[t], name, t)
                if rival is not None and rival < entry:
                    heapq.heapreplace(heap, entry)
                    break
    out += borrowers
    return out
