"""Outbound side effects of services: Celery sends to node queues and the control queue.
Services call these only from transaction.on_commit, so a rolled-back decision sends nothing.

Sends go by task name (trainyard.launch) through the control plane's own Celery app, with the
typed message models' JSON, so the control plane never imports the node agents' code."""
from __future__ import annotations

import logging

from trainyard.keys import CONTROL_BEAT_QUEUE, node_queue, preempt_key
from trainyard.launch import (NODE_CALIBRATE_TASK, NODE_LAUNCH_TASK, NODE_STOP_TASK, SCHEDULE_TICK_TASK,
                              CalibrateRequest, PreemptRequest, Stop)

from .celery_app import app

log = logging.getLogger(__name__)


def sealed(node: str, task: str, body: dict) -> dict:
    """A command for `node`, sealed with its credential (trainyard.nodeauth: HMAC of the master key
    and the node's salt, so the database alone signs nothing): the agent runs only what verifies.
    A node without a credential (never registered) gets an unsigned envelope, which it refuses."""
    import time

    from django.conf import settings

    from trainyard import nodeauth

    from .models import Node

    salt = Node.objects.filter(name=node).values_list("credential_salt", flat=True).first()
    credential = (nodeauth.derive_credential(settings.TRAINYARD_NODE_KEY.encode(), node, salt)
                  if salt else None)
    return nodeauth.seal(credential, node, task, body, time.time())


def send_launch(node: str, payload: dict) -> None:
    """Send a Launch message's JSON (built by the services) to the node's queue, sealed."""
    app.send_task(NODE_LAUNCH_TASK, args=[sealed(node, NODE_LAUNCH_TASK, payload)], queue=node_queue(node))


def send_stop(node: str, job_id: int, attempt_id: int, reason: str) -> None:
    stop = Stop(job_id=job_id, attempt_id=attempt_id, reason=reason)
    app.send_task(NODE_STOP_TASK, args=[sealed(node, NODE_STOP_TASK, stop.model_dump(mode="json"))],
                  queue=node_queue(node))


def send_calibrate(node: str, *, quick: bool, requested_by: int | None) -> None:
    req = CalibrateRequest(quick=quick, requested_by=requested_by)
    app.send_task(NODE_CALIBRATE_TASK, args=[sealed(node, NODE_CALIBRATE_TASK, req.model_dump(mode="json"))],
                  queue=node_queue(node))


def request_tick() -> None:
    # control.beat: a schedule tick on `control` (which nodes may write) is refused (jobs.tasks.BeatTask).
    app.send_task(SCHEDULE_TICK_TASK, queue=CONTROL_BEAT_QUEUE, expires=10)


def publish(group: str, message: dict) -> None:
    """Fan a message out to a Channels group (job.<id>, cluster). Best effort: a browser missing
    a live message is repaired by its next snapshot; a control-plane write must never fail on it."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    try:
        async_to_sync(get_channel_layer().group_send)(group, message)
    except Exception as exc:  # Redis briefly away: the state is in the database
        log.warning("publish to %s failed: %s", group, exc)


def publish_cluster_changed(what: str) -> None:
    publish("cluster", {"type": "cluster.changed", "what": what})


FENCE_TTL_S = 30 * 86400  # a node may come back from a partition days later


def fence(attempt_id: int, reason: str) -> None:
    """Tell an attempt's ranks, wherever they still run, to exit at once: no checkpoint, no more
    telemetry (the preemption key with `fenced`; trainyard/sdk/reporter.py). Best effort: the
    relay and checkpoint_register refuse a fenced attempt's later data anyway."""
    import json

    import redis
    from django.conf import settings

    request = PreemptRequest(reason=reason, grace_s=0.0, fenced=True)
    try:
        redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5).set(
            preempt_key(attempt_id), json.dumps(request.model_dump(mode="json")), ex=FENCE_TTL_S)
    except redis.RedisError as exc:
        log.warning("could not set the fence of attempt %s in Redis: %s", attempt_id, exc)


def request_preempt(attempt_id: int, reason: str, grace_s: float) -> None:
    """Ask an attempt's ranks to checkpoint and exit (trainyard/sdk/preempt.py). Best effort: if
    Redis is away the grace period ends in a stop anyway."""
    import json

    import redis
    from django.conf import settings

    request = PreemptRequest(reason=reason, grace_s=grace_s)
    try:
        redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5).set(
            preempt_key(attempt_id), json.dumps(request.model_dump(mode="json")), ex=int(max(600, 4 * grace_s)))
    except redis.RedisError as exc:
        log.warning("could not request preemption of attempt %s: %s", attempt_id, exc)
