"""Redis ACL users of `make run` (trainyard/redis_acl.py; issue 16, section 1), against a real
redis-server started with the generated ACL file. Before, `make run`'s Redis took any client
without a password: any local process could read node queues, push forged tasks or FLUSHALL."""
from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis

from tests.conftest import free_port
from trainyard import redis_acl

pytestmark = pytest.mark.procs


@pytest.fixture
def acl_redis(tmp_path):
    acl = redis_acl.write(tmp_path, ["node-a", "node-b"])
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path), "--save", "", "--aclfile", str(acl)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"redis://127.0.0.1:{port}/0"

    def client(user: str | None) -> redis.Redis:
        url = base if user is None else redis_acl.url_for(
            base, user, redis_acl.password_path(tmp_path, user).read_text().strip())
        return redis.Redis.from_url(url, socket_timeout=5)

    control = client(redis_acl.CONTROL_USER)
    deadline = time.monotonic() + 10
    while True:
        try:
            control.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield client, tmp_path
    proc.terminate()
    proc.wait(10)


def test_files_are_private_and_hold_no_plain_password(acl_redis):
    _, root = acl_redis
    acl = (root / "redis" / "users.acl").read_text()
    for user in (redis_acl.CONTROL_USER, "node-a", "node-b"):
        path = redis_acl.password_path(root, user)
        assert path.stat().st_mode & 0o077 == 0 and path.read_text().strip() not in acl
    assert (root / "redis" / "users.acl").stat().st_mode & 0o077 == 0


def test_no_password_no_access_and_a_node_reaches_only_its_own(acl_redis):
    client, _ = acl_redis
    with pytest.raises(redis.AuthenticationError):
        client(None).lpush("control", "forged")
    a, b = client("node-a"), client("node-b")
    a.lpush("node.node-a", "launch")
    with pytest.raises(redis.exceptions.NoPermissionError):
        b.lpop("node.node-a")  # node-b cannot take node-a's launches
    for forbidden in (lambda: b.flushall(), lambda: b.keys("*"), lambda: b.config_get("*"),
                      lambda: b.get("trainyard:relay:stats"), lambda: b.publish("celery.pidbox", "shutdown")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    # What an agent and its ranks do: its queue, reports to control, job streams, rendezvous/preempt keys.
    assert a.lpop("node.node-a") == b"launch"
    b.lpush("control", "signed report")
    b.xadd("trainyard:job:7", {"type": "metric"})
    b.set("trainyard:rdzv:9", 29500)
    assert b.get("trainyard:preempt:9") is None
    assert client(redis_acl.CONTROL_USER).llen("control") == 1


def test_passwords_survive_a_rewrite_and_names_are_checked(tmp_path):
    redis_acl.write(tmp_path, ["node-a"])
    before = redis_acl.password_path(tmp_path, "node-a").read_text()
    redis_acl.write(tmp_path, ["node-a", "node-c"])
    assert redis_acl.password_path(tmp_path, "node-a").read_text() == before
    with pytest.raises(ValueError):
        redis_acl.acl_text({"bad name ~*": "pw"})
    assert redis_acl.url_for("rediss://h:6380/0", "node-a", "p/w") == "rediss://node-a:p%2Fw@h:6380/0"
