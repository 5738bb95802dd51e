"""Queue order as it was before issue 26 part 4 (jobs/scheduling/policy/order.py at f181a2f),
frozen for the references (scheduler_reference.py, predict_reference.py). Not used by
production code.
"""
from __future__ import annotations

import heapq
from typing import Iterable

from jobs.scheduling.policy.fairshare import entitlements
from jobs.scheduling.policy.cluster import ClusterView, QueuedJob, check_policy
from jobs.scheduling.policy.quotas import classify

# Aging of the shortest-job-first key: predicted_s / (1 + wait_s / AGING_S).
AGING_S = 3600.0


def _as_view(view_or_jobs) -> ClusterView:
    if isinstance(view_or_jobs, ClusterView):
        return view_or_jobs
    return ClusterView(0.0, (), (), tuple(view_or_jobs))


def queue_order(view_or_jobs: ClusterView | Iterable[QueuedJob]) -> list[QueuedJob]:
    """The queue in the order the policy considers it (queue positions are index + 1). Given a
    bare list of jobs, orders it as `trainyard` with no usage and no running jobs."""
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
        groups.setdefault(j.priority, {}).setdefault(j.team, []).append((key, j.submitted_at, j.id, j))
    ledger = classify(view.running, view.quotas.team_slots)[1]
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
            (borrowers if ledger.take(t, j.slots) else out).append(j)
            score[t] += j.slots * min(j.predicted_s, horizon)
            if jobs:
                heapq.heapreplace(heap, (score[t] / ent[t], name, t))
            else:
                heapq.heappop(heap)
    out += borrowers
    return out
