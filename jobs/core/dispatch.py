"""Outbound side effects of services: Celery sends to node queues and the control queue.
Services call these only from transaction.on_commit, so a rolled-back decision sends nothing.

Sends go by task name (trainyard.launch) through the control plane's own Celery app, with the
typed message models' JSON, so the control plane never imports the node agents' code."""
from __future__ import annotations

import logging

from trainyard.keys import CONTROL_BEAT_QUEUE, NOTIFY_QUEUE, SCHEDULER_STATS_KEY, node_queue, preempt_key
from trainyard.launch import (NODE_CALIBRATE_TASK, NODE_LAUNCH_TASK, NODE_STOP_TASK, SCHEDULE_TICK_TASK,
                              CalibrateRequest, PreemptRequest, Stop)

from jobs.core.celery_app import app

log = logging.getLogger(__name__)


def sealed(node: str, task: str, body: dict) -> dict:
    """A command for `node`, sealed with its credential (trainyard.nodeauth: HMAC of the master key
    and the node's salt, so the database alone signs nothing): the agent runs only what verifies.
    A node without a credential (never registered) gets an unsigned envelope, which it refuses."""
    import time

    from django.conf import settings

    from trainyard import nodeauth

    from jobs.models import Node

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


def send_notify(event: str, **fields) -> None:
    """Hand an event to the notifications (jobs/notify/; its own queue and worker): `fields` are ids and
    JSON (job, team, user, kind, message, data, node, quota_change). Never raises: a writer's commit
    is done, and a lost notification must not turn it into an error (logged instead)."""
    from jobs.core.celery_app import NOTIFY_FANOUT_TASK

    try:
        app.send_task(NOTIFY_FANOUT_TASK, args=[{"event": event, **fields}], queue=NOTIFY_QUEUE)
    except Exception as exc:  # Redis away: the event itself is in the database
        log.warning("notification %s %s not sent: %s", event, fields.get("job") or fields.get("node") or "", exc)


def send_delivery(delivery_id: int, countdown: float = 0.0) -> None:
    """One try of a delivery (jobs.tasks.notify_deliver), now or after `countdown` seconds."""
    from jobs.core.celery_app import NOTIFY_DELIVER_TASK

    try:
        app.send_task(NOTIFY_DELIVER_TASK, args=[delivery_id], queue=NOTIFY_QUEUE,
                      countdown=countdown or None)
    except Exception as exc:
        log.warning("delivery %s not queued: %s", delivery_id, exc)


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


# ---------------------------------------------------------------- the schedule tick's timings

TICK_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Upper bounds of the tick-duration histogram (/metrics: trainyard_scheduler_tick_duration_seconds);
a tick takes milliseconds on an idle cluster and its Celery task is killed at 60 s."""
_stats_clients: dict[str, object] = {}


def _stats_client():
    import redis
    from django.conf import settings
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    url = settings.REDIS_URL
    if url not in _stats_clients:
        # Short timeouts and no retries: Redis being away may cost a tick half a second, never more.
        _stats_clients[url] = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5,
                                                   retry=Retry(NoBackoff(), 0))
    return _stats_clients[url]


def scheduler_tick_record(seconds: float, ok: bool) -> None:
    """Count one schedule tick that took `seconds` (ok=False: it raised) in SCHEDULER_STATS_KEY, for
    /metrics, in one MULTI: every bucket at or above it, the count and sum, the last tick. Best
    effort: a Redis error is logged and the tick goes on (the tick's state is in the database)."""
    import time

    import redis

    seconds = max(0.0, float(seconds))
    try:
        pipe = _stats_client().pipeline(transaction=True)
        for bound in TICK_BUCKETS_S:  # by 0 below the value too, so every bucket exists from the first tick
            pipe.hincrby(SCHEDULER_STATS_KEY, f"le:{bound!r}", int(seconds <= bound))
        pipe.hincrby(SCHEDULER_STATS_KEY, "count", 1)
        pipe.hincrbyfloat(SCHEDULER_STATS_KEY, "sum_seconds", seconds)
        pipe.hincrby(SCHEDULER_STATS_KEY, "errors_total", 0 if ok else 1)
        pipe.hset(SCHEDULER_STATS_KEY, mapping={"last_seconds": repr(seconds), "last_unixtime": repr(time.time())})
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("schedule tick timing not recorded in Redis: %s", exc)


# ---------------------------------------------------------------- the attempts' own Redis users

def _redis():
    import redis
    from django.conf import settings

    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5)


def _acl_save(client) -> None:
    """Persist the ACL (a Redis restart keeps the attempts' users). A server without an ACL file, or
    one that may not rewrite it (docs/deploy.md installs it read-only for Redis), keeps them only in
    memory; services.busaccess re-creates missing ones every few seconds (after a restart or an
    operator's ACL LOAD), with the same derived passwords."""
    import redis

    try:
        client.execute_command("ACL", "SAVE")
    except redis.ResponseError as exc:
        global _acl_save_warned
        if not _acl_save_warned:
            _acl_save_warned = True
            log.warning("ACL SAVE failed (%s): the attempts' Redis users live in memory and are re-created "
                        "by the nodes check after a Redis restart", exc)


_acl_save_warned = False


def bus_user_grant(attempt_id: int, job_id: int, password: str, *, fenced: bool = False) -> None:
    """Create (or reset) an attempt's Redis user: XADD to its stream, GET its preemption key.
    `fenced`: only the GET, so ranks behind a partition read their fence and exit, and write nothing."""
    import hashlib

    import redis

    from trainyard import keys, redis_acl

    rule = redis_acl.attempt_rule(attempt_id, stream=keys.attempt_stream(job_id, attempt_id),
                                  preempt_key=preempt_key(attempt_id),
                                  password_sha=hashlib.sha256(password.encode()).hexdigest())
    if fenced:
        rule += ["resetkeys", f"%R~{preempt_key(attempt_id)}", "-xadd"]
    try:
        client = _redis()
        client.execute_command("ACL", "SETUSER", redis_acl.attempt_user(attempt_id), *rule)
        _acl_save(client)
    except redis.RedisError as exc:  # the periodic check grants it again
        log.warning("could not create the Redis user of attempt %s: %s", attempt_id, exc)


def bus_user_revoke(attempt_ids: list[int]) -> None:
    """Delete attempts' Redis users (Redis disconnects their clients)."""
    import redis

    from trainyard import redis_acl

    if not attempt_ids:
        return
    try:
        client = _redis()
        client.execute_command("ACL", "DELUSER", *(redis_acl.attempt_user(a) for a in attempt_ids))
        _acl_save(client)
    except redis.RedisError as exc:
        log.warning("could not delete the Redis users of attempts %s: %s", attempt_ids, exc)


def bus_users() -> set[int] | None:
    """The attempts whose Redis users exist; None when Redis is away."""
    import redis

    from trainyard import redis_acl

    prefix = redis_acl.ATTEMPT_USER_PREFIX
    try:
        names = _redis().execute_command("ACL", "USERS")
    except redis.RedisError as exc:
        log.warning("could not list the attempts' Redis users: %s", exc)
        return None
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    return {int(n[len(prefix):]) for n in names if n.startswith(prefix) and n[len(prefix):].isdigit()}


# ---------------------------------------------------------------- Slurm pools' seats (issue 27)

def node_user_grant(node: str, password: str) -> None:
    """Create (or reset) a seat's Redis user, the rules of any node's (redis_acl.node_rule), with the
    password minted for its current Slurm allocation (jobs/fleet/services/slurm.py)."""
    import hashlib

    import redis

    from trainyard import redis_acl

    try:
        client = _redis()
        client.execute_command("ACL", "SETUSER", node,
                               *redis_acl.node_rule(node, hashlib.sha256(password.encode()).hexdigest()))
        _acl_save(client)
    except redis.RedisError as exc:
        log.warning("could not create the Redis user of seat %s: %s", node, exc)


def node_users_revoke(nodes: list[str]) -> None:
    """Delete seats' Redis users when their allocation ends (Redis disconnects their agents)."""
    import redis

    try:
        client = _redis()
        client.execute_command("ACL", "DELUSER", *nodes)
        _acl_save(client)
    except redis.RedisError as exc:
        log.warning("could not delete the Redis users of seats %s: %s", nodes, exc)


def send_slurm_submit(slurm_job_id: int) -> None:
    """Run sbatch for a SlurmJob row off the tick (jobs.tasks.slurm_submit): on control.beat, which
    only the control plane may write."""
    from jobs.core.celery_app import SLURM_SUBMIT_TASK

    app.send_task(SLURM_SUBMIT_TASK, args=[slurm_job_id], queue=CONTROL_BEAT_QUEUE)
