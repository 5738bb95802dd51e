"""The Redis configuration every Redis of Trainyard runs with (issue 21, section 6), on a real
redis-server as tests/conftest.RedisServer starts it, like `make run` (Procfile) and docs/deploy.md.
Before, Redis took request arguments up to its default 512 MB: a few such XADDs from one job could
fill Redis and make the relay, which reads 500 entries per round, run out of memory."""
from __future__ import annotations

import pytest
import redis

pytestmark = pytest.mark.procs


def test_redis_refuses_a_9_mb_field(redis_server):
    """proto-max-bulk-len 8mb (tests/conftest.py, as make run and docs/deploy.md): a 9 MB XADD is
    refused by the server before any reader sees it; 7 MB still goes in."""
    client = redis.Redis.from_url(redis_server.url, socket_timeout=30)
    with pytest.raises(redis.RedisError):
        client.xadd("trainyard:job:1:a1", {"type": "log", "data": b"x" * (9 * 1024 * 1024)})
    client = redis.Redis.from_url(redis_server.url, socket_timeout=30)
    assert client.exists("trainyard:job:1:a1") == 0
    client.xadd("trainyard:job:1:a1", {"type": "log", "data": b"x" * (7 * 1024 * 1024)})
    assert client.xlen("trainyard:job:1:a1") == 1
