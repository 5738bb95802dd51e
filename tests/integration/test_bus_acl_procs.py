"""The bus's ACL users with the real programs (issue 21, section 4): a real node agent does everything
it does (consume its queue, restore an unacknowledged message, report to `control`) under its node
user with ACL LOG empty; a restored message goes back to the queue it was popped from, whatever its
sender wrote; and a real control worker runs neither Celery's builtins nor beat's periodic tasks when
a node pushes them onto `control`. tests/test_redis_acl.py has every user's commands one by one."""
from __future__ import annotations

import json
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from celery import Celery

from tests.conftest import REPO, RedisServer
from trainyard import nodeauth
from trainyard.keys import CONTROL_BEAT_QUEUE, CONTROL_QUEUE, node_unacked_keys
from trainyard.launch import (CELERY_SETTINGS, ETA_REFRESH_TASK, HEARTBEAT_TASK, NODE_EXIT_TASK, NODE_STOP_TASK,
                              SCHEDULE_TICK_TASK)

pytestmark = pytest.mark.procs
CREDENTIAL = "test-credential-of-gpu-1"


@pytest.fixture
def bus(tmp_path):
    server = RedisServer(tmp_path / "redis", acl_nodes=["gpu-1", "gpu-10"]).start()
    yield server, redis.Redis.from_url(server.url, socket_timeout=10)
    server.stop()


def celery_app(url: str, node: str | None = None) -> Celery:
    """A Celery app configured as the control plane's (node None) or as node `node`'s agent's."""
    from workers.celery_app import node_conf

    app = Celery(f"test-{node or 'control'}", broker=url)
    app.conf.update(CELERY_SETTINGS)
    if node is not None:
        app.conf.worker_enable_remote_control = False
        app.conf.update(node_conf(node))
    return app


def wait_for(pred, timeout_s: float, what: str, *logs: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}\n" + "\n".join(f"==== {p.name}\n{p.read_text()[-3000:]}" for p in logs))


def acl_denials(admin: redis.Redis) -> list[dict]:
    return [{k: e[k] for k in ("username", "context", "object", "reason") if k in e} for e in admin.acl_log()]


def forge_queue(admin: redis.Redis, queue: str, claimed: str) -> dict:
    """Rewrite the newest message on `queue` (as its sender could have written it) to claim it was
    delivered from `claimed`; returns it."""
    raw = json.loads(admin.lpop(queue))
    raw["properties"]["delivery_info"] = {"exchange": "", "routing_key": claimed}
    admin.lpush(queue, json.dumps(raw))
    return raw


def stop(attempt_id: int) -> list:
    body = {"job_id": 1, "attempt_id": attempt_id, "reason": "cancel"}
    return [nodeauth.seal(CREDENTIAL, "gpu-1", NODE_STOP_TASK, body, time.time())]


def exit_reports(admin: redis.Redis) -> set[int]:
    out = set()
    for m in admin.lrange(CONTROL_QUEUE, 0, -1):
        msg = json.loads(m)
        if msg["headers"]["task"] == NODE_EXIT_TASK:
            import base64

            args = json.loads(base64.b64decode(msg["body"]))[0]
            out.add(args[0]["body"]["attempt_id"])
    return out


def test_a_real_agent_restores_consumes_and_reports_under_its_node_user(bus, tmp_path, repo_env):
    """A Launch-queue message the last agent of gpu-1 held unacknowledged (in gpu-1's own unacked
    keys, older than the visibility timeout) is restored by the new agent and run; a fresh command
    is consumed; the reports reach `control`; ACL LOG stays empty (before issue 21 the agent needed
    kombu's shared `unacked` keys, binding tables, Lua and the celeryev channel)."""
    server, admin = bus
    control = celery_app(server.url)
    control.send_task(NODE_STOP_TASK, args=stop(78), queue="node.gpu-1")
    stranded = json.loads(admin.rpop("node.gpu-1"))
    tag, mine = stranded["properties"]["delivery_tag"], node_unacked_keys("gpu-1")
    admin.hset(mine["unacked_key"], tag, json.dumps([stranded, "", "node.gpu-1"]))
    admin.zadd(mine["unacked_index_key"], {tag: 0})
    credential = tmp_path / "gpu-1.credential"
    credential.write_text(CREDENTIAL + "\n")
    credential.chmod(0o600)
    log = tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-m", "workers.agent", "--name", "gpu-1", "--address", "127.0.0.1",
                              "--slots", "1", "--run-dir", str(tmp_path / "agents"), "--credential-file", str(credential)],
                             cwd=REPO, env=dict(repo_env, REDIS_URL=server.user_url("gpu-1"),
                                                TRAINYARD_VAR_DIR=str(tmp_path / "var")),
                             stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        control.send_task(NODE_STOP_TASK, args=stop(77), queue="node.gpu-1")
        wait_for(lambda: exit_reports(admin) == {77, 78}, 60, "the agent's exit reports for 77 and 78", log)
        assert agent.poll() is None
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
    assert acl_denials(admin) == [], log.read_text()[-3000:]
    assert admin.hlen(mine["unacked_key"]) == 0 and admin.zcard(mine["unacked_index_key"]) == 0
    assert not admin.exists("unacked", "unacked_index", mine["unacked_mutex_key"])
    assert HEARTBEAT_TASK in {json.loads(m)["headers"]["task"] for m in admin.lrange(CONTROL_QUEUE, 0, -1)}


@pytest.mark.parametrize("role,queue", [("gpu-1", "node.gpu-1"), ("control", CONTROL_QUEUE)])
def test_a_restored_message_goes_back_to_the_queue_it_was_popped_from(bus, role, queue):
    """A message whose sender claims it came from `control.beat` is delivered as from the queue it
    was popped from, and a consumer that closes without acknowledging it puts it back there: the
    node's user could not write control.beat (before: NOPERM, and the message stayed stranded);
    the control worker's could, so a node could have moved any task into control.beat."""
    server, admin = bus
    celery_app(server.url).send_task(SCHEDULE_TICK_TASK, queue=queue)
    forge_queue(admin, queue, CONTROL_BEAT_QUEUE)
    app = celery_app(server.url if role == "control" else server.user_url(role), None if role == "control" else role)
    got = []
    with app.connection_for_read() as conn:
        with conn.Consumer([app.amqp.queues[queue]], callbacks=[lambda body, message: got.append(message.delivery_info)],
                           accept=["json"]):
            conn.drain_events(timeout=10)
    assert [(d["exchange"], d["routing_key"]) for d in got] == [("", queue)]
    assert (admin.llen(queue), admin.llen(CONTROL_BEAT_QUEUE)) == (1, 0)
    assert acl_denials(admin) == []
    if role != "control":  # the rendezvous port, as the agent's launch sets and reads it
        node = redis.Redis.from_url(server.user_url(role), driver_info=None)
        assert node.set("trainyard:rdzv:5:9f1c2b3a", 29500, nx=True, ex=86400)
        assert node.get("trainyard:rdzv:5:9f1c2b3a") == b"29500" and acl_denials(admin) == []


def probe(name: str) -> dict:
    """An unregistered node's heartbeat: run by the control worker, it becomes a join request."""
    body = {"name": name, "address": "10.9.9.9", "slots": 1}
    return nodeauth.seal(None, name, HEARTBEAT_TASK, body, time.time())


def test_a_control_worker_runs_neither_builtins_nor_periodic_tasks_a_node_pushes(bus, tmp_path, repo_env):
    server, admin = bus
    db = tmp_path / "db.sqlite3"
    env = dict(repo_env, REDIS_URL=server.url, DJANGO_SETTINGS_MODULE="controlplane.settings", TRAINYARD_DB=str(db),
               TRAINYARD_VAR_DIR=str(tmp_path / "var"), DJANGO_SECRET_KEY="bus-acl-tests-only")
    env.pop("DATABASE_URL", None)
    (tmp_path / "var").mkdir()
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True)
    node = celery_app(server.user_url("gpu-1"), "gpu-1")  # what a node's Redis user can push onto `control`
    heartbeat = {"task": HEARTBEAT_TASK, "args": [], "kwargs": {}, "options": {}, "subtask_type": None,
                 "immutable": False}
    node.send_task("celery.map", args=[heartbeat, [probe("mapped-probe")]], queue=CONTROL_QUEUE)
    node.send_task("celery.starmap", args=[heartbeat, [[probe("starmapped-probe")]]], queue=CONTROL_QUEUE)
    node.send_task(SCHEDULE_TICK_TASK, queue=CONTROL_QUEUE)
    node.send_task(ETA_REFRESH_TASK, queue=CONTROL_QUEUE)
    forge_queue(admin, CONTROL_QUEUE, CONTROL_BEAT_QUEUE)  # the last one claims to come from control.beat
    node.send_task(HEARTBEAT_TASK, args=[probe("direct-probe")], queue=CONTROL_QUEUE)  # a report: it runs
    celery_app(server.url).send_task(ETA_REFRESH_TASK, queue=CONTROL_BEAT_QUEUE)  # beat's: it runs
    log = tmp_path / "control.log"
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-Q",
                               f"{CONTROL_QUEUE},{CONTROL_BEAT_QUEUE}", "-n", "control@%h", "-c", "1", "-l", "INFO",
                               "--without-gossip", "--without-mingle"], cwd=REPO, env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT)

    def rows(sql: str) -> list:
        with sqlite3.connect(db) as conn:
            return conn.execute(sql).fetchall()

    def results(task: str) -> list[str]:  # what each run of `task` returned (None: refused)
        return sorted(re.findall(rf"jobs\.tasks\.{task}\[[^\]]+\] succeeded in \S+: (\S+)", log.read_text()))

    try:
        wait_for(lambda: len(results("eta_refresh")) == 2 and results("node_heartbeat"), 90,
                 "the control worker to take every task", log)
        wait_for(lambda: log.read_text().count("Received unregistered task of type") == 2, 20,
                 "the builtins refused as unregistered", log)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert rows("SELECT name FROM jobs_nodejoinrequest") == [("direct-probe",)]  # neither builtin ran
    assert rows("SELECT kind, node, count FROM jobs_securityevent WHERE kind = 'periodic_on_control'") == [
        ("periodic_on_control", "queue:control", 2)]
    assert results("eta_refresh") == ["0", "None"] and results("schedule_tick") == ["None"]  # beat's alone ran
    text = log.read_text()
    assert "'celery.map'" in text and "'celery.starmap'" in text and text.count("refused periodic task") == 2
    assert admin.llen(CONTROL_QUEUE) + admin.llen(CONTROL_BEAT_QUEUE) == 0 and acl_denials(admin) == []
