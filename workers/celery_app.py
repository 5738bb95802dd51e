"""The one Celery app. It needs only the Redis URL, so node agents on other machines run it
without Django or a database; the control worker imports controlplane.celery, which adds Django."""
from __future__ import annotations

import os

from celery import Celery

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CONTROL_QUEUE = "control"

app = Celery("trainyard", broker=REDIS_URL, include=["workers.tasks"])
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    result_backend=None,
    task_ignore_result=True,
    task_default_queue=CONTROL_QUEUE,
    # Control tasks are idempotent (they re-check state), so acking after the task body runs
    # means a control worker killed mid-task re-runs it instead of losing an attempt's exit.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 3600},
    worker_hijack_root_logger=False,
)


def node_queue(node: str) -> str:
    return f"node.{node}"
