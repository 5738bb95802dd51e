"""Issue 16, section 3: agents on other hosts. Four test hosts on a bridge (tests/integration/hosts.py,
network namespaces with their own addresses): `cp` runs the control plane (Redis with its ACL users
listening on cp's address, the web server, the control worker, beat, the relay), `gpu-1` and
`gpu-2` one node agent each, registered by staff with their hosts' addresses (node_add), connecting
to Redis over the bridge with their own ACL user and signing their reports with their credential;
`rogue` is a host on the same network with no credentials.

- a 2-node job whose two ranks rendezvous across the hosts (gloo over the bridge) SUCCEEDS;
- from `rogue`, Redis refuses every command without credentials (no task received, no report or
  telemetry written) and a report signed with a guessed credential is refused as a security event;
- fencing under a real partition: the host a job trains on is cut off (its bridge port down) while
  its ranks train on and keep checkpointing to the shared file system; the node is written off, the
  job resumes on the other host from a checkpoint at or before the fence, and when the cable is
  back the stale ranks exit on the fence: none of their samples or checkpoints after it is taken in.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, RedisServer

from . import hosts
from .cluster import Cluster, attempt_processes
from .test_chaos import spec
from .test_fencing_procs import (assert_nothing_after_the_fence_and_cancel, node_status, restarted_elsewhere,
                                 running, training_with_a_checkpoint)

ok, why = hosts.available()
pytestmark = [pytest.mark.procs, pytest.mark.timeout(900),
              pytest.mark.skipif(not ok, reason=f"network namespaces unavailable: {why}")]
LOST_S = 6.0
METRICS_TOKEN = "multihost-scraper"
PLACE = {"node-a": "gpu-1", "node-b": "gpu-2"}


class HostsCluster(Cluster):
    """tests/integration/cluster.py's processes, each on its test host: the control plane on `cp`,
    node-a's agent on gpu-1, node-b's on gpu-2 (their registered and advertised addresses)."""

    def __init__(self, workdir, net: hosts.Hosts):
        super().__init__(workdir)
        self.net = net
        self.host = net.address("cp")
        self.node_addresses = {name: net.address(h) for name, h in PLACE.items()}
        self.redis = RedisServer(self.dir / "redis", acl_nodes=list(PLACE), host=self.host,
                                 prefix=net.exec_argv("cp", []))
        self.env["DJANGO_ALLOWED_HOSTS"] = self.host
        self.env["TRAINYARD_NODE_LOST_S"] = str(LOST_S)
        self.env["TRAINYARD_METRICS_TOKEN"] = METRICS_TOKEN

    def commands(self) -> dict[str, list[str]]:
        return {name: self.net.exec_argv(PLACE.get(name, "cp"), argv) for name, argv in super().commands().items()}


@pytest.fixture(scope="module")
def net():
    if os.environ.get("DATABASE_URL"):
        pytest.skip("the test hosts reach no PostgreSQL server on the machine's loopback")
    with hosts.bridged_hosts(["cp", "gpu-1", "gpu-2", "rogue"]) as n:
        yield n


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, net):
    c = HostsCluster(tmp_path_factory.mktemp("multihost"), net)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def nodes(cluster) -> dict[str, dict]:
    return {n["name"]: n for n in cluster.get("/api/v1/nodes/")["results"]}


def test_the_nodes_joined_from_their_own_hosts(cluster, net):
    got = nodes(cluster)
    assert {n: (got[n]["status"], got[n]["address"]) for n in PLACE} == {
        n: ("READY", net.address(h)) for n, h in PLACE.items()}
    # each agent really runs on its host: its network namespace is that host's
    for name, host in PLACE.items():
        ns_inode = os.stat(f"/run/netns/{net.namespace(host)}").st_ino
        assert os.stat(f"/proc/{cluster.procs[name].pid}/ns/net").st_ino == ns_inode


def test_a_two_node_job_rendezvous_across_hosts(cluster, net):
    job = cluster.submit(spec("across", 30, 10, resources={"nodes": 2, "procs_per_node": 1}))
    done = cluster.wait_status(job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    ranks = done["attempts"][-1]["ranks"]
    assert sorted(r["node"] for r in ranks) == ["node-a", "node-b"]
    assert done["step"] == 30 and len(cluster.metrics(job["id"])) >= 30


ROGUE = r"""
import json, sys, time
import redis
host, port = sys.argv[1], int(sys.argv[2])
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "accepted"
    except redis.AuthenticationError as e:
        out[name] = "auth: " + str(e)
    except redis.ResponseError as e:
        out[name] = "refused: " + str(e)
anon = redis.Redis(host=host, port=port, socket_timeout=5)
attempt("ping", anon.ping)
attempt("receive_tasks", lambda: anon.brpop(["node.node-a"], 1))
attempt("write_report", lambda: anon.lpush("control", "{}"))
attempt("write_telemetry", lambda: anon.xadd("trainyard:job:1:a1", {"type": "metric", "data": "[]"}))
attempt("guess_node_password", redis.Redis(host=host, port=port, username="node-a", password="guess").ping)
print(json.dumps(out))
"""


def test_a_host_without_credentials_can_neither_receive_tasks_nor_report(cluster, net):
    r = subprocess.run(net.exec_argv("rogue", [sys.executable, "-c", ROGUE, cluster.host, str(cluster.redis.port)]),
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"ping", "receive_tasks", "write_report", "write_telemetry", "guess_node_password"}
    for name, result in out.items():
        assert result.startswith("auth: "), (name, result)  # NOAUTH / WRONGPASS: nothing done
    # A host that has a node's Redis password but not its credential: its reports are signed with a
    # guess and refused, counted as a security event; the node's registered address is unchanged.
    forge = (
        "import sys, time\n"
        "from trainyard import nodeauth\n"
        "from trainyard.launch import HEARTBEAT_TASK, Heartbeat\n"
        "from workers.celery_app import app\n"
        "beat = Heartbeat(name='node-b', address=sys.argv[1], slots=64, agent_id='rogue').model_dump(mode='json')\n"
        "app.send_task(HEARTBEAT_TASK, args=[nodeauth.seal('0' * 64, 'node-b', HEARTBEAT_TASK, beat, time.time())],"
        " queue='control')\n")
    before = bad_signatures(cluster)
    env = dict(cluster.env, REDIS_URL=cluster.redis.user_url("node-b"), PYTHONPATH=str(REPO))
    r = subprocess.run(net.exec_argv("rogue", [sys.executable, "-c", forge, net.address("rogue")]),
                       capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr
    cluster.wait_for(lambda: bad_signatures(cluster) > before, 30, "the forged heartbeat refused")
    got = nodes(cluster)["node-b"]
    assert got["address"] == net.address("gpu-2") and got["slots"] == cluster.slots


def bad_signatures(cluster) -> float:
    import urllib.request

    req = urllib.request.Request(f"http://{cluster.host}:{cluster.port}/metrics",
                                 headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith('trainyard_security_events_total{kind="bad_signature"}')))


def test_a_partitioned_nodes_attempt_is_fenced(cluster, net):
    job_id, first, node = training_with_a_checkpoint(cluster, "partitioned")
    ckpt_dir = cluster.dir / "ckpt" / f"job-{job_id}"
    net.partition(PLACE[node])
    try:
        cluster.wait_for(lambda: node_status(cluster, node) == "LOST", 60, f"{node} written off")
        _, fenced_step = restarted_elsewhere(cluster, job_id, node, 180)
        # Behind the partition the stale rank trained on and kept checkpointing to the shared disk.
        cluster.wait_for(lambda: [d for d in ckpt_dir.glob(f"step-*-a{first['id']}")
                                  if int(d.name.split("-")[1]) > fenced_step], 120,
                         "a checkpoint the partitioned rank wrote after its fence")
        assert running(attempt_processes(first["id"]))
    finally:
        net.heal(PLACE[node])
    # Back on the network, the stale rank reads its fence first and exits; the node is READY again.
    cluster.wait_for(lambda: not running(attempt_processes(first["id"])), 120, "the fenced rank to exit")
    cluster.wait_for(lambda: node_status(cluster, node) == "READY", 120, f"{node} back")
    assert_nothing_after_the_fence_and_cancel(cluster, job_id, first["id"], fenced_step)
