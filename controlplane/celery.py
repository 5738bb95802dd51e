"""Celery for the control plane: the shared app plus Django and the beat schedule."""
from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

from workers.celery_app import app  # noqa: E402

# Ticks also run on submit and on attempt end; the beat catches everything else (nodes freed by
# a heartbeat, lost nodes) within 2 s.
app.conf.beat_schedule = {
    "schedule-tick": {"task": "workers.tasks.schedule_tick", "schedule": 2.0, "options": {"expires": 4}},
    "nodes-check": {"task": "workers.tasks.nodes_check", "schedule": 2.0, "options": {"expires": 4}},
    # Hang and straggler detection over the relay's committed telemetry.
    "attempts-check": {"task": "workers.tasks.attempts_check", "schedule": 2.0, "options": {"expires": 4}},
    # Queued jobs' predicted start times: the policy run forward (jobs/policy/scheduling/predict.py, predict_starts).
    "eta-refresh": {"task": "workers.tasks.eta_refresh", "schedule": 5.0, "options": {"expires": 10}},
}

__all__ = ["app"]
