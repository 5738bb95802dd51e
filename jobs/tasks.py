"""Control-queue Celery tasks (run by the control worker, `celery -A controlplane worker -Q
control`): thin, each calls one jobs.services function. Node agents send the reports by task
name (trainyard.launch); services validate them with the trainyard.launch models."""
from __future__ import annotations

import logging

from celery import Task
from django.conf import settings
from pydantic import ValidationError

from trainyard.keys import CONTROL_BEAT_QUEUE, NOTIFY_QUEUE
from trainyard.launch import (ATTEMPTS_CHECK_TASK, BUNDLES_GC_TASK, CALIBRATION_REPORT_TASK, ETA_REFRESH_TASK,
                              HEARTBEAT_TASK, NODE_EXIT_TASK, NODES_CHECK_TASK, RANKS_TASK, SCHEDULE_TICK_TASK,
                              SLURM_POLL_TASK, SLURM_RECONCILE_TASK, TELEMETRY_PURGE_TASK,
                              CalibrationReport, ExitReport, Heartbeat, RanksReport)

from jobs.core import dispatch
from jobs import services
from jobs.core.celery_app import NOTIFY_DELIVER_TASK, NOTIFY_FANOUT_TASK, SLURM_SUBMIT_TASK, app

log = logging.getLogger("trainyard.security")


class BeatTask(Task):
    """A periodic task (jobs.core.celery_app.BEAT_TASKS): from the broker it runs only when delivered
    from CONTROL_BEAT_QUEUE, which only the control plane's Redis user can write. One that arrives
    on `control` was pushed by a node (its Redis user may LPUSH there): refused without running,
    logged and counted as a security event. The queue is the one the message was popped from
    (trainyard.celery_redis stamps it), not what its sender wrote. Called in-process, it runs."""

    only_queue = CONTROL_BEAT_QUEUE
    refused_kind = "periodic_on_control"
    what = "periodic task"

    def __call__(self, *args, **kwargs):
        request = self.request
        queue = (request.delivery_info or {}).get("routing_key")
        if not request.called_directly and not request.is_eager and queue != self.only_queue:
            log.warning("refused %s %s delivered from queue %r (only %s runs it)", self.what, self.name,
                        queue, self.only_queue)
            services.security_event(self.refused_kind, f"queue:{queue}",
                                    f"{self.name} arrived on {queue!r}, not {self.only_queue}")
            return None
        return super().__call__(*args, **kwargs)


class NotifyTask(BeatTask):
    """A notification task: runs only when delivered from NOTIFY_QUEUE (the control plane's own), so
    a node cannot make the control plane POST or mail anything by pushing onto `control`."""

    only_queue = NOTIFY_QUEUE
    refused_kind = "notify_off_queue"
    what = "notification task"


# shared=False: registered with this side's app only (Celery shares tasks with every app in a
# process by default), so each side serves exactly its own queue's tasks even when both load.
#
# The periodic tasks and heartbeats are acked early (PERIODIC): the next beat or heartbeat, 2 s
# later, redoes what a lost one would have done, and a late ack is what kombu's Redis transport
# fails on when the broker restarts while such a task runs (the ack after the reconnect finds the
# old channel without a connection: "Unrecoverable error: 'NoneType' object has no attribute
# 'hostname'", and the control worker exits; tests/integration/test_chaos.py restarts Redis with a
# heartbeat in flight; seen in one of three full runs). Attempt reports keep the late ack: each
# is sent once.
PERIODIC = {"shared": False, "acks_late": False}
BEAT = {**PERIODIC, "base": BeatTask}


@app.task(name=SCHEDULE_TICK_TASK, **BEAT, time_limit=60, soft_time_limit=50)
def schedule_tick() -> list[int]:
    return services.schedule_tick()


@app.task(name=NODES_CHECK_TASK, **BEAT, time_limit=60, soft_time_limit=50)
def nodes_check() -> list[str]:
    lost = services.nodes_check()
    services.launches_resend_due()  # launches a killed control worker never sent
    services.attempt_access_reconcile()  # the attempts' Redis users, in line with the database
    return lost


@app.task(name=ETA_REFRESH_TASK, **BEAT, time_limit=60, soft_time_limit=50)
def eta_refresh() -> int:
    return services.eta_refresh()


@app.task(name=ATTEMPTS_CHECK_TASK, **BEAT, time_limit=60, soft_time_limit=50)
def attempts_check() -> dict:
    out = services.attempts_check()
    out["tuned"] = services.attempts_tune()  # adapt auto acts on the profiles just updated
    # experiments (issue 25) read the metrics just committed: ASHA stops, ended trials, new trials
    out["experiments"] = services.experiments_advance()
    return out


@app.task(name=BUNDLES_GC_TASK, **BEAT, time_limit=600, soft_time_limit=540)
def bundles_gc() -> list[str]:
    return services.bundles_gc().deleted


# Telemetry retention (jobs/telemetry/retention.py): each run stops at TRAINYARD_TELEMETRY_PURGE_BUDGET_S
# (under the soft limit); the next beat goes on from there.
@app.task(name=TELEMETRY_PURGE_TASK, **BEAT, time_limit=300, soft_time_limit=240)
def telemetry_purge() -> dict:
    return services.telemetry_purge().as_dict()


# Slurm pools (issue 27, jobs/fleet/services/slurm.py): sbatch off the tick, the batched status and
# the orphans' reconcile. A Slurm command waits at most its runner's timeout (30 s), under these limits.
@app.task(name=SLURM_SUBMIT_TASK, **BEAT, time_limit=120, soft_time_limit=100)
def slurm_submit(slurm_job_id: int) -> str | None:
    return services.slurm_gang_submit(slurm_job_id)


@app.task(name=SLURM_POLL_TASK, **BEAT, time_limit=120, soft_time_limit=100, expires=10)
def slurm_poll() -> int:
    return services.slurm_poll()


@app.task(name=SLURM_RECONCILE_TASK, **BEAT, time_limit=120, soft_time_limit=100)
def slurm_reconcile() -> int:
    return services.slurm_reconcile()


# Every report is a trainyard.launch.Signed envelope: services.report_open checks the signature
# against the registered node's credential (refused and counted as a security event otherwise)
# before one service applies the body as that node's.
@app.task(name=HEARTBEAT_TASK, **PERIODIC, time_limit=30, expires=10)
def node_heartbeat(envelope: dict) -> None:
    opened = services.report_open(envelope, task=HEARTBEAT_TASK)
    if opened is None:
        return
    try:
        beat = Heartbeat.model_validate(opened[1])
    except ValidationError as exc:
        services.security_event("malformed", opened[0].name, f"heartbeat: {exc.error_count()} errors")
        return
    node, orphans = services.node_heartbeat(beat, signer=opened[0].name)
    if node is not None and node.holder_id:
        if beat.draining:  # Slurm takes the node back: checkpoint and requeue (trainyard/slurm's preemption)
            services.slurm_seat_draining(node.name, beat.draining)
        else:
            services.slurm_seat_up(node.holder_id)  # a pool's seat: the last agent of its gang in launches it
    for attempt_id in orphans:
        # The agent runs an attempt the control plane has already ended: stop it there.
        dispatch.send_stop(node.name, 0, attempt_id, "orphan")


@app.task(name=RANKS_TASK, shared=False, time_limit=30)
def attempt_ranks(envelope: dict) -> None:
    opened = services.report_open(envelope, task=RANKS_TASK)
    if opened is not None:
        report = RanksReport.model_validate(opened[1])
        services.attempt_ranks(report.attempt_id, node_name=opened[0].name, ranks=report.ranks)


@app.task(name=NODE_EXIT_TASK, shared=False, time_limit=30)
def attempt_node_exit(envelope: dict) -> None:
    opened = services.report_open(envelope, task=NODE_EXIT_TASK)
    if opened is not None:
        report = ExitReport.model_validate(opened[1])
        services.attempt_node_exit(report.attempt_id, node_name=opened[0].name, result=report.result)


@app.task(name=CALIBRATION_REPORT_TASK, shared=False, time_limit=120)
def calibration_report(envelope: dict) -> int | None:
    """A node's calibration measurements: fit, evaluate, store (the new row's id, None if failed)."""
    opened = services.report_open(envelope, task=CALIBRATION_REPORT_TASK)
    if opened is None:
        return None
    if opened[1].get("node") != opened[0].name:
        services.security_event("name_mismatch", opened[0].name, "calibration report names another node")
        return None
    try:
        report = CalibrationReport.model_validate(opened[1])
    except ValidationError as exc:
        logging.getLogger("jobs.planning.services.calibration").warning("invalid calibration report: %s", exc)
        return None
    row = services.calibration_report(report)
    return row.pk if row is not None else None


# Notifications (jobs/notify/): their own queue and worker, so a hung receiver never holds a slot the
# schedule tick needs. A try is bounded by TRAINYARD_WEBHOOK_TIMEOUT_S per connect/read and 3x that in
# all (jobs/notify/transport.py); the time limit is the backstop. Acked late: a fan-out or try lost
# with a killed worker runs again (a receiver may see a delivery twice: X-Trainyard-Delivery dedups).
# A try takes at most about 3x the timeout plus one read (and the mail server's EMAIL_TIMEOUT per step).
_TRY_LIMIT_S = max(60, int(4 * max(settings.TRAINYARD_WEBHOOK_TIMEOUT_S, settings.EMAIL_TIMEOUT)) + 15)


@app.task(name=NOTIFY_FANOUT_TASK, base=NotifyTask, shared=False, time_limit=60, soft_time_limit=50)
def notify_fanout(message: dict) -> int:
    return len(services.notify_fanout(message))


@app.task(name=NOTIFY_DELIVER_TASK, base=NotifyTask, shared=False, time_limit=_TRY_LIMIT_S,
          soft_time_limit=_TRY_LIMIT_S - 10)
def notify_deliver(delivery_id: int) -> str:
    return services.delivery_try(delivery_id)
