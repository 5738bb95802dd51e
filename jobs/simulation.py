"""Trace-driven simulation of the scheduling policies, under simulated time (pure Python, no ORM).

A trace (CSV: job_id,submit_s,user,team,slots,duration_s,estimate_s,priority; see
bench/tracegen.py) is replayed through the real `jobs.policy.scheduling.schedule()`: at every
event time (a submission, a job's end, a preempted job's exit) the simulator builds a
`ClusterView` and applies the `Decision` as the services would; and, as the services' periodic
tick does, every `tick_s` (300 simulated seconds) while jobs wait and when a running job passes
its predicted end (decisions that rested on it change). Only the simulator reads
`duration_s` (to end a job); the policies see `predicted_s`: under ``fifo`` and ``backfill`` the
user's declared `estimate_s`, under ``trainyard`` the predictor's (`TraceHistory`: the
estimate scaled by how the user's jobs that already finished compared with their estimates).

Modelling choices:
- The cluster: `nodes` x `slots_per_node`, nodes named n000.., racks of `rack_size` nodes.
- A job of `slots` <= slots_per_node runs on one node; a bigger one on
  nodes = ceil(slots / slots_per_node) nodes with procs_per_node = ceil(slots / nodes) each
  (exact for the powers of two traces use; otherwise it holds up to nodes - 1 extra slots,
  and all its figures count nodes x procs_per_node).
- Jobs larger than the cluster are skipped (listed in `skipped_jobs`).
- Entitlements: `quotas` ({team: slots}), else equal shares of the cluster (floor(slots /
  teams in the trace)); they are the policies' team quotas too (only trainyard acts on them).
- Preemption (trainyard's reclaim) is cooperative: the victim exits `preempt_exit_s` (30 s)
  after the decision and loses the work since its last checkpoint; checkpoints happen every
  `checkpoint_every_s` (10 simulated minutes) from the attempt's start. It is queued again
  with its original submission time and the remaining work; its prediction is the predicted
  total minus the checkpointed work (at least a minute).
- Fair-share usage decays with `half_life_s` (fairshare.UsageMeter).

Output (`simulate()` returns it, `manage.py simulate --json` prints it): `avg_jct_s`,
`p50_jct_s`, `p99_jct_s` (job completion time: end - submission), `avg_wait_s` (first start -
submission), `makespan_s` (last end - first submission), `utilization` (busy slot-seconds /
(cluster slots x makespan), lost work included), `preemptions`, `lost_slot_s`, and per team
`entitlement_slots`, `used_slot_s`, `demand_slot_s` and `share_of_entitlement`: the slot-time
the team received, counted up to its entitlement at each instant, over what its entitlement
would have given it while it had work (at each instant min(entitlement, slots of its queued
and running jobs)): 1.0 = it always had all it was entitled to and could use. Counting receipts
only up to the entitlement makes borrowing at one time unable to hide starvation at another.
"""
from __future__ import annotations

import csv
import heapq
import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence

from .policy.fairshare import DEFAULT_HALF_LIFE_S, UsageMeter
from .policy.predictor import TraceHistory
from .policy.scheduling import POLICIES, ClusterView, NodeState, Quotas, QueuedJob, RunningJob, schedule

TRACE_COLUMNS = ("job_id", "submit_s", "user", "team", "slots", "duration_s", "estimate_s", "priority")


class TraceError(ValueError):
    """A trace or quota file the simulator cannot use; the message names the problem."""


@dataclass(frozen=True)
class TraceJob:
    job_id: int
    submit_s: float
    user: str
    team: str
    slots: int
    duration_s: float
    estimate_s: float
    priority: int = 1


@dataclass(frozen=True)
class SimConfig:
    policy: str = "trainyard"
    nodes: int = 32
    slots_per_node: int = 8
    rack_size: int = 8
    quotas: Mapping[str, int] | None = None
    checkpoint_every_s: float = 600.0
    preempt_exit_s: float = 30.0
    half_life_s: float = DEFAULT_HALF_LIFE_S
    tick_s: float = 300.0


def read_trace(lines: Iterable[str], name: str = "trace") -> list[TraceJob]:
    reader = csv.DictReader(lines)
    if not reader.fieldnames:
        raise TraceError(f"{name} is empty: expected a CSV header with {', '.join(TRACE_COLUMNS)}")
    fields = [f.strip() for f in reader.fieldnames]
    missing = [c for c in TRACE_COLUMNS if c not in fields]
    if missing:
        raise TraceError(f"{name} lacks column(s) {', '.join(missing)} (has {', '.join(fields)})")
    reader.fieldnames = fields
    jobs, seen = [], set()
    for row in reader:
        line = reader.line_num

        def num(col: str, kind=float, minimum: float | None = None, strictly: bool = False):
            raw = (row.get(col) or "").strip()
            try:
                v = float(raw)
            except ValueError:
                raise TraceError(f"{name} line {line}: {col} is not a number: {raw!r}") from None
            if not math.isfinite(v):
                raise TraceError(f"{name} line {line}: {col} is not a finite number: {raw!r}")
            if kind is int:
                if v != int(v):
                    raise TraceError(f"{name} line {line}: {col} must be a whole number, got {raw!r}")
                v = int(v)
            if minimum is not None and (v <= minimum if strictly else v < minimum):
                raise TraceError(f"{name} line {line}: {col} must be {'>' if strictly else '>='} {minimum:g}, "
                                 f"got {raw}")
            return v

        job = TraceJob(num("job_id", int), num("submit_s", float, 0), (row.get("user") or "").strip(),
                       (row.get("team") or "").strip(), num("slots", int, 1), num("duration_s", float, 0, True),
                       num("estimate_s", float, 0, True), num("priority", int))
        if job.job_id in seen:
            raise TraceError(f"{name} line {line}: job_id {job.job_id} appears twice")
        seen.add(job.job_id)
        jobs.append(job)
    if not jobs:
        raise TraceError(f"{name} has a header but no jobs")
    return jobs


def read_quotas(obj, name: str = "quotas") -> dict[str, int]:
    if not isinstance(obj, dict):
        raise TraceError(f"{name} must be a JSON object {{\"team\": slots, ...}}")
    out = {}
    for team, slots in obj.items():
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise TraceError(f"{name}: the quota of team {team!r} must be a whole number of slots >= 0, got {slots!r}")
        out[str(team)] = slots
    return out


def gang_shape(slots: int, slots_per_node: int) -> tuple[int, int]:
    """(nodes, procs_per_node) for a job of `slots` on nodes of `slots_per_node` (see the module
    docstring)."""
    if slots <= slots_per_node:
        return 1, slots
    nodes = math.ceil(slots / slots_per_node)
    return nodes, math.ceil(slots / nodes)


class _Job:
    __slots__ = ("t", "nodes", "ppn", "slots", "saved", "first_start", "end", "attempt", "pred_total", "qjob")

    def __init__(self, t: TraceJob, spn: int):
        self.t = t
        self.nodes, self.ppn = gang_shape(t.slots, spn)
        self.slots = self.nodes * self.ppn
        self.saved = 0.0
        self.first_start: float | None = None
        self.end: float | None = None
        self.attempt = 0
        self.pred_total = t.estimate_s
        self.qjob: QueuedJob | None = None

    def queued(self) -> QueuedJob:
        self.qjob = QueuedJob(self.t.job_id, self.t.priority, self.nodes, self.ppn, team=self.t.team,
                              user=self.t.user, submitted_at=self.t.submit_s,
                              predicted_s=max(self.pred_total - self.saved, 60.0))
        return self.qjob


def _percentile(sorted_values: Sequence[float], p: float) -> float:
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(p / 100.0 * len(sorted_values)) - 1))
    return sorted_values[k]


def simulate(trace: Sequence[TraceJob], config: SimConfig = SimConfig(), *,
             log: Callable[[str], None] | None = None) -> dict:
    if config.policy not in POLICIES:
        raise TraceError(f"unknown policy {config.policy!r}; one of {', '.join(POLICIES)}")
    if config.nodes < 1 or config.slots_per_node < 1:
        raise TraceError("the cluster needs at least one node with at least one slot")
    spn, capacity = config.slots_per_node, config.nodes * config.slots_per_node
    names = [f"n{i:03d}" for i in range(config.nodes)]
    racks = {n: f"r{i // max(1, config.rack_size):02d}" for i, n in enumerate(names)}
    used: dict[str, set[int]] = {n: set() for n in names}
    all_jobs = [_Job(t, spn) for t in sorted(trace, key=lambda t: (t.submit_s, t.job_id))]
    skipped = [j.t.job_id for j in all_jobs if j.nodes > config.nodes]
    jobs = [j for j in all_jobs if j.nodes <= config.nodes]
    if not jobs:
        raise TraceError(f"no job of the trace fits a cluster of {config.nodes} x {spn} slots")
    teams = sorted({j.t.team for j in jobs})
    if config.quotas is not None:
        ent = {t: int(config.quotas.get(t, 0)) for t in teams}
        team_q = dict(config.quotas)
    else:
        ent = {t: capacity // len(teams) for t in teams}
        team_q = dict(ent)
    quotas = Quotas(team_q, {})
    trainyard = config.policy == "trainyard"
    hist = TraceHistory()
    meter = UsageMeter(config.half_life_s)
    queued: dict[int, _Job] = {}
    by_user: dict[str, set[int]] = {}
    running: dict[int, list] = {}  # id -> [job, RunningJob]
    events: list = []  # (time, seq, kind, job id, attempt)
    seq = 0
    team_run = {t: 0 for t in teams}
    team_demand = {t: 0 for t in teams}
    got = {t: 0.0 for t in teams}
    owed = {t: 0.0 for t in teams}
    used_s = {t: 0.0 for t in teams}
    demand_s = {t: 0.0 for t in teams}
    busy_s = lost_s = 0.0
    preemptions = ticks = 0
    t0 = jobs[0].t.submit_s
    last = t0
    nxt = 0
    finished = 0
    next_tick = -math.inf
    stuck = False

    def predict(j: _Job) -> None:
        j.pred_total = hist.predict(j.t.user, j.t.slots, j.t.estimate_s) if trainyard else j.t.estimate_s

    while nxt < len(jobs) or running or queued:
        if nxt >= len(jobs) and not running and stuck:
            raise RuntimeError(f"simulation stuck: {len(queued)} job(s) can never start (policy {config.policy})")
        t = min(jobs[nxt].t.submit_s if nxt < len(jobs) else math.inf, events[0][0] if events else math.inf)
        dt = t - last
        if dt > 0:
            for team in teams:
                r, d, e = team_run[team], team_demand[team], ent[team]
                got[team] += min(r, e) * dt
                owed[team] += min(d, e) * dt
                used_s[team] += r * dt
                demand_s[team] += d * dt
                busy_s += r * dt
            meter.advance(t, team_run)
            last = t
        while events and events[0][0] <= t:
            _, _, kind, jid, attempt = heapq.heappop(events)
            if kind == "tick":
                continue
            entry = running.get(jid)
            if entry is None or entry[0].attempt != attempt:
                continue  # stale: the attempt already ended
            j, rj = entry
            del running[jid]
            for node, ids in rj.nodes:
                used[node].difference_update(ids)
            team_run[j.t.team] -= j.slots
            if kind == "end":
                j.end = t
                finished += 1
                team_demand[j.t.team] -= j.slots
                hist.add(j.t.user, j.t.slots, j.t.estimate_s, j.t.duration_s)
                if trainyard:
                    for qid in by_user.get(j.t.user, ()):
                        q = queued[qid]
                        predict(q)
                        q.queued()
            else:  # a preempted attempt exits: keep the checkpointed work, lose the rest
                done = t - rj.started_at
                kept = math.floor(done / config.checkpoint_every_s) * config.checkpoint_every_s
                j.saved += kept
                lost_s += (done - kept) * j.slots
                preemptions += 1
                queued[jid] = j
                by_user.setdefault(j.t.user, set()).add(jid)
                j.queued()
        while nxt < len(jobs) and jobs[nxt].t.submit_s <= t:
            j = jobs[nxt]
            nxt += 1
            predict(j)
            j.queued()
            queued[j.t.job_id] = j
            by_user.setdefault(j.t.user, set()).add(j.t.job_id)
            team_demand[j.t.team] += j.slots
        if not queued:
            continue
        view = ClusterView(
            now=t,
            nodes=tuple(NodeState(n, n, spn, frozenset(used[n]), True, racks[n]) for n in names),
            running=tuple(e[1] for e in running.values()),
            queue=tuple(j.qjob for j in queued.values()),
            quotas=quotas, usage=meter.usage, policy=config.policy, half_life_s=config.half_life_s)
        decision = schedule(view)
        ticks += 1
        stuck = not decision.placements and not decision.preemptions
        for p in decision.placements:
            j = queued.pop(p.job_id)
            by_user[j.t.user].discard(p.job_id)
            shares = tuple((s.node, s.slot_ids) for s in p.shares)
            for node, ids in shares:
                used[node].update(ids)
            j.attempt += 1
            if j.first_start is None:
                j.first_start = t
            seq += 1
            end = t + j.t.duration_s - j.saved
            heapq.heappush(events, (end, seq, "end", j.t.job_id, j.attempt))
            if t + j.qjob.predicted_s < end:  # look again when the prediction turns out wrong
                seq += 1
                heapq.heappush(events, (t + j.qjob.predicted_s + 1.0, seq, "tick", 0, 0))
            running[j.t.job_id] = [j, RunningJob(j.t.job_id, j.t.team, j.t.user, j.slots, j.t.priority, shares,
                                                 t, t + j.qjob.predicted_s)]
            team_run[j.t.team] += j.slots
        for pr in decision.preemptions:
            entry = running[pr.job_id]
            entry[1] = replace(entry[1], preemptible=False, preempted_for=pr.for_job)
            seq += 1
            heapq.heappush(events, (t + config.preempt_exit_s, seq, "exit", pr.job_id, entry[0].attempt))
        if queued and next_tick <= t:  # re-evaluate periodically while jobs wait, as the services do
            next_tick = t + config.tick_s
            seq += 1
            heapq.heappush(events, (next_tick, seq, "tick", 0, 0))
        if log and ticks % 2000 == 0:
            log(f"t={t - t0:.0f}s: {finished}/{len(jobs)} done, {len(queued)} queued, {len(running)} running")
    jct = sorted(j.end - j.t.submit_s for j in jobs)
    waits = [j.first_start - j.t.submit_s for j in jobs]
    makespan = max(j.end for j in jobs) - t0
    return {
        "policy": config.policy,
        "jobs": len(jobs),
        "skipped_jobs": skipped,
        "nodes": config.nodes,
        "slots_per_node": spn,
        "avg_jct_s": round(sum(jct) / len(jct), 1),
        "p50_jct_s": round(_percentile(jct, 50), 1),
        "p99_jct_s": round(_percentile(jct, 99), 1),
        "avg_wait_s": round(sum(waits) / len(waits), 1),
        "makespan_s": round(makespan, 1),
        "utilization": round(busy_s / (capacity * makespan), 4) if makespan > 0 else 0.0,
        "preemptions": preemptions,
        "lost_slot_s": round(lost_s, 1),
        "checkpoint_every_s": config.checkpoint_every_s,
        "teams": {team: {
            "entitlement_slots": ent[team],
            "used_slot_s": round(used_s[team], 1),
            "demand_slot_s": round(demand_s[team], 1),
            "share_of_entitlement": round(got[team] / owed[team], 4) if owed[team] > 0 else None,
        } for team in teams},
        "min_share_of_entitlement": min((got[t] / owed[t] for t in teams if owed[t] > 0), default=None),
        "ticks": ticks,
    }
