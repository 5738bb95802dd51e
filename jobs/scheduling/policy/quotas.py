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

from operator import attrgetter
from typing import Iterable, Mapping

from jobs.scheduling.policy.cluster import ClusterView, RunningJob


class QuotaLedger:
    """The one rule of borrowing, for every caller (the running jobs' classification, the queue
    order, the tick's placements): jobs counted in order stay within their team's quota while the
    team's within-quota slots plus their own fit it; the rest borrow. A team without a quota (or
    no team) never borrows."""

    def __init__(self, team_slots: Mapping[str, int]):
        self.team_slots = team_slots
        self.within: dict[str | None, int] = {}

    def copy(self) -> "QuotaLedger":
        out = QuotaLedger(self.team_slots)
        out.within = dict(self.within)
        return out

    def borrows(self, team: str | None, slots: int) -> bool:
        """Whether a job of `team` with `slots` would borrow, counted after those so far."""
        quota = self.team_slots.get(team) if team is not None else None
        return quota is not None and self.within.get(team, 0) + slots > quota

    def add_within(self, team: str | None, slots: int) -> None:
        """Count a job that does not borrow into its team's within-quota slots."""
        if team is not None and team in self.team_slots:
            self.within[team] = self.within.get(team, 0) + slots

    def take(self, team: str | None, slots: int) -> bool:
        """Count the next job in; True when it borrows."""
        if self.borrows(team, slots):
            return True
        self.add_within(team, slots)
        return False


_STARTED = attrgetter("started_at", "id")
_STARTED_AT = attrgetter("started_at")


def classify(running: Iterable[RunningJob], team_slots: Mapping[str, int]) -> tuple[set[int], QuotaLedger]:
    """(ids of the borrowing running jobs, the ledger of within-quota running slots per team):
    per team in start order; jobs being stopped (not preemptible) are left out."""
    ledger = QuotaLedger(team_slots)
    within = ledger.within
    borrowing: set[int] = set()
    running = list(running)
    starts = [r.started_at for r in running]  # unique (the usual case): floats sort 3x faster than tuples
    for r in sorted(running, key=_STARTED_AT if len(set(starts)) == len(starts) else _STARTED):
        # ledger.take, inline (64,000 running jobs at 10,000 nodes)
        t = r.team
        if t is None or t not in team_slots or not r.preemptible:
            continue  # no quota: never borrows; being stopped: not counted
        quota, slots = team_slots[t], within.get(t, 0) + r.slots
        if quota is not None and slots > quota:
            borrowing.add(r.id)
        else:
            within[t] = slots
    return borrowing, ledger


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
