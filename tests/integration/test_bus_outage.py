"""The Celery transport's repairs for a Redis outage (trainyard/celery_redis.py), against a real
Redis server that the tests stop and start.

The CI failure this covers: in test_chaos's Redis restart on a 2-core machine, the control worker
died in Celery's reconnect (AttributeError: 'NoneType' object has no attribute 'hostname', from
kombu's restore of unacknowledged messages, kombu issues #582/#970), and every later test of the
module timed out. The sequence below is the one Celery's consumer runs after a connection error
(`Consumer.on_connection_error_after_connected`: `connection.collect()`, then `connection.close()`)
while the consumer's BRPOP is in flight and a message is delivered but not acknowledged; the
in-flight read fails as it does when Redis closes the socket."""
from __future__ import annotations

import pytest
import redis
from kombu import Connection, Exchange, Queue

from trainyard import celery_redis
from trainyard.launch import CELERY_SETTINGS

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

OURS = CELERY_SETTINGS["broker_transport"]
QUEUE = Queue("outage", Exchange("outage"), "outage")


def publish(url: str, transport: str, *bodies: dict) -> None:
    with Connection(url, transport=transport) as conn:
        producer = conn.Producer()
        for body in bodies:
            producer.publish(body, exchange=QUEUE.exchange, routing_key=QUEUE.routing_key, declare=[QUEUE])


def consume_one(url: str, transport: str):
    """A connection whose default channel holds one delivered, unacknowledged message and has a
    BRPOP in flight (as Celery's consumer does between messages)."""
    conn = Connection(url, transport=transport)
    got: list[dict] = []
    channel = conn.default_channel
    consumer = conn.Consumer([QUEUE], callbacks=[lambda body, message: got.append(body)], channel=channel)
    consumer.qos(prefetch_count=1)
    consumer.consume()
    conn.drain_events(timeout=5)
    assert got == [{"n": 0}] and len(channel.qos._delivered) == 1
    channel._brpop_start()
    return conn, channel


def fail_the_inflight_read(channel) -> None:
    """The in-flight BRPOP's read fails like a socket Redis closed; the second failure comes after
    redis-py's disconnect callback cleared the channel's poll state, as it does for real."""
    calls = []

    def read(**kwargs):
        calls.append(1)
        if len(calls) > 1:
            channel._in_poll = None
        raise redis.exceptions.ConnectionError("Connection closed by server.")
    channel._brpop_read = read


def celery_reconnect_cleanup(conn) -> None:
    """What Celery's consumer does with a connection that failed (celery/worker/consumer/consumer.py,
    on_connection_error_after_connected): collect() with its errors ignored, then close() with
    connection and channel errors ignored. Anything else escapes and the worker exits."""
    try:
        conn.collect(socket_timeout=2)
    except Exception:
        pass
    try:
        conn.close()
    except conn.connection_errors + conn.channel_errors:
        pass


def drain(url: str, transport: str, timeout_s: float) -> list[dict]:
    bodies = []
    with Connection(url, transport=transport) as conn, conn.SimpleQueue(QUEUE) as queue:
        while True:
            try:
                message = queue.get(timeout=timeout_s)
            except queue.Empty:
                return bodies
            bodies.append(message.payload)
            message.ack()


def test_stock_kombu_still_crashes_in_celerys_reconnect(redis_server):
    """The fault trainyard.celery_redis repairs, on kombu's own transport. When this fails, kombu
    has fixed it: drop the repair (and this test)."""
    publish(redis_server.url, "redis", {"n": 0})
    conn, channel = consume_one(redis_server.url, "redis")
    redis_server.stop()
    fail_the_inflight_read(channel)
    with pytest.raises(AttributeError, match="hostname"):
        celery_reconnect_cleanup(conn)


def test_the_reconnect_cleanup_survives_and_the_unacked_message_comes_back_at_once(redis_server):
    publish(redis_server.url, OURS, {"n": 0})
    conn, channel = consume_one(redis_server.url, OURS)
    redis_server.stop()
    fail_the_inflight_read(channel)
    celery_reconnect_cleanup(conn)  # no AttributeError
    assert channel.closed
    assert celery_redis.pending_restores() == 1  # could not restore while Redis was away
    redis_server.start()
    # the next connection restores them: delivered again now, not after the visibility timeout
    assert sorted(b["n"] for b in drain(redis_server.url, OURS, 2)) == [0]
    assert celery_redis.pending_restores() == 0


def test_a_close_while_redis_is_away_restores_on_the_next_connection(redis_server):
    """Without the repair, kombu leaves the message in Redis's unacked hash for visibility_timeout
    (3600 s): an attempt's exit report would be handled an hour late."""
    for transport, redelivered in (("redis", []), (OURS, [0])):
        publish(redis_server.url, transport, {"n": 0})
        conn = Connection(redis_server.url, transport=transport)
        queue = conn.SimpleQueue(QUEUE)
        assert queue.get(timeout=5).payload == {"n": 0}  # delivered, not acknowledged
        redis_server.stop()
        conn.close()
        redis_server.start()
        assert [b["n"] for b in drain(redis_server.url, transport, 2)] == redelivered, transport
        with redis.Redis.from_url(redis_server.url) as client:
            client.delete("unacked", "unacked_index")  # stock kombu's stranded copy


def test_a_restore_that_fails_again_is_kept_for_the_connection_after(redis_server, monkeypatch):
    publish(redis_server.url, OURS, {"n": 0})
    conn = Connection(redis_server.url, transport=OURS)
    queue = conn.SimpleQueue(QUEUE)
    assert queue.get(timeout=5).payload == {"n": 0}
    redis_server.stop()
    conn.close()
    assert celery_redis.pending_restores() == 1
    redis_server.start()

    def unreachable(self, tag, client=None, leftmost=False):
        raise redis.exceptions.ConnectionError("Redis went away again")
    with monkeypatch.context() as patch:
        patch.setattr(celery_redis.QoS, "restore_by_tag", unreachable)
        Connection(redis_server.url, transport=OURS).default_channel.close()
    assert celery_redis.pending_restores() == 1
    assert [b["n"] for b in drain(redis_server.url, OURS, 2)] == [0]
