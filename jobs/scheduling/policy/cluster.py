"""The scheduler's contract: a cluster snapshot in (`ClusterView`), a `Decision` out.

Frozen dataclasses, no Django, no I/O: `selectors.cluster_view` builds a view from the database,
`jobs.scheduling.simulation` from a trace, and `services` applies the decision. Also here: when a running
job's slots are expected back (`expected_end`), which the tick's reservations and reclaim
checks and the start-time predictions all rest on; and `gc_paused`, which the entry points
(`schedule`, `queue_order`, `predict_starts`) run under.
"""
from __future__ import annotations

import functools
import gc
from dataclasses import dataclass, field
from typing import Callable, Mapping, TypeVar

from jobs.scheduling.policy.fairshare import DEFAULT_HALF_LIFE_S

POLICIES = ("fifo", "backfill", "trainyard")
# A running job past its predicted end: its prediction was wrong, and with heavy-tailed run
# times the longer a job has run the longer it is likely to go on (a job 2 h into a predicted
# 1 h is more likely a 4 h job than one about to end). Assume it runs on for half of the time it
# has run so far, and at least OVERDUE_GRACE_S.
OVERDUE_GRACE_S = 60.0
OVERDUE_FACTOR = 0.5
# A job being stopped (preempted or cancelled): the runtime saves a checkpoint and exits; its
# slots are expected back this long from now (an assumption, generous for the demo models).
STOP_GRACE_S = 30.0
# Reclaim only when the within-quota job would otherwise wait longer than this for running jobs
# to end by their predicted times: preempting costs the victim the work since its last
# checkpoint (10 minutes at most with the default cadence) and a restart, so it only pays when
# the wait it saves is longer.
RECLAIM_WAIT_S = 600.0
# An elastic job predicted to end within this many seconds does not grow: the restart would cost
# more than the extra nodes save (settings.TRAINYARD_ELASTIC_GROW_MIN_S).
GROW_MIN_LEFT_S = 300.0


@dataclass(frozen=True)
class NodeState:
    """A node as the scheduler sees it: its slots, which are in use, and whether it takes work."""
    name: str
    address: str
    slots: int
    used_slot_ids: frozenset[int]
    schedulable: bool = True  # READY and not quarantined; DRAINING/CORDONED/QUARANTINED/LOST take no new work
    rack: str | None = None   # the node's `rack` label
    # What its heartbeat advertises (eligibility.py): "cuda" with `gpus` GPUs of at least
    # `gpu_memory_bytes` each, "cpu", or "" (nothing advertised); and all its labels, sorted pairs.
    device: str = "cpu"
    gpus: int = 0
    gpu_memory_bytes: int = 0
    labels: tuple[tuple[str, str], ...] = ()
    pool: str = ""  # a seat of a Slurm pool (jobs/fleet/services/slurm.py): only that pool's jobs run here

    @property
    def free_slot_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.slots) if i not in self.used_slot_ids)


@dataclass(frozen=True)
class QueuedJob:
    """A job waiting to start: its gang shape (`nodes` x `procs_per_node`) and what orders it."""
    id: int
    priority: int
    nodes: int
    procs_per_node: int
    avoid: frozenset[str] = frozenset()  # nodes a restart should avoid if it can
    team: str | None = None
    user: str = ""
    submitted_at: float = 0.0   # epoch s
    predicted_s: float = 3600.0  # predicted run time (predictor.py)
    # Where it may run (eligibility.py): its device, the memory each GPU must have, and the
    # labels (sorted pairs) every node it uses must carry.
    device: str = "cpu"
    gpu_memory_bytes: int = 0
    labels: tuple[tuple[str, str], ...] = ()
    # Elastic (`resources.nodes: {min, max}`; elastic.py): `nodes` is the most, `min_nodes` the
    # least it runs on (None: exactly `nodes`), and `predicted_s` is its run time on `nodes`.
    # `restart_now`: it was stopped to resize (grow, reclaim shrink) or lost a node: it starts
    # again at once on as many nodes as are free (at least min_nodes), without weighing the wait.
    min_nodes: int | None = None
    restart_now: bool = False
    pool: str = ""  # `resources.pool`: "" = Trainyard's own agents, else the seats of that pool

    @property
    def slots(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nodes


@dataclass(frozen=True)
class RunningJob:
    """A job holding slots now, with its predicted end (reservations and reclaim count on it)."""
    id: int
    team: str | None
    user: str
    slots: int
    priority: int
    nodes: tuple[tuple[str, tuple[int, ...]], ...]  # (node name, slot ids) per share
    started_at: float
    predicted_end: float
    preemptible: bool = True          # False while it is being preempted or stopped
    preempted_for: int | None = None  # the queued job an in-flight preemption frees its slots for
    # An elastic job: its shape as queued at its most nodes (min_nodes, procs_per_node, device,
    # labels), what growing (elastic.py) and reclaim's shrinking go by; None: a fixed-size job.
    elastic: QueuedJob | None = None


@dataclass(frozen=True)
class Quotas:
    """Team entitlements, user caps and spent budgets (see quotas.py for how they classify jobs)."""
    team_slots: Mapping[str, int] = field(default_factory=dict)  # entitlement per team; absent = no quota
    user_slots: Mapping[str, int] = field(default_factory=dict)  # hard cap per user; absent = none
    over_budget: frozenset[str] = frozenset()  # teams, and "user:<name>", whose device-hours are spent


@dataclass(frozen=True)
class ClusterView:
    """Everything one scheduling decision needs: the input of `schedule` and `predict_starts`."""
    now: float
    nodes: tuple[NodeState, ...]
    running: tuple[RunningJob, ...] = ()
    queue: tuple[QueuedJob, ...] = ()
    quotas: Quotas = Quotas()
    usage: Mapping[str, float] = field(default_factory=dict)  # decayed slot-seconds per team (fairshare.py)
    policy: str = "trainyard"  # fifo | backfill | trainyard
    half_life_s: float = DEFAULT_HALF_LIFE_S  # caps the slot-seconds a job adds to its team's fair-share total
    reclaim_wait_s: float = RECLAIM_WAIT_S  # see RECLAIM_WAIT_S (settings.TRAINYARD_RECLAIM_WAIT_S)
    grow_min_left_s: float = GROW_MIN_LEFT_S  # see GROW_MIN_LEFT_S


@dataclass(frozen=True)
class Share:
    """One node's part of a gang placement: the slots the job's processes there use."""
    node: str
    address: str
    node_rank: int
    slot_ids: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """Start this queued job on these shares now (`borrowing`: beyond its team's quota)."""
    job_id: int
    shares: tuple[Share, ...]
    borrowing: bool = False
    reason: str = ""  # an elastic job on fewer than its most nodes: why this count (its timeline says)


@dataclass(frozen=True)
class Preemption:
    """Stop this running job (cooperatively: it checkpoints first) to make room for `for_job`."""
    job_id: int
    reason: str  # shown on the job page
    for_job: int | None
    resize_to: int | None = None  # an elastic job stopped to restart at once on this many nodes


@dataclass(frozen=True)
class Decision:
    """What one tick decided: the services apply it in one transaction."""
    placements: tuple[Placement, ...]
    preemptions: tuple[Preemption, ...] = ()
    waiting: dict = field(default_factory=dict)  # job id -> human reason it did not start
    order: tuple[int, ...] = ()  # queue order used (position = index + 1)
    borrowing: frozenset[int] = frozenset()  # running jobs borrowing under the current quotas


def check_policy(policy: str) -> None:
    """Raise ValueError for a policy name not in POLICIES (a typo would silently mean trainyard)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")


def expected_end(r: RunningJob, now: float) -> float:
    """When the running job's slots are expected back: its predicted end; one past it runs on for
    OVERDUE_FACTOR of the time it has run (at least OVERDUE_GRACE_S); one being stopped ends
    STOP_GRACE_S from now at the latest."""
    if not r.preemptible:
        return min(r.predicted_end, now + STOP_GRACE_S) if r.predicted_end > now else now + STOP_GRACE_S
    if r.predicted_end > now:
        return r.predicted_end
    return now + max(OVERDUE_GRACE_S, OVERDUE_FACTOR * (now - r.started_at))


_F = TypeVar("_F", bound=Callable)


def gc_paused(fn: _F) -> _F:
    """Run fn with the cyclic garbage collector off (restored after, if it was on). A tick at
    10,000 nodes and 100,000 queued jobs allocates a few hundred thousand objects that outlive
    the young generations (placements, order and end tuples), and every collection that
    triggers walks every tracked object in the process: the view's jobs, and in a worker all of
    Django's. That was 0.4-0.6 s of a 1.2-1.9 s tick and ~2 s of predict_starts (bench/scheduler.py
    on the 2-core dev machine). What the policy allocates is freed by reference counting; its
    few cycles (a tick's own state) are collected after."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()
    return paused  # type: ignore[return-value]
