"""The node agents' Celery app. It needs only the Redis URL, so an agent on another machine runs
it without Django or a database; it serves node.<name> queues (workers.tasks) and sends its
reports to the control queue by task name (trainyard.launch). The control plane has its own
app (jobs.core.celery_app) with the same settings (trainyard.launch.CELERY_SETTINGS).

Everything here fits the node's Redis user (trainyard/redis_acl.py), which may only LPUSH to
`control`, pop its own queue and keep its own unacknowledged-message keys: `configure_node` (the
agent's main calls it with `--name` before the worker starts) names those keys; the queues are never
declared (no binding table is read or written: sends go through the default exchange, straight to
the queue's list); no remote control, gossip, mingle or worker events (no pub/sub channel at all)."""
from __future__ import annotations

import os

from celery import Celery
from kombu import Queue

from trainyard.keys import CONTROL_QUEUE, node_queue, node_unacked_keys
from trainyard.launch import CELERY_SETTINGS, drop_celery_builtins

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("trainyard-node", broker=REDIS_URL, include=["workers.tasks"])
app.conf.update(CELERY_SETTINGS)
# No remote control (the pidbox): nothing sends agents broadcast commands, and a node's Redis user
# has no pub/sub channels, so no node can broadcast `shutdown` to the others or to the control worker.
app.conf.worker_enable_remote_control = False
# Reports are sent, never consumed here: no declaration (it would SADD kombu's binding tables).
app.conf.task_queues = (Queue(CONTROL_QUEUE, no_declare=True),)
app.on_after_finalize.connect(drop_celery_builtins, weak=False)


def node_conf(name: str) -> dict:
    """The Celery settings that make an app node `name`'s agent: consume its queue without declaring
    it, and keep kombu's unacknowledged deliveries in keys of its own (trainyard.keys.node_unacked_keys)."""
    return {"broker_transport_options": {**CELERY_SETTINGS["broker_transport_options"], **node_unacked_keys(name)},
            "task_queues": (Queue(CONTROL_QUEUE, no_declare=True), Queue(node_queue(name), no_declare=True))}


def configure_node(name: str) -> None:
    """This process is node `name`'s agent (workers.agent.main, before anything connects)."""
    app.conf.update(node_conf(name))
