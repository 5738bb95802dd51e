"""Celery for the control plane (`celery -A controlplane worker -Q control,control.beat` and `beat`): Django,
the control plane's app (jobs.core.celery_app, which serves jobs.tasks) and the beat schedule."""
from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

from jobs.core.celery_app import app  # noqa: E402
from jobs.fleet.liveness import ControlStamp  # noqa: E402
from django.conf import settings  # noqa: E402

from trainyard.launch import (ATTEMPTS_CHECK_TASK, BUNDLES_GC_TASK, ETA_REFRESH_TASK,  # noqa: E402
                              NODES_CHECK_TASK, SCHEDULE_TICK_TASK, SLURM_POLL_TASK, SLURM_RECONCILE_TASK,
                              TELEMETRY_PURGE_TASK)

# Ticks also run on submit and on attempt end; the beat catches everything else (nodes freed by
# a heartbeat, lost nodes) within 2 s. Every one goes to control.beat (jobs.core.celery_app's task_routes),
# which no node may write; the control worker runs them only from there (jobs.tasks.BeatTask).
app.conf.beat_schedule = {
    "schedule-tick": {"task": SCHEDULE_TICK_TASK, "schedule": 2.0, "options": {"expires": 4}},
    "nodes-check": {"task": NODES_CHECK_TASK, "schedule": 2.0, "options": {"expires": 4}},
    # Hang and straggler detection over the relay's committed telemetry.
    "attempts-check": {"task": ATTEMPTS_CHECK_TASK, "schedule": 2.0, "options": {"expires": 4}},
    # Queued jobs' predicted start times: the policy run forward (jobs/scheduling/policy/predict.py, predict_starts).
    "eta-refresh": {"task": ETA_REFRESH_TASK, "schedule": 5.0, "options": {"expires": 10}},
    # Code bundles no job references and unused for TRAINYARD_BUNDLE_GC_AGE_S (jobs/bundles/services.py).
    "bundles-gc": {"task": BUNDLES_GC_TASK, "schedule": 3600.0, "options": {"expires": 1800}},
    # Slurm pools (jobs/fleet/services/slurm.py): one batched squeue per pool; orphans every minute
    # (TRAINYARD_SLURM_RECONCILE_S).
    "slurm-poll": {"task": SLURM_POLL_TASK, "schedule": settings.TRAINYARD_SLURM_POLL_S,
                   "options": {"expires": 2 * settings.TRAINYARD_SLURM_POLL_S}},
    "slurm-reconcile": {"task": SLURM_RECONCILE_TASK, "schedule": settings.TRAINYARD_SLURM_RECONCILE_S,
                        "options": {"expires": settings.TRAINYARD_SLURM_RECONCILE_S}},
    # Telemetry retention (jobs/telemetry/retention.py): every TRAINYARD_TELEMETRY_PURGE_S (default 60 s).
    "telemetry-purge": {"task": TELEMETRY_PURGE_TASK, "schedule": settings.TRAINYARD_TELEMETRY_PURGE_S,
                        "options": {"expires": settings.TRAINYARD_TELEMETRY_PURGE_S}},
}

# Liveness (jobs/fleet/liveness.py): the worker stamps trainyard:alive:control from its event loop, beat
# stamps trainyard:alive:beat on every tick; /metrics and the nodes page read them.
app.steps["consumer"].add(ControlStamp)
app.conf.beat_scheduler = "jobs.fleet.liveness:StampingScheduler"

__all__ = ["app"]
