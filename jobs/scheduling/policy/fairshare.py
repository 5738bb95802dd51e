"""Fair-share inputs: exponentially decayed usage per team, and entitlements.

A team's *usage* is its slot-seconds weighted by age: a slot-second used `a` seconds ago counts
`2 ** (-a / half_life_s)`. With the default half-life of 6 hours, yesterday's burst still weighs
about 1/16 of today's, so a team that ran big jobs overnight yields to the others in the morning
without being punished for last week. One slot held forever converges to
`half_life_s / ln 2` slot-seconds (~31,000 for 6 h).

Pure: intervals in, numbers out. The services compute `decayed_usage` over the attempts that
ran in the last few half-lives (older ones weigh < 1/16 after 4); the simulator keeps a
`UsageMeter` and advances it event by event.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

DEFAULT_HALF_LIFE_S = 6 * 3600.0
# Beyond this many half-lives an interval weighs < 1/16 of a fresh one: callers may skip older rows.
USAGE_LOOKBACK_HALF_LIVES = 4


def decayed_slot_seconds(slots: float, start: float, end: float, now: float,
                         half_life_s: float = DEFAULT_HALF_LIFE_S) -> float:
    """slots x the integral of 2**(-(now - t)/half_life) over [start, min(end, now)]."""
    end = min(end, now)
    if end <= start or slots <= 0:
        return 0.0
    k = math.log(2) / half_life_s
    return slots / k * (math.exp(-k * (now - end)) - math.exp(-k * (now - start)))


def decayed_usage(intervals: Iterable[tuple[str | None, float, float, float | None]], now: float,
                  half_life_s: float = DEFAULT_HALF_LIFE_S) -> dict[str | None, float]:
    """Decayed slot-seconds per team from `(team, slots, started_at, ended_at or None)` intervals
    (None: still running, counts up to `now`)."""
    out: dict[str | None, float] = {}
    for team, slots, start, end in intervals:
        v = decayed_slot_seconds(slots, start, now if end is None else end, now, half_life_s)
        if v:
            out[team] = out.get(team, 0.0) + v
    return out


def entitlements(team_slots: Mapping[str, int], teams: Iterable[str | None], total_slots: int) -> dict:
    """Slots each team is entitled to: its quota, or for a team without one an equal share of
    the cluster (total slots / number of teams with work)."""
    teams = set(teams)
    equal = total_slots / max(1, len(teams))
    return {t: float(team_slots[t]) if t in team_slots else equal for t in teams}


@dataclass
class UsageMeter:
    """Incremental decayed usage (the simulator's): call `advance(now, running_slots_by_team)`
    at every event with the slots each team held since the previous call."""
    half_life_s: float = DEFAULT_HALF_LIFE_S
    t: float = 0.0
    usage: dict = field(default_factory=dict)

    def advance(self, now: float, running: Mapping[str | None, float]) -> None:
        dt = now - self.t
        if dt <= 0:
            return
        k = math.log(2) / self.half_life_s
        f = math.exp(-k * dt)
        gain = (1.0 - f) / k  # slot-seconds one slot adds over dt, decayed to `now`
        for team in set(self.usage) | set(running):
            self.usage[team] = self.usage.get(team, 0.0) * f + running.get(team, 0.0) * gain
        self.t = now
