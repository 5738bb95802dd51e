"""Outbound side effects of services: Celery sends to node queues and the control queue.
Services call these only from transaction.on_commit, so a rolled-back decision sends nothing."""
from __future__ import annotations

from workers.celery_app import CONTROL_QUEUE, app, node_queue


def send_launch(node: str, payload: dict) -> None:
    app.send_task("workers.tasks.node_launch", args=[payload], queue=node_queue(node))


def send_stop(node: str, job_id: int, attempt_id: int, reason: str) -> None:
    app.send_task("workers.tasks.node_stop", args=[job_id, attempt_id, reason], queue=node_queue(node))


def request_tick() -> None:
    app.send_task("workers.tasks.schedule_tick", queue=CONTROL_QUEUE, expires=10)
