"""Which control-plane processes are alive, judged the same way with or without `make run`'s supervisor.

Each role proves it is alive itself, in Redis, so the judgement holds under systemd too:
    control   the control worker's event loop stamps trainyard:alive:control (ControlStamp, a consumer
              bootstep: a stuck or killed worker stops stamping)
    notify    the notifications' worker (same app, -Q control.notify) stamps trainyard:alive:notify the
              same way; each worker stamps only the roles of the queues it consumes
    beat      beat stamps trainyard:alive:beat on every scheduler tick (StampingScheduler, set as
              beat_scheduler in controlplane/celery.py), not through a task the worker runs, so a
              dead worker does not make beat look dead
    relay     trainyard:relay:alive, refreshed by the relay every round (10 s expiry)
    redis     answers a PING from this web process
    web       answers this request
    agents    the node's last heartbeat is younger than TRAINYARD_NODE_LOST_S (process "agent:<node>")
A stamp is the writer's Unix time with an expiry of TRAINYARD_ALIVE_TTL_S; the writers stamp every
fifth of it, so a missing key = that role has not run for a TTL. Redis's own clock judges the expiry,
so hosts with skewed clocks do not disagree.

`make run`'s supervisor (scripts/supervise.py) adds what only it knows (restarts, exit codes, a
process waiting out its backoff) in a JSON file under var/ (keys.supervisor_status_path), not in
Redis: Redis is one of the processes it supervises and must report on, and the supervisor stays on
the standard library with no Redis credential. The file is trusted only while it is fresh.
"""
from __future__ import annotations

import json
import logging
import time

import redis
from celery import bootsteps
from celery.beat import PersistentScheduler
from django.conf import settings
from django.utils import timezone

from trainyard import keys

log = logging.getLogger(__name__)
STAMPED = ("control", "notify", "beat")
SUPERVISOR_STALE_S = 10.0  # the supervisor rewrites its file every second
_clients: dict[str, redis.Redis] = {}


def _client() -> redis.Redis:
    url = settings.REDIS_URL
    if url not in _clients:
        _clients[url] = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    return _clients[url]


def ttl_s() -> float:
    return float(settings.TRAINYARD_ALIVE_TTL_S)


def stamp(role: str) -> None:
    """Say `role` is alive for the next TTL; a Redis error is logged, never raised (Redis being
    down is reported as Redis down, and the writer must keep running)."""
    try:
        _client().set(keys.alive_key(role), time.time(), px=max(1, int(ttl_s() * 1000)))
    except redis.RedisError as e:
        log.warning("liveness stamp of %s not written: %s", role, e)


class ControlStamp(bootsteps.StartStopStep):
    """Consumer bootstep of the control worker: stamps from the worker's own event loop (timer)."""

    def __init__(self, c, **kwargs):
        self.tref = None
        super().__init__(c, **kwargs)

    def start(self, c):
        # A worker is the role of the queues it consumes: the notifications' worker (same app, -Q
        # control.notify) must not keep the control worker's stamp alive, nor the reverse.
        queues = c.app.amqp.queues.consume_from or {}
        roles = [role for role, queue in (("control", keys.CONTROL_QUEUE), ("notify", keys.NOTIFY_QUEUE))
                 if queue in queues]
        if roles:
            self._stamp(roles)
            self.tref = c.timer.call_repeatedly(ttl_s() / 5, self._stamp, (roles,))

    @staticmethod
    def _stamp(roles: list[str]) -> None:
        for role in roles:
            stamp(role)

    def stop(self, c):
        if self.tref is not None:
            c.timer.cancel(self.tref)
            self.tref = None

    shutdown = stop


class StampingScheduler(PersistentScheduler):
    """Celery beat's scheduler that also stamps beat's liveness on every tick (ticks at least every
    fifth of the TTL)."""

    def tick(self, *args, **kwargs):
        stamp("beat")
        return min(super().tick(*args, **kwargs), ttl_s() / 5)


def _stamps(r: redis.Redis) -> dict[str, float | None]:
    names = [keys.alive_key(role) for role in STAMPED] + [keys.RELAY_ALIVE_KEY]
    values = r.mget(names)
    now = time.time()
    return {role: (max(0.0, now - float(v)) if v is not None else None)
            for role, v in zip((*STAMPED, "relay"), values)}


def processes() -> list[dict]:
    """[{"process", "up", "age_s"}] for web, redis, control, notify, beat, relay and every registered
    agent ("agent:<node>"); age_s = seconds since the last stamp or heartbeat, None if none."""
    rows = [{"process": "web", "up": True, "age_s": 0.0}]
    try:
        r = _client()
        r.ping()
        stamps = _stamps(r)
        rows.append({"process": "redis", "up": True, "age_s": 0.0})
    except redis.RedisError:
        stamps = {}
        rows.append({"process": "redis", "up": False, "age_s": None})
    for role in (*STAMPED, "relay"):
        age = stamps.get(role)
        rows.append({"process": role, "up": age is not None, "age_s": age})
    from jobs.models import Node

    now = timezone.now()
    for name, beat in Node.objects.order_by("name").values_list("name", "last_heartbeat"):
        age = (now - beat).total_seconds() if beat else None
        rows.append({"process": f"agent:{name}", "up": age is not None and age <= settings.TRAINYARD_NODE_LOST_S,
                     "age_s": age})
    return rows


def supervisor() -> dict | None:
    """`make run`'s supervisor state: {"up", "age_s", "processes": {name: {...}}}, or None when no
    supervisor runs here (no file: systemd or another manager). A stale file (the supervisor was
    killed) says up False, and its processes' states are no longer believed (running False)."""
    path = keys.supervisor_status_path()
    try:
        doc = json.loads(path.read_text())
        age = max(0.0, time.time() - float(doc["updated_at"]))
        procs = {str(k): v for k, v in doc["processes"].items() if isinstance(v, dict)}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("supervisor status %s unreadable: %s", path, e)
        return {"up": False, "age_s": None, "processes": {}}
    up = age <= SUPERVISOR_STALE_S
    if not up:
        procs = {k: {**v, "running": False, "pid": None} for k, v in procs.items()}
    return {"up": up, "age_s": age, "processes": procs}
