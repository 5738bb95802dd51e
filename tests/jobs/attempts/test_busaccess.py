"""Each attempt's own Redis user (issue 21 section 3) against a real redis-server with make run's ACL
file: created before the launches, able to write only its own stream and read only its own
preemption key, deleted at the attempt's end (its connections cut), kept read-only for a fenced
attempt, and put right by the periodic reconcile after a Redis restart or a missed end."""
from __future__ import annotations

import json

import psutil
import pytest
import redis
from django.db import transaction

from jobs.core import dispatch
from jobs import services
from jobs.models import Attempt
from jobs.attempts.services.busaccess import attempt_secrets
from trainyard import keys, redis_acl
from tests.conftest import RedisServer

from tests.jobs.runs.test_services import start, submit

REAL = {name: getattr(dispatch, name) for name in ("bus_user_grant", "bus_user_revoke", "fence")}
pytestmark = [pytest.mark.procs, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def bus(tmp_path, settings, monkeypatch):
    server = RedisServer(tmp_path / "redis", acl_nodes=["node-a", "node-b"]).start()
    settings.REDIS_URL = server.url
    for name, fn in REAL.items():
        monkeypatch.setattr(dispatch, name, fn)
    yield server
    server.stop()


def attempt_client(server: RedisServer, attempt: Attempt) -> redis.Redis:
    url = redis_acl.url_for(server.base_url, redis_acl.attempt_user(attempt.pk), attempt_secrets(attempt).redis_password)
    return redis.Redis.from_url(url, socket_timeout=5, driver_info=None)


def users(server: RedisServer) -> list[str]:
    return [u.decode() if isinstance(u, bytes) else u for u in redis.Redis.from_url(server.url).acl_users()]


def refused(fn) -> bool:
    try:
        fn()
    except (redis.exceptions.NoPermissionError, redis.exceptions.AuthenticationError):
        return True
    except redis.ResponseError as exc:
        return "NOPERM" in str(exc) or "WRONGPASS" in str(exc)
    return False


def test_an_attempts_user_writes_its_stream_and_reads_its_fence_and_nothing_else(user, nodes, bus):
    job, other = submit(user), submit(user)
    attempt, other_attempt = start(job), start(other)
    r = attempt_client(bus, attempt)
    own = keys.attempt_stream(job.pk, attempt.pk)
    pipe = r.pipeline(transaction=True)  # as the reporter writes: MULTI/EXEC
    pipe.xadd(own, {"type": "metrics", "data": "[]"})
    pipe.execute()
    assert r.get(keys.preempt_key(attempt.pk)) is None
    assert refused(lambda: r.xadd(keys.attempt_stream(other.pk, other_attempt.pk), {"type": "log", "data": "{}"}))
    assert refused(lambda: r.xrange(own))  # not even its own stream can be read back
    assert refused(lambda: r.set(keys.preempt_key(attempt.pk), "x"))
    assert refused(lambda: r.get(keys.preempt_key(other_attempt.pk)))
    assert refused(lambda: r.lpush("control", "x")) and refused(lambda: r.execute_command("CLIENT", "LIST"))
    assert refused(lambda: r.keys("*")) and refused(lambda: r.execute_command("CONFIG", "GET", "*"))


def test_the_user_goes_with_the_attempt_and_its_connections_are_cut(user, nodes, bus):
    job = submit(user)
    attempt = start(job)
    r = attempt_client(bus, attempt)
    r.get(keys.preempt_key(attempt.pk))  # connected
    services.attempt_node_exit(attempt.pk, node_name="node-a", result={"node": "node-a", "exit_code": 0, "stopped": False,
                                                                        "failures": []})
    services.attempt_node_exit(attempt.pk, node_name="node-b", result={"node": "node-b", "exit_code": 0, "stopped": False,
                                                                        "failures": []})
    attempt.refresh_from_db()
    assert attempt.status == Attempt.Status.ENDED
    assert redis_acl.attempt_user(attempt.pk) not in users(bus)
    assert refused(lambda: r.get(keys.preempt_key(attempt.pk)))  # the old connection too: a new AUTH fails


def test_a_fenced_attempt_may_read_its_fence_and_write_nothing(user, nodes, bus):
    from jobs.attempts.services.attempts import attempt_fence

    job = submit(user)
    attempt = start(job)
    with transaction.atomic():
        attempt_fence(attempt, "node-a")
    r = attempt_client(bus, attempt)
    fence = json.loads(r.get(keys.preempt_key(attempt.pk)))
    assert fence["fenced"] is True
    assert refused(lambda: r.xadd(keys.attempt_stream(job.pk, attempt.pk), {"type": "metrics", "data": "[]"}))


def test_the_reconcile_recreates_lost_users_and_deletes_stale_ones(user, nodes, bus):
    job = submit(user)
    attempt = start(job)
    control = redis.Redis.from_url(bus.url)
    name = redis_acl.attempt_user(attempt.pk)
    control.execute_command("ACL", "DELUSER", name)  # a Redis restart without the ACL file, an operator's ACL LOAD
    stale = redis_acl.attempt_user(attempt.pk + 1000)
    control.execute_command("ACL", "SETUSER", stale, "on", ">x", "~*", "+@all")  # an end that was missed
    done = services.attempt_access_reconcile()
    assert done == {"redis": True, "granted": [attempt.pk], "revoked": [attempt.pk + 1000]}
    assert name in users(bus) and stale not in users(bus)
    r = attempt_client(bus, attempt)  # the same derived password as in its Launch
    r.xadd(keys.attempt_stream(job.pk, attempt.pk), {"type": "metrics", "data": "[]"})
    assert services.attempt_access_reconcile() == {"redis": True, "granted": [], "revoked": []}


def test_the_users_survive_a_redis_restart_through_the_acl_file(user, nodes, bus):
    job = submit(user)
    attempt = start(job)
    bus.stop()
    bus.start()
    assert redis_acl.attempt_user(attempt.pk) in users(bus)
    assert psutil.pid_exists(bus.proc.pid)
