"""Quotas: which running jobs are within their team's entitlement and which are borrowing.

`Quotas.team_slots` are entitlements in slots. A team's running jobs are classified each tick
from the current quotas: in start order (oldest first), a job is within quota when the team's
within-quota slots so far plus its own fit the quota, otherwise it is *borrowing* (so lowering
a quota turns the newest jobs beyond it into borrowers). Jobs being stopped do not count. A
placement is borrowing when the team's within-quota slots plus the job's exceed its quota;
borrowing only ever uses idle slots (it never preempts). A team absent from `team_slots` has no
quota: never borrowing, never reclaimed. `user_slots` are hard caps on a user's running slots.
A team or user (``"user:<name>"``) in `over_budget` has spent its device-hours for the window:
its jobs wait.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from jobs.scheduling.policy.cluster import ClusterView, RunningJob


def classify(running: Iterable[RunningJob], team_slots: Mapping[str, int]) -> tuple[set[int], dict]:
    """(ids of the borrowing running jobs, within-quota running slots per team)."""
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


def running_borrowing(running: Iterable[RunningJob], team_slots: Mapping[str, int]) -> frozenset[int]:
    """Running jobs that are borrowing under the current quotas: per team in start order, a job
    stays within quota while the team's within-quota slots plus its own fit the quota (jobs
    being stopped are left out)."""
    return frozenset(classify(running, team_slots)[0])


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
