"""kombu's Redis transport with two repairs a broker outage needs; both Celery apps use it
(trainyard.launch.CELERY_SETTINGS["broker_transport"]), with the same redis:// and rediss:// URLs.

kombu 5.7 has two faults when Redis goes away under a worker that holds unacknowledged messages
(the control worker does: its tasks ack late):

1. **The worker dies.** When the consumer's connection fails while a BRPOP is in flight, kombu's
   first close of the connection fails inside the default channel's close (the in-flight read raises
   a connection error, which is ignored), then closes the transport, which sets the transport's
   `client` to None. The channel stays open. Celery closes the connection again on the way to
   reconnecting; that close reaches the channel's restore of its unacknowledged messages, whose
   new Redis client is built from `transport.client.hostname`: AttributeError, which is neither a
   connection nor a channel error, so it escapes Celery's error handling and the worker exits
   (kombu issues #582, #970; seen in CI once in a 2-core run of test_chaos's Redis restart).
   Repair: a channel remembers the kombu Connection it was opened on and builds its clients from
   that one when the transport has let go of it.

2. **Unacknowledged messages wait an hour.** When that restore cannot reach Redis, the messages
   stay in Redis's `unacked` hash until `visibility_timeout` (3600 s here) has passed, so an
   attempt's exit report delivered just before an outage would be handled an hour late.
   Repair: the delivery tags that could not be restored are kept in this process, and the next
   channel that connects restores them (kombu's own restore, which is idempotent: a tag that was
   acknowledged meanwhile is no longer in the hash and restores nothing). This is what kombu does
   when Redis is reachable at close: the messages go back to their queue and are delivered again
   (the control tasks are idempotent, trainyard.launch).

Three more changes serve the Redis ACL users (trainyard/redis_acl.py; issue 21, section 4):

3. **A delivery says the queue it came from, not what its sender wrote.** kombu takes a message's
   `delivery_info` (exchange, routing key) from the message itself, which whoever pushed it wrote:
   a node could push a task onto `control` claiming it came from `control.beat`, and the restore of
   an unacknowledged message goes to the queue its routing key names (RPUSH by the consumer's user,
   the control plane's for the control worker: into `control.beat`, or into any key). The transport
   now stamps each delivery with the queue it was popped from (default exchange, routing key = that
   queue), so restores go back where the message was and jobs/tasks.py can trust the queue.
4. **No Lua.** kombu's restore of overdue unacknowledged messages takes a redis-py Lock, released by
   a Lua script (EVALSHA). A user allowed EVALSHA can run any script, and a script that loops blocks
   Redis for every client; node users get none. The mutex here is SET NX EX, released by a
   WATCH/GET/MULTI/DEL/EXEC on its key: the same guarantee (only the holder's token deletes it).
5. **No CLIENT SETINFO.** redis-py 8 sends CLIENT SETINFO on connect (ignoring an error); Redis 7.0
   has no such subcommand and refuses an ACL rule that names one, so the node users cannot be granted
   it and the connections do not send it (`driver_info=None`).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid

from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)

_pending_lock = threading.Lock()
_pending: dict[str, set[str]] = {}
"""unacked hash key -> delivery tags whose restore at close failed; restored by the next channel."""


def pending_restores() -> int:
    """How many delivery tags wait to be restored by the next channel (for tests and logs)."""
    with _pending_lock:
        return sum(len(tags) for tags in _pending.values())


class QoS(kombu_redis.QoS):
    def restore_visible(self, start=0, num=10, interval=10):
        """kombu's restore of messages unacknowledged for longer than the visibility timeout, with
        the mutex of repair 4 (kombu 5.7's body otherwise: one in `interval` calls scans)."""
        self._vrestore_count += 1
        if (self._vrestore_count - 1) % (interval or 1):
            return
        with self.channel.conn_or_acquire() as client:
            ceil = time.time() - self.visibility_timeout
            token = uuid.uuid4().hex
            if not client.set(self.unacked_mutex_key, token, nx=True, ex=self.unacked_mutex_expire):
                return  # another consumer of these keys is restoring
            try:
                visible = client.zrange(self.unacked_index_key, ceil, 0, desc=True, byscore=True,
                                        offset=num and start, num=num, withscores=True)
                for tag, _score in visible or []:
                    self.restore_by_tag(tag, client)
            finally:
                _release(client, self.unacked_mutex_key, token)

    def restore_unacked(self, client=None):
        tags = list(self._delivered)
        try:
            return super().restore_unacked(client)
        except Exception as exc:
            # Redis is away (or the transport is half closed): keep the tags for the next channel
            # instead of raising out of the channel's close, and forget them here so that the
            # close finishes (kombu marks the state restored either way).
            with _pending_lock:
                _pending.setdefault(self.unacked_key, set()).update(tags)
            self._delivered.clear()
            log.warning("could not restore %d unacknowledged message(s) at close (%s: %s); the next "
                        "connection restores them", len(tags), type(exc).__name__, exc)
            return None


def _release(client, key: str, token: str) -> None:
    """Delete the mutex `key` if it still holds `token` (it may have expired and been taken)."""
    def release(pipe):
        if pipe.get(key) == token.encode():
            pipe.multi()
            pipe.delete(key)

    client.transaction(release, key)


class Channel(kombu_redis.Channel):
    QoS = QoS

    def __init__(self, connection, *args, **kwargs):
        self._conninfo = connection.client  # the kombu Connection; the transport may drop it first
        super().__init__(connection, *args, **kwargs)  # connects (kombu pings Redis here)
        self._restore_pending()

    def _connparams(self, asynchronous=False):
        if self.connection.client is None and self._conninfo is not None:
            # The kombu Connection closed the transport before this channel (fault 1 above). The
            # transport is referenced only by its channels now; give it back its parameters so the
            # channel's last restore and any late acknowledgement can build a client.
            self.connection.client = self._conninfo
        params = super()._connparams(asynchronous=asynchronous)
        params["driver_info"] = None  # no CLIENT SETINFO (repair 5)
        return params

    def _restore_pending(self) -> None:
        with _pending_lock:
            pending = _pending.pop(self.unacked_key, set())
        if not pending:
            return
        restored = 0
        try:
            with self.conn_or_acquire() as client:
                for tag in sorted(pending):
                    self.qos.restore_by_tag(tag, client=client)
                    pending.discard(tag)
                    restored += 1
        except Exception as exc:  # Redis went away again: the next channel tries the rest
            with _pending_lock:
                _pending.setdefault(self.unacked_key, set()).update(pending)
            log.warning("restored %d of %d unacknowledged message(s) after reconnecting (%s: %s); the "
                        "next connection tries the rest", restored, restored + len(pending),
                        type(exc).__name__, exc)
            return
        log.warning("restored %d unacknowledged message(s) that an earlier connection could not "
                    "restore when it closed", restored)


class Transport(kombu_redis.Transport):
    Channel = Channel

    def _deliver(self, message, queue):
        """Repair 3: the delivery's exchange and routing key are the queue it was popped from."""
        props = message.get("properties") if isinstance(message, dict) else None
        if isinstance(props, dict):
            sent = props.get("delivery_info") if isinstance(props.get("delivery_info"), dict) else {}
            info = {"exchange": "", "routing_key": queue}
            if sent.get("redelivered") is True:  # kombu's restore marks it; Celery reads it
                info["redelivered"] = True
            if isinstance(sent.get("priority"), int) and not isinstance(sent.get("priority"), bool):
                info["priority"] = sent["priority"]
            props["delivery_info"] = info
        return super()._deliver(message, queue)
