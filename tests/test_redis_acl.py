"""Redis ACL users (trainyard/redis_acl.py; issue 16 section 1, issue 21 section 4), against a real
redis-server started with make run's ACL file (tests/conftest.RedisServer), command by command.

Before issue 21 the generated node rule was `~node.<name>* ... +@all -@admin -@dangerous`: node gpu-1
could BRPOP node.gpu-10's launches and the `control` queue (every node's reports), read, trim or
XGROUP SETID every job stream, SET any attempt's preemption key to a fence, read every node's
unacknowledged Launch messages from kombu's shared `unacked` hash, run Lua (EVALSHA) and CLIENT LIST;
the documented deploy/redis/users.acl (a different rule) granted CLIENT PAUSE and KILL. Each row of
TABLE is one of those, or something an agent or a rank really does (tests/integration/
test_bus_acl_procs.py runs a real agent and checks that ACL LOG stays empty)."""
from __future__ import annotations

import hashlib
import re

import pytest
import redis

from tests.conftest import REPO, RedisServer
from trainyard import redis_acl

pytestmark = pytest.mark.procs

SEP = "\x06\x16"  # kombu's priority-queue separator
TOKEN = "9f1c2b3a4d5e6f708192a3b4c5d6e7f8"  # an attempt's rendezvous token (128 bits, hex)
STREAM_5, STREAM_6 = "trainyard:job:3:a5", "trainyard:job:3:a6"  # attempts 5 and 6 of job 3
N = "gpu-1"
UNACKED, INDEX, MUTEX = (f"trainyard:{k}:{N}" for k in ("unacked", "unacked_index", "unacked_mutex"))

# (command, who may run it) -- each command runs through ACL DRYRUN for every user; a user not named
# must be refused. "node" is gpu-1 (gpu-10 and gpu-2 exist too), "attempt" is attempt 5's user.
TABLE: list[tuple[tuple[str, ...], set[str]]] = [
    # ---- what a node agent does (kombu's Redis transport under Celery, the rendezvous port)
    (("PING",), {"control", "node", "attempt"}),
    (("BRPOP", f"node.{N}", f"node.{N}{SEP}3", f"node.{N}{SEP}6", f"node.{N}{SEP}9", "1"), {"control", "node"}),
    (("RPUSH", f"node.{N}", "restored"), {"control", "node"}),
    (("LPUSH", f"node.{N}{SEP}9", "requeued"), {"control", "node"}),
    (("MULTI",), {"control", "node", "attempt"}),
    (("EXEC",), {"control", "node", "attempt"}),
    (("DISCARD",), {"control", "node", "attempt"}),
    (("UNWATCH",), {"control", "node"}),
    (("ZADD", INDEX, "1764000000.5", "tag"), {"control", "node"}),
    (("HSET", UNACKED, "tag", "[msg, ex, rk]"), {"control", "node"}),
    (("ZREM", INDEX, "tag"), {"control", "node"}),
    (("HDEL", UNACKED, "tag"), {"control", "node"}),
    (("WATCH", UNACKED), {"control", "node"}),
    (("HGET", UNACKED, "tag"), {"control", "node"}),
    (("ZRANGE", INDEX, "1764000000", "0", "BYSCORE", "REV", "LIMIT", "0", "10", "WITHSCORES"), {"control", "node"}),
    (("SET", MUTEX, "token", "NX", "EX", "300"), {"control", "node"}),
    (("WATCH", MUTEX), {"control", "node"}),
    (("GET", MUTEX), {"control", "node"}),
    (("DEL", MUTEX), {"control", "node"}),
    (("LPUSH", "control", "signed report"), {"control", "node"}),
    (("SET", f"trainyard:rdzv:5:{TOKEN}", "29500", "NX", "EX", "86400"), {"control", "node"}),
    (("GET", f"trainyard:rdzv:5:{TOKEN}"), {"control", "node"}),
    # ---- what a rank does with its attempt's user (trainyard/sdk/reporter.py)
    (("XADD", STREAM_5, "*", "type", "metric", "data", "[]"), {"control", "attempt"}),
    (("GET", "trainyard:preempt:5"), {"control", "attempt"}),
    # ---- the control queue: nodes write it, never read, trim or empty it
    (("BRPOP", "control", "1"), {"control"}),
    (("LRANGE", "control", "0", "-1"), {"control"}),
    (("LLEN", "control"), {"control"}),
    (("DEL", "control"), {"control"}),
    (("LPOP", "control"), {"control"}),
    (("LPUSH", "control.beat", "forged tick"), {"control"}),
    (("BRPOP", "control.beat", "1"), {"control"}),
    (("LPUSH", "control.notify", "forged delivery"), {"control"}),  # notifications' queue (issue 25)
    (("BRPOP", "control.notify", "1"), {"control"}),
    (("SADD", "_kombu.binding.control", f"control{SEP}{SEP}node.{N}"), {"control"}),
    (("SMEMBERS", "_kombu.binding.control"), {"control"}),
    # ---- other nodes' queues (gpu-1 must not match gpu-10 nor gpu-1.b)
    (("BRPOP", "node.gpu-2", "1"), {"control"}),
    (("BRPOP", "node.gpu-10", "1"), {"control"}),
    (("BRPOP", f"node.gpu-10{SEP}3", "1"), {"control"}),
    (("BRPOP", "node.gpu-1.b", "1"), {"control"}),
    (("LRANGE", "node.gpu-2", "0", "-1"), {"control"}),
    (("LPUSH", "node.gpu-2", "forged launch"), {"control"}),
    (("SADD", "_kombu.binding.node.gpu-2", "x"), {"control"}),
    # ---- job streams: the relay's (control) alone; an attempt only XADDs its own
    (("XADD", "trainyard:job:7", "*", "type", "metric"), {"control"}),
    (("XADD", STREAM_6, "*", "type", "metric"), {"control"}),
    (("XREAD", "STREAMS", STREAM_5, "0"), {"control"}),
    (("XRANGE", STREAM_5, "-", "+"), {"control"}),
    (("XLEN", STREAM_5), {"control"}),
    (("XGROUP", "SETID", STREAM_5, "relay", "$"), {"control"}),
    (("XTRIM", STREAM_5, "MAXLEN", "0"), {"control"}),
    (("XREADGROUP", "GROUP", "relay", "x", "STREAMS", STREAM_5, ">"), {"control"}),
    (("XDEL", STREAM_5, "0-1"), {"control"}),
    (("DEL", STREAM_5), {"control"}),
    (("XREAD", "STREAMS", "trainyard:job:7", "0"), {"control"}),
    (("XADD", "trainyard:relay:deadletter", "*", "a", "b"), {"control"}),
    # ---- preemption keys: the control plane writes them, only the attempt's own user reads it
    (("SET", "trainyard:preempt:5", '{"fenced": true}'), {"control"}),
    (("DEL", "trainyard:preempt:5"), {"control"}),
    (("GET", "trainyard:preempt:6"), {"control"}),
    (("XADD", "trainyard:preempt:5", "*", "a", "b"), {"control"}),
    # ---- kombu's unacked bookkeeping: the control worker's (default keys) and other nodes'
    (("HGETALL", "unacked"), {"control"}),
    (("HGET", "unacked", "tag"), {"control"}),
    (("ZRANGE", "unacked_index", "0", "-1"), {"control"}),
    (("SET", "unacked_mutex", "x", "NX", "EX", "300"), {"control"}),
    (("HGETALL", "trainyard:unacked:gpu-2"), {"control"}),
    (("HGET", "trainyard:unacked:gpu-10", "tag"), {"control"}),
    (("ZRANGE", "trainyard:unacked_index:gpu-2", "0", "-1"), {"control"}),
    # ---- rendezvous keys: nodes only
    (("SET", f"trainyard:rdzv:5:{TOKEN}", "1"), {"control", "node"}),
    (("DEL", f"trainyard:rdzv:5:{TOKEN}"), {"control"}),
    # ---- the rest of the control plane's keys and the Channels layer
    (("GET", "trainyard:relay:stats"), {"control"}),
    (("SET", "trainyard:alive:control", "1"), {"control"}),
    (("ZRANGE", "asgi:group:job.1", "0", "-1"), {"control"}),
    # ---- no channels, no scripts, no server or connection administration
    (("PUBLISH", "/0.celery.pidbox", "shutdown"), {"control"}),
    (("PUBLISH", "/0.celeryev/worker.heartbeat", "x"), {"control"}),
    (("SUBSCRIBE", "/0.celery.pidbox"), {"control"}),
    (("PSUBSCRIBE", "*"), {"control"}),
    (("CLIENT", "PAUSE", "10000"), {"control"}),
    (("CLIENT", "KILL", "ID", "1"), {"control"}),
    (("CLIENT", "LIST"), {"control"}),
    (("CLIENT", "SETNAME", "x"), {"control"}),
    (("SCAN", "0"), {"control"}),
    (("KEYS", "*"), {"control"}),
    (("CONFIG", "GET", "*"), {"control"}),
    (("CONFIG", "SET", "proto-max-bulk-len", "1gb"), {"control"}),
    (("FLUSHALL",), {"control"}),
    (("FLUSHDB",), {"control"}),
    (("EVAL", "while true do end", "0"), {"control"}),
    (("EVALSHA", "a" * 40, "0"), {"control"}),
    (("SCRIPT", "LOAD", "return 1"), {"control"}),
    (("ACL", "LIST"), {"control"}),
    (("ACL", "SETUSER", "trainyard-attempt-9", "on", "~*", "+@all"), {"control"}),
    (("ACL", "DELUSER", "trainyard-attempt-6"), {"control"}),
    (("ACL", "SAVE"), {"control"}),
    (("SELECT", "1"), {"control"}),
    (("MONITOR",), {"control"}),
    (("INFO",), {"control"}),
]


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("acl") / "redis", acl_nodes=[N, "gpu-10", "gpu-2"]).start()
    admin = redis.Redis.from_url(server.url, socket_timeout=10)
    for attempt, stream in ((5, STREAM_5), (6, STREAM_6)):
        admin.execute_command("ACL", "SETUSER", redis_acl.attempt_user(attempt), *redis_acl.attempt_rule(
            attempt, stream=stream, preempt_key=f"trainyard:preempt:{attempt}",
            password_sha=hashlib.sha256(f"pw-{attempt}".encode()).hexdigest()))
    yield server, admin
    server.stop()


USERS = {"control": redis_acl.CONTROL_USER, "node": N, "attempt": redis_acl.attempt_user(5), "default": "default"}


@pytest.mark.parametrize("command,allowed", TABLE, ids=[" ".join(c)[:60].replace(SEP, "<sep>") for c, _ in TABLE])
def test_acl_dryrun_table(acl_server, command, allowed):
    _, admin = acl_server
    got = {}
    for role, user in USERS.items():
        reply = admin.execute_command("ACL", "DRYRUN", user, *command)
        got[role] = reply == b"OK"
        if not got[role]:
            assert b"no permissions" in reply, reply  # refused by the ACL, not an unknown command
    assert {role for role, ok in got.items() if ok} == allowed


def test_the_table_names_every_finding_of_issue_21(acl_server):
    """The refusals issue 21 section 4 lists, each present in TABLE as refused for the node."""
    refused = {" ".join(c) for c, who in TABLE if "node" not in who}
    for needed in ["BRPOP control", "LRANGE control", "DEL control", "BRPOP node.gpu-2", "BRPOP node.gpu-10",
                   "XADD trainyard:job:7", "XREAD STREAMS trainyard:job:7", "XRANGE", "XLEN", "XGROUP SETID", "XTRIM",
                   "SET trainyard:preempt:5", "GET trainyard:preempt:6", "HGETALL unacked", "ZRANGE unacked_index",
                   "HGETALL trainyard:unacked:gpu-2", "CLIENT PAUSE", "CLIENT KILL", "CLIENT LIST", "SCAN", "KEYS",
                   "CONFIG", "FLUSHALL", "ACL", "PUBLISH", "SUBSCRIBE", "EVAL", "LPUSH control.beat"]:
        assert any(r.startswith(needed) for r in refused), needed
    assert ("GET", "trainyard:preempt:5") in [c for c, who in TABLE if "node" not in who]


def test_no_password_no_access(acl_server):
    server, _ = acl_server
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(server.base_url).lpush("control", "forged")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(redis_acl.url_for(server.base_url, N, "a guess")).ping()


def test_an_attempt_user_writes_its_stream_in_pipelines_and_reads_its_preemption_key(acl_server):
    """The ranks' real client (trainyard.sdk.reporter) under attempt 5's user: telemetry in MULTI/EXEC
    pipelines and the preemption poll, and nothing in ACL LOG."""
    from trainyard.sdk.reporter import Reporter

    server, admin = acl_server
    admin.execute_command("ACL", "SETUSER", "trainyard-attempt-7", *redis_acl.attempt_rule(
        7, stream="trainyard:job:4:a7", preempt_key="trainyard:preempt:7",
        password_sha=hashlib.sha256(b"pw-7").hexdigest()))
    admin.acl_log_reset()
    admin.set("trainyard:preempt:7", '{"reason": "drain", "grace_s": 30.0}')
    rep = Reporter(redis_acl.url_for(server.base_url, "trainyard-attempt-7", "pw-7"), "trainyard:job:4:a7",
                   rank=0, attempt=7, preempt_key="trainyard:preempt:7", min_flush_gap_s=0.0)
    for step in range(20):
        rep.metric({"rank": 0, "step": step, "loss": 1.0 / (step + 1)})
    rep.event("started")
    assert rep.preempt_requested.wait(10)
    assert rep.close(10) and rep.failures == 0
    assert admin.xlen("trainyard:job:4:a7") >= 2 and admin.acl_log() == []
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis.from_url(redis_acl.url_for(server.base_url, "trainyard-attempt-7", "pw-7")).xadd(
            STREAM_5, {"type": "metric", "data": "[]"})


def acl_rules(admin: redis.Redis) -> dict[str, list]:
    """ACL LIST as user -> its root rules and its selectors', each sorted (Redis lists a user's
    commands in no fixed order)."""
    out = {}
    for line in admin.acl_list():
        tokens = re.findall(r"\([^)]*\)|\S+", line)
        out[tokens[1]] = sorted(t for t in tokens[2:] if not t.startswith("(")) + sorted(
            " ".join(sorted(t[1:-1].split())) for t in tokens[2:] if t.startswith("("))
    return out


def test_acl_save_and_a_restart_keep_every_rule(tmp_path):
    """The control plane saves the attempt users it creates (ACL SAVE rewrites the ACL file in
    Redis's own form); a restarted Redis loads that file back with the same rules."""
    server = RedisServer(tmp_path / "redis", acl_nodes=[N]).start()
    try:
        admin = redis.Redis.from_url(server.url)
        admin.execute_command("ACL", "SETUSER", "trainyard-attempt-5", *redis_acl.attempt_rule(
            5, stream=STREAM_5, preempt_key="trainyard:preempt:5", password_sha=hashlib.sha256(b"x").hexdigest()))
        before = acl_rules(admin)
        admin.execute_command("ACL", "SAVE")
        server.stop()
        server.start()
        admin = redis.Redis.from_url(server.url)
        assert acl_rules(admin) == before and len(before) == 4
        assert admin.execute_command("ACL", "DRYRUN", N, "BRPOP", f"node.{N}{SEP}6", "1") == b"OK"
    finally:
        server.stop()


# ---------------------------------------------------------------- one source for every ACL text

def test_deploy_example_and_the_guide_are_the_generated_rules():
    """deploy/redis/users.acl is `python -m trainyard.redis_acl example`, and docs/deploy.md shows
    that file as it is: the documented rules are the ones make run and the tests load."""
    example = redis_acl.example_text()
    assert (REPO / "deploy" / "redis" / "users.acl").read_text() == example, \
        "regenerate it: .venv/bin/python -m trainyard.redis_acl example > deploy/redis/users.acl"
    guide = (REPO / "docs" / "deploy.md").read_text()
    blocks = re.findall(r"^```acl\n(.*?)^```", guide, flags=re.S | re.M)
    assert blocks == [example], "docs/deploy.md's ```acl block is not deploy/redis/users.acl"
    node_line = next(line for line in example.splitlines() if line.startswith(f"user {N} "))
    assert node_line == f"user {N} " + " ".join(redis_acl.node_rule(N, "<sha256-of-gpu-1-password>"))


def test_rules_refuse_names_that_would_widen_them():
    for bad in ["gpu*", "gpu 1", "a[1]", "trainyard-control", "default", "trainyard-attempt-3", "x:y", ""]:
        with pytest.raises(ValueError):
            redis_acl.node_rule(bad, "0" * 64)
    sha = "0" * 64
    for stream, key in [("trainyard:job:*", "trainyard:preempt:5"), ("trainyard:job:3:a5", "trainyard:preempt:?"),
                        ("trainyard:job:3:a5 ~*", "trainyard:preempt:5")]:
        with pytest.raises(ValueError):
            redis_acl.attempt_rule(5, stream=stream, preempt_key=key, password_sha=sha)
    with pytest.raises(ValueError):
        redis_acl.attempt_rule(5, stream=STREAM_5, preempt_key="trainyard:preempt:5", password_sha="not a sha")
    assert redis_acl.attempt_user(12) == "trainyard-attempt-12"


def test_files_are_private_and_hold_no_plain_password(tmp_path):
    acl = redis_acl.write(tmp_path, ["node-a", "node-b"])
    for user in (redis_acl.CONTROL_USER, "node-a", "node-b"):
        path = redis_acl.password_path(tmp_path, user)
        assert path.stat().st_mode & 0o077 == 0 and path.read_text().strip() not in acl.read_text()
    assert acl.stat().st_mode & 0o077 == 0


def test_passwords_survive_a_rewrite_and_names_are_checked(tmp_path):
    redis_acl.write(tmp_path, ["node-a"])
    before = redis_acl.password_path(tmp_path, "node-a").read_text()
    redis_acl.write(tmp_path, ["node-a", "node-c"])
    assert redis_acl.password_path(tmp_path, "node-a").read_text() == before
    with pytest.raises(ValueError):
        redis_acl.acl_text({"bad name ~*": "pw"})
    with pytest.raises(ValueError):
        redis_acl.write(tmp_path, ["trainyard-control"])
    assert redis_acl.url_for("rediss://h:6380/0", "node-a", "p/w") == "rediss://node-a:p%2Fw@h:6380/0"
