"""Trace-driven simulation of the scheduling policies, under simulated time (pure Python, no ORM).

A trace (CSV: job_id,submit_s,user,team,slots,duration_s,estimate_s,priority; see
bench/tracegen.py) is replayed through the real `jobs.scheduling.policy.schedule()`: at every
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
- Elastic jobs: a trace row may carry `min_slots` (optional column): the job runs on any node
  count from ceil(min_slots / procs_per_node) to its nodes, and its duration is on all of them
  (on k of N nodes it progresses at k / N: work scales linearly). A resize (a grow, or reclaim
  shrinking it) is a cooperative stop that keeps all the work done (it checkpoints at the stop)
  and costs `resize_cost_s` of restart on the next attempt. `elastic=False` runs every job at its
  most nodes (the fixed-size baseline of the same trace); the report adds `resizes`.

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

from jobs.scheduling.policy.fairshare import DEFAULT_HALF_LIFE_S, UsageMeter
from jobs.planning.policy.predictor import TraceHistory
from jobs.scheduling.policy import POLICIES, ClusterView, NodeState, Placement, Quotas, QueuedJob, RunningJob, schedule

TRACE_COLUMNS = ("job_id", "submit_s", "user", "team", "slots", "duration_s", "estimate_s", "priority")
OPTIONAL_COLUMNS = ("min_slots",)  # an elastic job's least slots (empty: a fixed-size job)


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
    min_slots: int | None = None


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
    elastic: bool = True  # False: every elastic job runs at its most nodes (the fixed-size baseline)
    resize_cost_s: float = 30.0
    grow_min_left_s: float = 300.0


def _number(row: Mapping[str, str], col: str, where: str, kind=float, minimum: float | None = None,
            strictly: bool = False):
    """The trace row's `col` as a finite number of `kind`, at least (or above, `strictly`)
    `minimum`; `where` ("trace line 7") starts the error message."""
    raw = (row.get(col) or "").strip()
    try:
        v = float(raw)
    except ValueError:
        raise TraceError(f"{where}: {col} is not a number: {raw!r}") from None
    if not math.isfinite(v):
        raise TraceError(f"{where}: {col} is not a finite number: {raw!r}")
    if kind is int:
        if v != int(v):
            raise TraceError(f"{where}: {col} must be a whole number, got {raw!r}")
        v = int(v)
    if minimum is not None and (v <= minimum if strictly else v < minimum):
        raise TraceError(f"{where}: {col} must be {'>' if strictly else '>='} {minimum:g}, got {raw}")
    return v


def _trace_job(row: Mapping[str, str], where: str) -> TraceJob:
    slots = _number(row, "slots", where, int, 1)
    least = _number(row, "min_slots", where, int, 1) if (row.get("min_slots") or "").strip() else None
    if least is not None and least > slots:
        raise TraceError(f"{where}: min_slots ({least}) must not exceed slots ({slots})")
    return TraceJob(_number(row, "job_id", where, int), _number(row, "submit_s", where, float, 0),
                    (row.get("user") or "").strip(), (row.get("team") or "").strip(),
                    slots, _number(row, "duration_s", where, float, 0, True),
                    _number(row, "estimate_s", where, float, 0, True), _number(row, "priority", where, int), least)


def read_trace(lines: Iterable[str], name: str = "trace") -> list[TraceJob]:
    """Parse a CSV trace (TRACE_COLUMNS); TraceError names the file, line and column at fault."""
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
        job = _trace_job(row, f"{name} line {line}")
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
    __slots__ = ("t", "nodes", "ppn", "slots", "saved", "first_start", "end", "attempt", "pred_total", "qjob",
                 "min_nodes", "held", "restart_now", "cost")

    def __init__(self, t: TraceJob, spn: int, elastic: bool = True):
        self.t = t
        self.nodes, self.ppn = gang_shape(t.slots, spn)
        self.slots = self.nodes * self.ppn
        least = min(self.nodes, math.ceil(t.min_slots / self.ppn)) if elastic and t.min_slots else self.nodes
        self.min_nodes = least if least < self.nodes else None
        self.held = 0  # nodes of the running attempt
        self.restart_now = False
        self.cost = 0.0  # restart cost the next attempt pays (after a resize)
        self.saved = 0.0
        self.first_start: float | None = None
        self.end: float | None = None
        self.attempt = 0
        self.pred_total = t.estimate_s
        self.qjob: QueuedJob | None = None

    def queued(self) -> QueuedJob:
        self.qjob = QueuedJob(self.t.job_id, self.t.priority, self.nodes, self.ppn, team=self.t.team,
                              user=self.t.user, submitted_at=self.t.submit_s,
                              predicted_s=max(self.pred_total - self.saved, 60.0), min_nodes=self.min_nodes,
                              restart_now=self.restart_now)
        return self.qjob


def _percentile(sorted_values: Sequence[float], p: float) -> float:
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(p / 100.0 * len(sorted_values)) - 1))
    return sorted_values[k]


def _check(config: SimConfig) -> None:
    if config.policy not in POLICIES:
        raise TraceError(f"unknown policy {config.policy!r}; one of {', '.join(POLICIES)}")
    if config.nodes < 1 or config.slots_per_node < 1:
        raise TraceError("the cluster needs at least one node with at least one slot")


class _Simulation:
    """The replay's state: the simulated cluster, the jobs in each state, the event heap
    ((time, seq, kind, job id, attempt); kinds "end", "exit" of a preempted attempt, "tick"), and
    the running sums the report is made of. `simulate` drives it one event time at a time."""

    def __init__(self, trace: Sequence[TraceJob], config: SimConfig):
        self.config = config
        self.spn, self.capacity = config.slots_per_node, config.nodes * config.slots_per_node
        self.names = [f"n{i:03d}" for i in range(config.nodes)]
        self.racks = {n: f"r{i // max(1, config.rack_size):02d}" for i, n in enumerate(self.names)}
        self.used: dict[str, set[int]] = {n: set() for n in self.names}
        all_jobs = [_Job(t, self.spn, config.elastic) for t in sorted(trace, key=lambda t: (t.submit_s, t.job_id))]
        self.skipped = [j.t.job_id for j in all_jobs if j.nodes > config.nodes]
        self.jobs = [j for j in all_jobs if j.nodes <= config.nodes]
        if not self.jobs:
            raise TraceError(f"no job of the trace fits a cluster of {config.nodes} x {self.spn} slots")
        self.teams = teams = sorted({j.t.team for j in self.jobs})
        if config.quotas is not None:
            self.ent = {t: int(config.quotas.get(t, 0)) for t in teams}
            self.quotas = Quotas(dict(config.quotas), {})
        else:
            self.ent = {t: self.capacity // len(teams) for t in teams}
            self.quotas = Quotas(dict(self.ent), {})
        self.trainyard = config.policy == "trainyard"
        self.hist = TraceHistory()
        self.meter = UsageMeter(config.half_life_s)
        self.queued: dict[int, _Job] = {}
        self.by_user: dict[str, set[int]] = {}  # user -> ids of their queued jobs
        self.running: dict[int, list] = {}  # id -> [job, RunningJob]
        self.events: list = []
        self.seq = 0
        self.team_run = {t: 0 for t in teams}     # running slots now
        self.team_demand = {t: 0 for t in teams}  # queued and running slots now
        self.got = {t: 0.0 for t in teams}        # slot-s received, up to the entitlement
        self.owed = {t: 0.0 for t in teams}       # slot-s the entitlement would have given
        self.used_s = {t: 0.0 for t in teams}
        self.demand_s = {t: 0.0 for t in teams}
        self.busy_s = self.lost_s = 0.0
        self.preemptions = self.ticks = self.finished = self.nxt = self.resizes = 0
        self.resizing: set[int] = set()  # jobs stopping to resize (they keep their work)
        self.t0 = self.last = self.jobs[0].t.submit_s
        self.next_tick = -math.inf
        self.stuck = False

    def pending(self) -> bool:
        if self.nxt < len(self.jobs) or self.running or self.queued:
            if self.nxt >= len(self.jobs) and not self.running and self.stuck:
                raise RuntimeError(f"simulation stuck: {len(self.queued)} job(s) can never start "
                                   f"(policy {self.config.policy})")
            return True
        return False

    def next_time(self) -> float:
        return min(self.jobs[self.nxt].t.submit_s if self.nxt < len(self.jobs) else math.inf,
                   self.events[0][0] if self.events else math.inf)

    def _push(self, t: float, kind: str, jid: int, attempt: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, jid, attempt))

    def _predict(self, j: _Job) -> None:
        j.pred_total = self.hist.predict(j.t.user, j.t.slots, j.t.estimate_s) if self.trainyard else j.t.estimate_s

    def accrue(self, t: float) -> None:
        """Count the slot-time since the last event time at today's allocation and demand."""
        dt = t - self.last
        if dt <= 0:
            return
        for team in self.teams:
            r, d, e = self.team_run[team], self.team_demand[team], self.ent[team]
            self.got[team] += min(r, e) * dt
            self.owed[team] += min(d, e) * dt
            self.used_s[team] += r * dt
            self.demand_s[team] += d * dt
            self.busy_s += r * dt
        self.meter.advance(t, self.team_run)
        self.last = t

    def end_attempts(self, t: float) -> None:
        """Apply the events due by t: jobs that end, preempted attempts that exit."""
        while self.events and self.events[0][0] <= t:
            _, _, kind, jid, attempt = heapq.heappop(self.events)
            if kind == "tick":
                continue
            entry = self.running.get(jid)
            if entry is None or entry[0].attempt != attempt:
                continue  # stale: the attempt already ended
            j, rj = entry
            del self.running[jid]
            for node, ids in rj.nodes:
                self.used[node].difference_update(ids)
            self.team_run[j.t.team] -= j.held * j.ppn
            if kind == "end":
                self._finish(j, t)
            else:
                self._requeue(j, rj, t)

    def _finish(self, j: _Job, t: float) -> None:
        j.end = t
        self.finished += 1
        self.team_demand[j.t.team] -= j.slots
        self.hist.add(j.t.user, j.t.slots, j.t.estimate_s, j.t.duration_s)
        if self.trainyard:  # the user's history changed: so do their queued jobs' predictions
            for qid in self.by_user.get(j.t.user, ()):
                q = self.queued[qid]
                self._predict(q)
                q.queued()

    def _requeue(self, j: _Job, rj: RunningJob, t: float) -> None:
        """A preempted attempt exits: keep the checkpointed work, lose the rest, queue it again."""
        done = t - rj.started_at - j.cost  # the restart cost it paid first is no progress
        speed = j.held / j.nodes  # work (seconds on all its nodes) per second
        if j.t.job_id in self.resizing:  # it checkpointed at the stop: nothing lost
            self.resizing.discard(j.t.job_id)
            kept, j.restart_now, j.cost = done, True, self.config.resize_cost_s
            self.resizes += 1
        else:
            kept = math.floor(done / self.config.checkpoint_every_s) * self.config.checkpoint_every_s
            j.restart_now, j.cost = False, 0.0
            self.preemptions += 1
        j.saved += max(0.0, kept) * speed
        self.lost_s += max(0.0, done - kept) * j.held * j.ppn
        self.queued[j.t.job_id] = j
        self.by_user.setdefault(j.t.user, set()).add(j.t.job_id)
        j.queued()

    def submit(self, t: float) -> None:
        """Queue the trace's jobs submitted by t."""
        while self.nxt < len(self.jobs) and self.jobs[self.nxt].t.submit_s <= t:
            j = self.jobs[self.nxt]
            self.nxt += 1
            self._predict(j)
            j.queued()
            self.queued[j.t.job_id] = j
            self.by_user.setdefault(j.t.user, set()).add(j.t.job_id)
            self.team_demand[j.t.team] += j.slots

    def view(self, t: float) -> ClusterView:
        c = self.config
        return ClusterView(
            now=t,
            nodes=tuple(NodeState(n, n, self.spn, frozenset(self.used[n]), True, self.racks[n]) for n in self.names),
            running=tuple(e[1] for e in self.running.values()),
            queue=tuple(j.qjob for j in self.queued.values()),
            quotas=self.quotas, usage=self.meter.usage, policy=c.policy, half_life_s=c.half_life_s,
            grow_min_left_s=c.grow_min_left_s)

    def tick(self, t: float) -> None:
        """One scheduling decision at t, applied as the services would."""
        decision = schedule(self.view(t))
        self.ticks += 1
        self.stuck = not decision.placements and not decision.preemptions
        for p in decision.placements:
            self._start(p, t)
        for pr in decision.preemptions:
            entry = self.running[pr.job_id]
            if pr.resize_to is not None:
                self.resizing.add(pr.job_id)
            entry[1] = replace(entry[1], preemptible=False, preempted_for=pr.for_job)
            self._push(t + self.config.preempt_exit_s, "exit", pr.job_id, entry[0].attempt)
        if self.queued and self.next_tick <= t:  # re-evaluate periodically while jobs wait, as the services do
            self.next_tick = t + self.config.tick_s
            self._push(self.next_tick, "tick", 0, 0)

    def _start(self, p: Placement, t: float) -> None:
        j = self.queued.pop(p.job_id)
        self.by_user[j.t.user].discard(p.job_id)
        shares = tuple((s.node, s.slot_ids) for s in p.shares)
        for node, ids in shares:
            self.used[node].update(ids)
        j.attempt += 1
        if j.first_start is None:
            j.first_start = t
        j.held = k = len(shares)
        if not j.restart_now:
            j.cost = 0.0
        scale = j.nodes / k  # on fewer nodes it runs longer
        end = t + j.cost + (j.t.duration_s - j.saved) * scale
        predicted = j.cost + j.qjob.predicted_s * scale
        self._push(end, "end", j.t.job_id, j.attempt)
        if t + predicted < end:  # look again when the prediction turns out wrong
            self._push(t + predicted + 1.0, "tick", 0, 0)
        if j.min_nodes is not None and k < j.nodes:  # look again when a grow would pay
            self._push(t + self.config.tick_s, "tick", 0, 0)
        self.running[j.t.job_id] = [j, RunningJob(j.t.job_id, j.t.team, j.t.user, k * j.ppn, j.t.priority, shares,
                                                  t, t + predicted,
                                                  elastic=j.qjob if j.min_nodes is not None else None)]
        self.team_run[j.t.team] += k * j.ppn
        j.restart_now = False

    def growable(self) -> bool:
        """Whether a running elastic job is below its most nodes (a tick may grow it)."""
        return any(j.min_nodes is not None and j.held < j.nodes and rj.preemptible for j, rj in self.running.values())

    def progress(self, t: float) -> str:
        return (f"t={t - self.t0:.0f}s: {self.finished}/{len(self.jobs)} done, {len(self.queued)} queued, "
                f"{len(self.running)} running")

    def report(self) -> dict:
        """The figures the module docstring lists (simulate's result)."""
        c, jobs, teams, got, owed = self.config, self.jobs, self.teams, self.got, self.owed
        jct = sorted(j.end - j.t.submit_s for j in jobs)
        waits = [j.first_start - j.t.submit_s for j in jobs]
        makespan = max(j.end for j in jobs) - self.t0
        return {
            "policy": c.policy,
            "jobs": len(jobs),
            "skipped_jobs": self.skipped,
            "nodes": c.nodes,
            "slots_per_node": self.spn,
            "avg_jct_s": round(sum(jct) / len(jct), 1),
            "p50_jct_s": round(_percentile(jct, 50), 1),
            "p99_jct_s": round(_percentile(jct, 99), 1),
            "avg_wait_s": round(sum(waits) / len(waits), 1),
            "makespan_s": round(makespan, 1),
            "utilization": round(self.busy_s / (self.capacity * makespan), 4) if makespan > 0 else 0.0,
            "preemptions": self.preemptions,
            "resizes": self.resizes,
            "elastic_jobs": sum(1 for j in jobs if j.min_nodes is not None),
            "lost_slot_s": round(self.lost_s, 1),
            "checkpoint_every_s": c.checkpoint_every_s,
            "teams": {team: {
                "entitlement_slots": self.ent[team],
                "used_slot_s": round(self.used_s[team], 1),
                "demand_slot_s": round(self.demand_s[team], 1),
                "share_of_entitlement": round(got[team] / owed[team], 4) if owed[team] > 0 else None,
            } for team in teams},
            "min_share_of_entitlement": min((got[t] / owed[t] for t in teams if owed[t] > 0), default=None),
            "ticks": self.ticks,
        }


def simulate(trace: Sequence[TraceJob], config: SimConfig = SimConfig(), *,
             log: Callable[[str], None] | None = None) -> dict:
    """Replay the trace through the policy under simulated time and report its figures (see the
    module docstring). At each event time: accrue the slot-time since the last one, apply the
    ends and exits due, queue the new submissions, and, while jobs wait, run one tick.
    `log` gets a progress line every 2,000 ticks."""
    _check(config)
    sim = _Simulation(trace, config)
    while sim.pending():
        t = sim.next_time()
        sim.accrue(t)
        sim.end_attempts(t)
        sim.submit(t)
        if not sim.queued and not sim.growable():
            continue
        sim.tick(t)
        if log and sim.ticks % 2000 == 0:
            log(sim.progress(t))
    return sim.report()
