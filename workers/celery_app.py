"""The node agents' Celery app. It needs only the Redis URL, so an agent on another machine runs
it without Django or a database; it serves node.<name> queues (workers.tasks) and sends its
reports to the control queue by task name (trainyard.launch). The control plane has its own
app (jobs.celery_app) with the same settings (trainyard.launch.CELERY_SETTINGS)."""
from __future__ import annotations

import os

from celery import Celery

from trainyard.launch import CELERY_SETTINGS

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("trainyard-node", broker=REDIS_URL, include=["workers.tasks"])
app.conf.update(CELERY_SETTINGS)
# No remote control (the pidbox): nothing sends agents broadcast commands, and a node's Redis user
# (trainyard/redis_acl.py) has no pub/sub channels, so no node can broadcast `shutdown` to the
# others or to the control worker through Celery's remote control.
app.conf.worker_enable_remote_control = False
