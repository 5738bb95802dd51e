"""The control plane's Celery app: serves the `control` queue (node agents' signed reports) and the
`control.beat` queue (periodic tasks, which only the control plane's Redis user can write), and sends
to the node agents' queues by task name (jobs.core.dispatch), so jobs/ never imports workers/. Broker:
Django's settings.REDIS_URL; configuration: trainyard.launch.CELERY_SETTINGS, the same as the
agents'. controlplane.celery adds the beat schedule."""
from __future__ import annotations

from celery import Celery
from django.conf import settings
from kombu import Queue

from trainyard.keys import CONTROL_BEAT_QUEUE, CONTROL_QUEUE, NOTIFY_QUEUE
from trainyard.launch import (ATTEMPTS_CHECK_TASK, BUNDLES_GC_TASK, CELERY_SETTINGS, ETA_REFRESH_TASK,
                              NODES_CHECK_TASK, SCHEDULE_TICK_TASK, SLURM_POLL_TASK, SLURM_RECONCILE_TASK,
                              TELEMETRY_PURGE_TASK, drop_celery_builtins)

BEAT_TASKS = (SCHEDULE_TICK_TASK, NODES_CHECK_TASK, ATTEMPTS_CHECK_TASK, ETA_REFRESH_TASK, BUNDLES_GC_TASK,
              TELEMETRY_PURGE_TASK, SLURM_POLL_TASK, SLURM_RECONCILE_TASK)
"""Run only from CONTROL_BEAT_QUEUE (jobs.tasks.BeatTask): every node may push onto `control`."""
SLURM_SUBMIT_TASK = "jobs.tasks.slurm_submit"
CONTROL_ONLY_TASKS = (SLURM_SUBMIT_TASK,)
"""Not periodic, but sent only by the control plane, so also only from CONTROL_BEAT_QUEUE: sbatch of one
SlurmJob row (jobs.core.dispatch.send_slurm_submit, after the tick's commit)."""
NOTIFY_FANOUT_TASK = "jobs.tasks.notify_fanout"
NOTIFY_DELIVER_TASK = "jobs.tasks.notify_deliver"
NOTIFY_TASKS = (NOTIFY_FANOUT_TASK, NOTIFY_DELIVER_TASK)
"""Run only from NOTIFY_QUEUE (jobs.tasks.NotifyTask), by the notifications' own worker."""

app = Celery("trainyard-control", broker=settings.REDIS_URL, include=["jobs.tasks"])
app.conf.update(CELERY_SETTINGS)
app.conf.task_queues = (Queue(CONTROL_QUEUE), Queue(CONTROL_BEAT_QUEUE), Queue(NOTIFY_QUEUE))
# Beat's sends and the control plane's own (jobs.core.dispatch.request_tick) go by the task's name.
app.conf.task_routes = {**{name: {"queue": CONTROL_BEAT_QUEUE} for name in BEAT_TASKS + CONTROL_ONLY_TASKS},
                        **{name: {"queue": NOTIFY_QUEUE} for name in NOTIFY_TASKS}}
# Only jobs.tasks' own names run: Celery's builtins (celery.map runs any task with any arguments) go.
app.on_after_finalize.connect(drop_celery_builtins, weak=False)
