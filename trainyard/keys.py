"""Every name the control plane and the data plane must agree on outside a message body: Redis
keys, streams and queues, and the on-disk checkpoint layout (standard library only).

Both sides compute these here, so a name cannot drift between a writer and its reader: before
this module the checkpoint directory was derived twice (a cwd-relative `var/checkpoints` on the
agent, an absolute path in the control plane, which drops checkpoints outside its own), and
seven Redis names lived in five files.

Redis (one database, shared by Celery, the streams and the Channels layer):
    control                      Celery queue of the control worker: node agents' signed reports
    control.beat                 Celery queue of the control worker: beat's periodic tasks (control plane only)
    node.<name>                  Celery queue of one node agent (launch, stop)
    trainyard:unacked:<name>     kombu's unacked bookkeeping of one node agent (and _index:, _mutex:)
    trainyard:job:<id>:a<attempt>  one attempt's telemetry stream: only that attempt's own Redis user
                                 (its ranks, and its agents forwarding its logs) may XADD; the relay reads
    relay                        the relay's consumer group on every job stream
    trainyard:joblog:<id>        list: a job's last log lines, kept by the relay
    trainyard:relay:stats        hash: the relay's counters (read by /metrics)
    trainyard:scheduler:stats    hash: the schedule tick's durations as a histogram (read by /metrics)
    trainyard:relay:alive        the relay's liveness key (10 s expiry, refreshed each round)
    trainyard:alive:<role>       liveness stamps of `control` (worker) and `beat` (TTL expiry, jobs/fleet/liveness.py)
    trainyard:relay:deadletter   stream: entries the relay refused (unparseable, forged, poison), capped
    trainyard:preempt:<attempt>  set by the control plane: checkpoint and exit (trainyard/sdk/preempt.py)
    trainyard:rdzv:<attempt>:<token>  the rank-0 node's torchrun rendezvous port, for its peer nodes;
                                 the token is in the sealed Launch, so no other node can name the key

Disk (each root from one environment variable, resolved to an absolute path here):
    <checkpoint root>/job-<id>/step-<S:08d>-a<attempt>/trainyard.json   a complete checkpoint and its
                                          manifest (TRAINYARD_CHECKPOINT_ROOT, shared by nodes and control plane)
    <run root>/<node>/attempt-<id>/       an agent's run directory (TRAINYARD_RUN_DIR, node-local)
    <artifact root>/bundles/<hex[:2]>/<hex>.tar.gz               a code bundle (TRAINYARD_ARTIFACT_ROOT, shared)
    <kept log root>/logs/job-<id>/attempt-<a>/rank-<r>.log       every rank's output, kept after the job
                                          (TRAINYARD_KEPT_LOG_ROOT: the control plane's own, 0700, never
                                          under a root the nodes share, so no job can plant anything there)
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# ---------------------------------------------------------------- Celery queues

CONTROL_QUEUE = "control"
"""The control worker's queue of every report from the node agents (every node's Redis user may
LPUSH onto it; the periodic tasks have CONTROL_BEAT_QUEUE)."""


CONTROL_BEAT_QUEUE = "control.beat"
"""The control worker's second queue: beat's periodic tasks (and the control plane's own schedule
ticks). Only the control plane's Redis user can write it (trainyard/redis_acl.py); a periodic task
that arrives on CONTROL_QUEUE, which every node may write, is refused (jobs/tasks.py)."""


NOTIFY_QUEUE = "control.notify"
"""Notifications (issue 25): fan-out and webhook/email deliveries, served by their own worker
(`celery ... worker -Q control.notify`), so a slow receiver never holds up the schedule tick. Only
the control plane's Redis user can write it; a notify task delivered from elsewhere is refused."""


def node_queue(node: str) -> str:
    """The queue one node agent consumes (launch and stop of its share of attempts)."""
    return f"node.{node}"


def node_unacked_keys(node: str) -> dict[str, str]:
    """kombu's Redis transport options naming one node agent's own unacknowledged-message keys
    (the hash of deliveries, their time index, the restore mutex). kombu's defaults (`unacked`,
    `unacked_index`, `unacked_mutex`) are shared by every consumer, so any node could read the
    Launch messages held by another; these are each node's alone, and the control worker keeps the
    defaults. `:` is not allowed in node names, so no node's queue can be another's key."""
    return {"unacked_key": f"trainyard:unacked:{node}", "unacked_index_key": f"trainyard:unacked_index:{node}",
            "unacked_mutex_key": f"trainyard:unacked_mutex:{node}"}


# ---------------------------------------------------------------- Redis keys and streams

JOB_STREAM_PREFIX = "trainyard:job:"
"""Prefix of the telemetry streams; `JOB_STREAM_PREFIX + "*"` finds them all (SCAN)."""

RELAY_GROUP = "relay"
"""The consumer group the relay reads every job stream with (entries XACKed after commit)."""

RELAY_STATS_KEY = "trainyard:relay:stats"
"""Hash of the relay's counters and last batch, read by /metrics."""

SCHEDULER_STATS_KEY = "trainyard:scheduler:stats"
"""Hash of the schedule tick's timings (jobs.core.dispatch.scheduler_tick_record writes it after every
tick, /metrics reads it): `le:<seconds>` cumulative bucket counts, `count`, `sum_seconds`,
`errors_total`, `last_seconds`, `last_unixtime`."""

RELAY_ALIVE_KEY = "trainyard:relay:alive"
"""Set by the relay every round with a 10 s expiry; its absence means no relay runs."""

RELAY_STARTED_KEY = "trainyard:relay:started"
"""The epoch second the running relay process started, refreshed with RELAY_ALIVE_KEY (10 s
expiry): progress trained while no relay ran is committed only after that, so the hang detector
counts no idle time from before it."""

ALIVE_PREFIX = "trainyard:alive:"
"""Liveness stamps: `ALIVE_PREFIX + role` (control, beat) holds the writer's Unix time and expires
after settings.TRAINYARD_ALIVE_TTL_S; a missing key means the role is down (jobs/fleet/liveness.py)."""


def alive_key(role: str) -> str:
    """The liveness stamp of one control-plane role ("control", "beat")."""
    return f"{ALIVE_PREFIX}{role}"


DEADLETTER_STREAM = "trainyard:relay:deadletter"
"""Entries the relay refused, with the reason (capped with MAXLEN; read by staff pages). Outside
JOB_STREAM_PREFIX, so the relay never reads its own dead letters as a job stream."""


def attempt_stream(job_id: int, attempt_id: int) -> str:
    """The Redis Stream one attempt's ranks (metrics, events) and agents (its logs) write to. One
    stream per attempt, writable only by that attempt's Redis user (trainyard.redis_acl): the
    stream an entry arrived on is the proof of the attempt that wrote it."""
    return f"{JOB_STREAM_PREFIX}{int(job_id)}:a{int(attempt_id)}"


def stream_ids(stream: str) -> tuple[int, int]:
    """(job id, attempt id) of an attempt stream's name (the inverse of `attempt_stream`)."""
    job, attempt = stream[len(JOB_STREAM_PREFIX):].split(":a")
    return int(job), int(attempt)


def job_log_key(job_id: int) -> str:
    """List of a job's most recent log lines (JSON), appended by the relay, read by the logs API."""
    return f"trainyard:joblog:{int(job_id)}"


def preempt_key(attempt_id: int) -> str:
    """Set by the control plane to ask an attempt's ranks to checkpoint and exit; polled by them."""
    return f"trainyard:preempt:{int(attempt_id)}"


RDZV_PREFIX = "trainyard:rdzv:"


def rdzv_port_key(attempt_id: int, token: str) -> str:
    """The torchrun rendezvous port the attempt's node_rank-0 agent picked, read by its peers.
    `token` comes in the sealed Launch (trainyard.launch.Launch.rdzv_token): a node that is not
    in the attempt cannot name the key, so it cannot plant a port there."""
    return f"{RDZV_PREFIX}{int(attempt_id)}:{token}"


# ---------------------------------------------------------------- directories

REPO_VAR_DIR = Path(__file__).resolve().parent.parent / "var"
"""Default state directory when TRAINYARD_VAR_DIR is unset: `var/` next to this package."""

MANIFEST = "trainyard.json"
"""A checkpoint's manifest, written last by rank 0: a step directory without it is incomplete."""

STEP_DIR_GLOB = "step-*"
"""Matches every checkpoint directory of a job (complete or still being renamed into place)."""


def var_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The state directory (database, Redis data, agents' run dirs): TRAINYARD_VAR_DIR, absolute."""
    env = os.environ if environ is None else environ
    return Path(env.get("TRAINYARD_VAR_DIR") or REPO_VAR_DIR).resolve()


def supervisor_status_path(environ: Mapping[str, str] | None = None) -> Path:
    """The JSON state file `make run`'s supervisor (scripts/supervise.py) keeps: <var>/supervisor.json."""
    return var_dir(environ) / "supervisor.json"


def data_root(environ: Mapping[str, str] | None = None) -> Path:
    """Where `data.kind: tokens` files live: TRAINYARD_DATA_ROOT, else <var>/data; absolute."""
    env = os.environ if environ is None else environ
    return Path(env.get("TRAINYARD_DATA_ROOT") or var_dir(env) / "data").resolve()


def checkpoint_root(environ: Mapping[str, str] | None = None) -> Path:
    """The one checkpoint root: TRAINYARD_CHECKPOINT_ROOT, else <var>/checkpoints; absolute.

    The control plane (settings.TRAINYARD_CHECKPOINT_ROOT) and every node agent resolve it
    here from the same environment, so both name a job's directory the same way.
    """
    env = os.environ if environ is None else environ
    return Path(env.get("TRAINYARD_CHECKPOINT_ROOT") or var_dir(env) / "checkpoints").resolve()


def run_root(environ: Mapping[str, str] | None = None) -> Path:
    """Where node agents keep their attempts' run directories (<run_root>/<node>/attempt-<id>/:
    config.json, ranks/, logs, error files): TRAINYARD_RUN_DIR, else <var>/agents; absolute."""
    env = os.environ if environ is None else environ
    return Path(env.get("TRAINYARD_RUN_DIR") or var_dir(env) / "agents").resolve()


def artifact_root(environ: Mapping[str, str] | None = None) -> Path:
    """Code bundles: TRAINYARD_ARTIFACT_ROOT, else <var>/artifacts; absolute. Like the checkpoint
    root, one path every node and the control plane see (a shared filesystem)."""
    env = os.environ if environ is None else environ
    return Path(env.get("TRAINYARD_ARTIFACT_ROOT") or var_dir(env) / "artifacts").resolve()


def kept_log_root(environ: Mapping[str, str] | None = None) -> Path:
    """Every rank's kept output (the relay writes, the logs API reads): TRAINYARD_KEPT_LOG_ROOT, else
    <var>/keptlogs; absolute. The control plane's own directory (0700): ValueError when it lies in
    or contains a root the nodes write (artifact, checkpoint, data, run), where a job could plant
    a symlink in place of its own log."""
    env = os.environ if environ is None else environ
    root = Path(env.get("TRAINYARD_KEPT_LOG_ROOT") or var_dir(env) / "keptlogs").resolve()
    for name, shared in (("TRAINYARD_ARTIFACT_ROOT", artifact_root(env)), ("TRAINYARD_CHECKPOINT_ROOT",
                         checkpoint_root(env)), ("TRAINYARD_DATA_ROOT", data_root(env)),
                         ("TRAINYARD_RUN_DIR", run_root(env))):
        if root == shared or shared in root.parents or root in shared.parents:
            raise ValueError(f"TRAINYARD_KEPT_LOG_ROOT ({root}) must be apart from {name} ({shared}): jobs "
                             "write there, and kept logs must lie where no job can write")
    return root


BUNDLE_PREFIX = "sha256:"
"""A code bundle's id is its content hash: "sha256:<64 hex digits>"."""


def bundle_path(root: Path, digest: str) -> Path:
    """Where a code bundle (.tar.gz) is stored: <artifact root>/bundles/<hex[:2]>/<hex>.tar.gz.
    `digest` is the bundle id ("sha256:<hex>") or the bare hex."""
    hexdigest = digest.removeprefix(BUNDLE_PREFIX)
    return Path(root) / "bundles" / hexdigest[:2] / f"{hexdigest}.tar.gz"


def job_log_relpath(job_id: int) -> str:
    """A job's kept-log directory relative to the kept log root: logs/job-<id>."""
    return f"logs/job-{int(job_id)}"


def rank_log_relpath(job_id: int, attempt_id: int, rank: int) -> str:
    """One rank's kept file relative to the kept log root (what trainyard.safefs opens)."""
    return f"{job_log_relpath(job_id)}/attempt-{int(attempt_id)}/rank-{int(rank)}.log"


def job_log_dir(root: Path, job_id: int) -> Path:
    """A job's kept logs under the kept log root: attempt-<id>/rank-<r>.log below it."""
    return Path(root) / job_log_relpath(job_id)


def rank_log_path(root: Path, job_id: int, attempt_id: int, rank: int) -> Path:
    """One rank's full output for one attempt, kept after the job (rotated by size per job)."""
    return Path(root) / rank_log_relpath(job_id, attempt_id, rank)


def job_checkpoint_dir(root: Path, job_id: int) -> Path:
    """A job's checkpoint directory under the checkpoint root: every attempt saves there."""
    return Path(root) / f"job-{int(job_id)}"


def step_dir_name(step: int, attempt_id: int) -> str:
    """A complete checkpoint's directory name: sorts by step, and two attempts never collide."""
    return f"step-{int(step):08d}-a{int(attempt_id)}"
