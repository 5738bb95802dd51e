"""Queue order and gang placement: a pure function of a cluster snapshot.

Order: priority (high first), then FIFO by submission (job id). Placement is gang (every process of
a job or none) and first fit over READY nodes in name order, one share of `procs_per_node` slots
on each of `nodes` distinct nodes. The queue is strict: when the head job does not fit, jobs
behind it wait too, so a large job is never starved by a stream of small ones. A job that cannot
fit even on an empty copy of today's READY nodes does not block the queue (it waits for nodes).
A restarted job avoids the nodes its last failure implicated (`avoid`) unless it could never fit
on the others.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeState:
    name: str
    address: str
    slots: int
    used_slot_ids: frozenset[int]
    schedulable: bool = True  # READY; DRAINING/CORDONED/QUARANTINED/LOST take no new work

    @property
    def free_slot_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.slots) if i not in self.used_slot_ids)


@dataclass(frozen=True)
class QueuedJob:
    id: int
    priority: int
    nodes: int
    procs_per_node: int
    avoid: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Share:
    node: str
    address: str
    node_rank: int
    slot_ids: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    job_id: int
    shares: tuple[Share, ...]


@dataclass(frozen=True)
class Decision:
    placements: tuple[Placement, ...]
    waiting: dict  # job id -> human reason it did not start


def queue_order(jobs: list[QueuedJob]) -> list[QueuedJob]:
    return sorted(jobs, key=lambda j: (-j.priority, j.id))


def _place(job: QueuedJob, free: dict[str, tuple[int, ...]], nodes: list[NodeState]) -> Placement | None:
    chosen = [n for n in nodes if n.schedulable and len(free[n.name]) >= job.procs_per_node][: job.nodes]
    if len(chosen) < job.nodes:
        return None
    return Placement(job.id, tuple(
        Share(n.name, n.address, rank, free[n.name][: job.procs_per_node]) for rank, n in enumerate(chosen)))


def schedule(nodes: list[NodeState], queue: list[QueuedJob]) -> Decision:
    nodes = sorted(nodes, key=lambda n: n.name)
    free = {n.name: n.free_slot_ids for n in nodes}
    empty = {n.name: tuple(range(n.slots)) for n in nodes}
    placements: list[Placement] = []
    waiting: dict[int, str] = {}
    blocked_by: int | None = None
    for job in queue_order(queue):
        if blocked_by is not None:
            waiting[job.id] = f"behind job {blocked_by} in the queue"
            continue
        usable = nodes
        if job.avoid:
            without = [n for n in nodes if n.name not in job.avoid]
            if _place(job, empty, without) is not None:
                usable = without
        placement = _place(job, free, usable)
        if placement is not None:
            placements.append(placement)
            for share in placement.shares:
                free[share.node] = tuple(i for i in free[share.node] if i not in share.slot_ids)
            continue
        if _place(job, empty, usable) is None:
            waiting[job.id] = (f"needs {job.nodes} schedulable node(s) with {job.procs_per_node} slot(s) each; "
                               f"waiting for nodes")
            continue
        waiting[job.id] = "waiting for free slots" + (
            f" (avoiding {', '.join(sorted(job.avoid))})" if usable is not nodes else "")
        blocked_by = job.id
    return Decision(tuple(placements), waiting)


def fits_cluster(nodes: list[NodeState], nodes_needed: int, procs_per_node: int) -> bool:
    """Could the job ever run on these nodes (all of them empty), whatever their status?"""
    return sum(1 for n in nodes if n.slots >= procs_per_node) >= nodes_needed
