"""The launch-backend interface: one contract between the scheduler's decisions and the machines
(DESIGN.md, "Launch backends"; docs/architecture.md, "Launch backends").

The scheduler decides who runs, where and when (quotas, priority, fair share, gangs); a backend
turns an admitted attempt into processes on machines and says what became of them:

    submit(gang)            -> Handle     idempotent on the attempt: a second submit of the same
                                          tag returns the handle of the first, never a second job
    status(handles)         -> {handle: HandleStatus}   many at once (one squeue for all of them)
    cancel(handle, grace_s)               a stop signal now, the kill after grace_s
    signal(handle, sig)                   "checkpoint" or "preempt" notice to the gang's processes
    reconcile(live_tags)    -> Reconciled  everything carrying our tag: adopt those of live
                                          attempts, stop the orphans (`live_tags` answers `in`,
                                          asked after the listing: the caller may look again)
    capabilities                          native gang, requeue, suspend, elastic

Implementations: Trainyard's own node agents (`jobs.core.agents_backend.AgentsBackend`: Celery tasks on
each node's queue) and Slurm (`trainyard.slurm.SlurmBackend`: sbatch/squeue/sacct/scancel, an
ephemeral agent per allocated node). A Kubernetes backend (a JobSet admitted through a Kueue
LocalQueue) maps onto the same calls; docs/architecture.md says how.

Pure data and a Protocol: no Django, no I/O.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Container, Mapping, Protocol, Sequence, runtime_checkable

TAG_PREFIX = "trainyard-"
_TAG = re.compile(r"trainyard-(\d+)-a(\d+)")


class State(str, Enum):
    """What became of a submitted gang, as the backend sees it."""

    PENDING = "pending"        # accepted, waiting for machines (reason and category say why)
    RUNNING = "running"        # machines allocated (nodes say which)
    SUCCEEDED = "succeeded"
    FAILED = "failed"          # exit_code / detail say how
    PREEMPTED = "preempted"    # the backend took the machines back
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"        # no answer this time: never read as "gone" (the caller retries)

    @property
    def ended(self) -> bool:
        return self in (State.SUCCEEDED, State.FAILED, State.PREEMPTED, State.CANCELLED)


# Why a gang is pending, in the categories the job page shows (the backend's own reason beside it).
PENDING_CATEGORIES = ("resources", "priority", "limits", "held", "dependency", "other")


@dataclass(frozen=True)
class Capabilities:
    native_gang: bool   # all nodes of a gang are allocated together by the backend itself
    requeue: bool       # the backend can put a preempted gang back in its own queue
    suspend: bool       # the backend can suspend and resume a gang in place
    elastic: bool       # a running gang can grow or shrink without a restart


def attempt_tag(job_id: int, attempt_id: int) -> str:
    """The name every backend gives an attempt's gang (Slurm's --job-name): the idempotency key of
    submit and what reconcile looks for."""
    return f"{TAG_PREFIX}{job_id}-a{attempt_id}"


def parse_tag(tag: str) -> tuple[int, int] | None:
    """(job id, attempt id) of a tag attempt_tag made, None for anything else."""
    m = _TAG.fullmatch(tag)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class Gang:
    """One attempt's gang: `nodes` machines, each running `command` once (on Slurm, the ephemeral
    agent, which starts the node's `procs_per_node` ranks)."""

    job_id: int
    attempt_id: int
    nodes: int
    procs_per_node: int
    command: tuple[str, ...] = ()
    gpus_per_node: int = 0
    cpus_per_node: int = 0            # 0: the backend's default
    time_limit_s: int | None = None   # None: the pool's
    priority: int = 0                 # Trainyard's priority (each backend maps it onto its own)
    env: Mapping[str, str] = field(default_factory=dict)  # not secret: secrets travel in 0600 files
    # A backend that places onto machines Trainyard already knows (its own agents): each node's
    # sealed Launch, in node-rank order. A backend that allocates machines itself ignores it.
    launches: tuple[tuple[str, Mapping], ...] = ()

    @property
    def tag(self) -> str:
        return attempt_tag(self.job_id, self.attempt_id)


@dataclass(frozen=True)
class Handle:
    backend: str   # "agents" | "slurm:<pool>"
    id: str        # the backend's own id (a Slurm job id)


@dataclass(frozen=True)
class HandleStatus:
    state: State
    reason: str = ""               # the backend's own words (Slurm's pending reason, an exit reason)
    category: str = ""             # PENDING_CATEGORIES, for a pending gang
    eta: float | None = None       # a pending gang's expected start (epoch s), when the backend knows
    nodes: tuple[str, ...] = ()    # the machines of a running gang
    exit_code: int | None = None
    source: str = ""               # where the answer came from (squeue, sacct, scontrol)


@dataclass(frozen=True)
class Reconciled:
    adopted: tuple[tuple[str, Handle], ...] = ()   # (tag, handle) of live attempts' gangs
    cancelled: tuple[tuple[str, Handle], ...] = () # orphans stopped


class BackendError(Exception):
    """The backend could not be asked (command failed, host unreachable): transient, retry later."""


class SubmitRefused(BackendError):
    """The backend refused the gang itself (bad partition, account, limits): the attempt fails
    with this message, a placement failure."""


@runtime_checkable
class LaunchBackend(Protocol):
    name: str
    capabilities: Capabilities

    def submit(self, gang: Gang) -> Handle: ...

    def status(self, handles: Sequence[Handle]) -> dict[Handle, HandleStatus]: ...

    def cancel(self, handle: Handle, grace_s: float) -> None: ...

    def signal(self, handle: Handle, sig: str) -> None: ...

    def reconcile(self, live_tags: Container[str]) -> Reconciled: ...
