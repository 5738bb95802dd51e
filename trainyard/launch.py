"""The messages that cross the Celery bus between the control plane and the node agents, typed
once for both sides (pydantic and the standard library only).

The sender builds a model and sends `.model_dump(mode="json")` (`exclude_unset=True` where a
message has optional parts, so the JSON carries exactly the keys the sender set); the receiver
validates what arrives with the same model instead of reading dict keys. The JSON is the wire
format of the tasks below and did not change when these models were introduced.

    control plane --node.<name>--> agent     NODE_LAUNCH_TASK(Signed(Launch))   NODE_STOP_TASK(Signed(Stop))
                                             NODE_CALIBRATE_TASK(Signed(CalibrateRequest))  a staff request
    agent --control--> control plane         HEARTBEAT_TASK(Signed(Heartbeat))  every 2 s
                                             RANKS_TASK(Signed(RanksReport))  all ranks up
                                             NODE_EXIT_TASK(Signed(ExitReport))  once per node
                                             CALIBRATION_REPORT_TASK(Signed(CalibrationReport))
    control plane --Redis key--> ranks       keys.preempt_key(attempt) = PreemptRequest

Every report up the control queue is one `Signed` envelope (trainyard.nodeauth): the node's
name and an HMAC over the task name and body with the node's credential; the control plane
applies it only if the signature is the registered node's and the node owns what it reports on.
Every command down a node's queue is one too, sealed by the control plane with that node's
credential (which it derives from its master key and the node's salt): the agent runs only a
command for its own name, under the task it arrived as, signed with its credential and at most
COMMAND_MAX_AGE_S old, so nothing else that can write to its queue commands it.

Task names and queues (`trainyard.keys.CONTROL_QUEUE`, `node_queue`) are the only other thing
both sides must agree on; each side sends by name, so neither imports the other's tasks.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .keys import CONTROL_QUEUE

# ---------------------------------------------------------------- Celery task names

NODE_LAUNCH_TASK = "workers.tasks.node_launch"
# A command older than this is refused by the agent (launches wait in a node's queue while its
# agent restarts, so this is generous; clocks of the hosts may differ by a few seconds).
COMMAND_MAX_AGE_S = 3600.0
"""Node queue: start this node's share of an attempt (args: [Launch])."""
NODE_STOP_TASK = "workers.tasks.node_stop"
"""Node queue: stop an attempt's processes on this node (args: [Signed(Stop)])."""

SCHEDULE_TICK_TASK = "jobs.tasks.schedule_tick"
"""Control queue: one scheduling pass (beat every 2 s, and on submit and attempt end)."""
NODES_CHECK_TASK = "jobs.tasks.nodes_check"
"""Control queue: write off silent nodes and attempts stuck in launch (beat every 2 s)."""
ATTEMPTS_CHECK_TASK = "jobs.tasks.attempts_check"
"""Control queue: hang and straggler detection over committed telemetry (beat every 2 s)."""
ETA_REFRESH_TASK = "jobs.tasks.eta_refresh"
# (control beat) delete code bundles no job references, unused for TRAINYARD_BUNDLE_GC_AGE_S
BUNDLES_GC_TASK = "jobs.tasks.bundles_gc"
TELEMETRY_PURGE_TASK = "jobs.tasks.telemetry_purge"
SLURM_POLL_TASK = "jobs.tasks.slurm_poll"
"""Control beat: the Slurm pools' batched status (squeue), pending reasons, ends, releases (issue 27)."""
SLURM_RECONCILE_TASK = "jobs.tasks.slurm_reconcile"
"""Control beat: cancel tagged Slurm jobs no live attempt owns (every minute)."""
"""Control queue: queued jobs' predicted start times (beat every 5 s)."""
HEARTBEAT_TASK = "jobs.tasks.node_heartbeat"
"""Control queue: a node agent's heartbeat (args: [Signed(body=Heartbeat)])."""
RANKS_TASK = "jobs.tasks.attempt_ranks"
"""Control queue: every rank of an attempt on one node has started (args: [Signed(body=RanksReport)])."""
NODE_EXIT_TASK = "jobs.tasks.attempt_node_exit"
"""Control queue: an attempt's processes on one node have ended (args: [Signed(body=ExitReport)])."""
NODE_CALIBRATE_TASK = "workers.tasks.node_calibrate"
"""Node queue: measure this node for the planner (args: [CalibrateRequest]); reports CALIBRATION_REPORT_TASK."""
CALIBRATION_REPORT_TASK = "jobs.tasks.calibration_report"
"""Control queue: a node's calibration measurements, or why there are none (args: [Signed(body=CalibrationReport)])."""

# ---------------------------------------------------------------- Celery settings

CELERY_SETTINGS: dict[str, Any] = {
    "task_serializer": "json",
    "accept_content": ["json"],
    "result_backend": None,
    "task_ignore_result": True,
    "task_default_queue": CONTROL_QUEUE,
    # Control tasks are idempotent (they re-check state), so acking after the task body runs
    # means a control worker killed mid-task re-runs it instead of losing an attempt's exit.
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "worker_prefetch_multiplier": 1,
    "broker_connection_retry_on_startup": True,
    # kombu's Redis transport with the repairs a broker outage needs (trainyard.celery_redis):
    # without them the control worker can die when Redis restarts, and the messages it held
    # unacknowledged wait out the visibility timeout.
    "broker_transport": "trainyard.celery_redis:Transport",
    "broker_transport_options": {"visibility_timeout": 3600},
    "worker_hijack_root_logger": False,
    # No result backend, so nothing to expire; with an expiry beat would also schedule Celery's
    # `celery.backend_cleanup` every night, a builtin the apps no longer register (below).
    "result_expires": None,
}
"""The Celery configuration both Celery apps use (the control plane's jobs.core.celery_app and the
node agents' workers.celery_app): the same serializer and delivery guarantees on both ends."""


def drop_celery_builtins(sender, **_) -> None:
    """An app's `on_after_finalize` receiver: unregister Celery's builtin tasks (`celery.map`,
    `celery.starmap`, `celery.chunks`, `celery.group`, `celery.chain`, `celery.chord`,
    `celery.chord_unlock`, `celery.accumulate`, `celery.backend_cleanup`). Neither side uses them,
    and every node may write the control queue: `celery.map` would run any registered task with
    arguments of the sender's choosing. A worker refuses (logs and discards) a task it does not have."""
    for name in [n for n in sender.tasks if n.startswith("celery.")]:
        sender.tasks.unregister(name)


class _Message(BaseModel):
    # Unknown keys are errors: both ends are built from this one module, so an unknown key is
    # a typo or a version skew worth failing loudly on.
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- control plane -> node agent

class Resume(_Message):
    """The checkpoint a new attempt resumes from (the latest live one, or a rollback target)."""

    path: str
    step: int
    checkpoint_id: int


class Launch(_Message):
    """Start one node's share of an attempt: built by the scheduler's attempt start, one per node."""

    job_id: int
    attempt_id: int
    node: str = Field(description="the node this share runs on, e.g. node-a")
    node_rank: int = Field(description="0 hosts the torchrun rendezvous store")
    nnodes: int
    nproc: int = Field(description="processes on this node, one per slot")
    slots: list[int] = Field(description="slot indices on this node (len == nproc)")
    device: str = Field(description="cpu | cuda (the JobSpec's resources.device)")
    rdzv_host: str = Field(description="advertised address of the node_rank-0 node")
    local_addr: str = Field(description="this node's advertised address")
    stream: str = Field(description="the attempt's telemetry stream (keys.attempt_stream)")
    # The attempt's own secrets (trainyard.attemptauth): its Redis user's password (only XADD to
    # `stream` and GET of its preemption key), the key its ranks sign checkpoint manifests with,
    # and the token in its rendezvous-port key. The agent hands the first two to the ranks (in
    # config.json, readable by the attempt's uid alone) and nothing of its own.
    redis_user: str = Field(max_length=100, description="trainyard.redis_acl.attempt_user(attempt_id)")
    redis_password: str = Field(max_length=200)
    proof_key: str = Field(pattern=r"^[0-9a-f]{64}$")
    rdzv_token: str = Field(pattern=r"^[0-9a-f]{32}$")
    spec: dict[str, Any] = Field(description="the job's validated JobSpec as stored")
    planner: dict[str, Any] | None = Field(
        None, description="a user-code job with parallel auto: the device facts and calibrated constants "
                          "run.prepare plans its model with (jobs/planning/autoplan.py user_model_inputs)")
    resume: Resume | None = None
    collective_timeout_s: float | None = Field(
        None, gt=0, description="timeout of every process group the ranks create: under the hang "
                                "detector's, so a stuck collective fails the rank with a real error "
                                "first; None: torch's defaults")
    memory_limit_gb: float | None = Field(
        None, gt=0, description="a cpu job's device memory, enforced on each rank of the built-in trainer "
                                "(TRAINYARD_CPU_DEVICE_MEMORY_ENFORCE): past it, allocations fail as a "
                                "GPU's would; None: no limit")


class Stop(_Message):
    """Stop an attempt's processes on one node (cancel, failure of a peer, preemption, orphan)."""

    job_id: int = Field(description="0 when the sender does not know it (an orphan)")
    attempt_id: int
    reason: str



class PreemptRequest(_Message):
    """The value of keys.preempt_key(attempt): the ranks checkpoint and exit within grace_s; or,
    `fenced`, exit at once without a checkpoint (the control plane wrote the attempt off with a
    lost node and has restarted the job elsewhere: anything this attempt still writes is stale)."""

    reason: str
    grace_s: float
    fenced: bool = False


# ---------------------------------------------------------------- node agent -> control plane

class Heartbeat(_Message):
    """A node agent's state every 2 s: identity, capacity, load and the attempts it runs."""

    name: str
    address: str
    slots: int
    labels: dict[str, str] = Field(default_factory=dict)
    devices: list[dict[str, Any]] = Field(default_factory=list, description="agent.discover_devices")
    cpu_percent: float | None = None
    mem_percent: float | None = None
    agent_id: str = Field("", description="changes when the agent restarts")
    attempts: list[int] = Field(default_factory=list, description="attempt ids with processes here")
    allocation: str = Field("", max_length=32, description="an ephemeral agent's Slurm job id (a pool's seat "
                                                            "counts its heartbeat only from that job)")
    draining: str = Field("", max_length=200, description="an ephemeral agent's node is being taken back by "
                                                          "Slurm (preemption, scancel): stop its attempt cooperatively")


class Signed(_Message):
    """The envelope of every node -> control plane report (trainyard.nodeauth.seal builds it)."""

    node: str = Field(min_length=1, max_length=64, description="the sending node, as registered")
    task: str = Field(max_length=200, description="the task name, signed with the body")
    ts: float = Field(description="the sender's clock, Unix seconds")
    body: dict[str, Any]
    sig: str = Field(max_length=128, description="hex HMAC-SHA256; empty from an unregistered node")


class RanksReport(_Message):
    """RANKS_TASK's body: every rank of an attempt on the signing node has started."""

    attempt_id: int
    ranks: list[dict[str, Any]] = Field(description="RankInfo JSON, validated by the receiver")


class ExitReport(_Message):
    """NODE_EXIT_TASK's body: the signing node's NodeExit JSON for an attempt, as sent."""

    attempt_id: int
    result: dict[str, Any]


class RankInfo(_Message):
    """One started rank, as the runtime wrote it to ranks/<local_rank>.json."""

    rank: int
    local_rank: int
    pid: int
    node: str | None = None


class RankFailure(_Message):
    """One failed rank of a node's exit report: from its error file or torchrun's summary."""

    rank: int | None = None
    local_rank: int | None = None
    exitcode: int | None = None
    signal: str | None = None
    timestamp: float | None = None
    message: str | None = None
    traceback: str | None = None


class NodeExit(_Message):
    """How an attempt ended on one node (exactly once per node and attempt).

    exit_code is torchrun's (-signum when it was killed; None when lost or never started).
    Sent with exclude_unset: a report carries only the keys its sender knew.
    """

    attempt_id: int | None = None
    job_id: int | None = None
    node: str | None = None
    exit_code: int | None = None
    signal: str | None = None
    stopped: bool = False
    lost: bool = False
    failures: list[RankFailure] = Field(default_factory=list, description="earliest first")
    log_tail: dict[str, list[str]] = Field(default_factory=dict, description="global rank -> last lines")
    duration_s: float = 0.0
    torchrun_tail: list[str] | None = Field(None, description="torchrun's last stderr lines, on failure")
    error: str | None = None
    reason: str | None = Field(None, description="why a stop found nothing running here")

    def wire(self) -> dict[str, Any]:
        """The JSON sent and stored: only the keys the sender set."""
        return self.model_dump(mode="json", exclude_unset=True)


class CalibrateRequest(_Message):
    """NODE_CALIBRATE_TASK: run `python -m workers.calibrate` on the node (trainyard.calibration)."""

    quick: bool = False
    requested_by: int | None = Field(None, description="the staff user's id, echoed in the report")


class CalibrationReport(_Message):
    """CALIBRATION_REPORT_TASK: the measurement document (trainyard.calibration, validated by the
    control plane) or, when the harness failed, `error`."""

    node: str = Field(min_length=1, max_length=64)
    requested_by: int | None = None
    measurements: dict | None = None
    error: str | None = Field(None, max_length=4000)
    wall_s: float | None = None
