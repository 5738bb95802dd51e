"""Issue 16, section 1: Redis over TLS (rediss://), as docs/deploy.md sets it up across hosts: Redis
with no plaintext port, its ACL users, and a certificate from a CA of our own; every process of
make run's set (web, control worker, beat, relay, two agents, the ranks' telemetry) reaches it with
`rediss://user:password@host:port/0?ssl_cert_reqs=required&ssl_ca_certs=<ca>`. A 2-node job runs to
SUCCEEDED with its telemetry stored; a plaintext client and a client that does not trust the CA are
refused."""
from __future__ import annotations

import socket
import ssl

import pytest
import redis

from .cluster import Cluster
from .test_chaos import spec

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("tls"), redis_tls=True)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_every_process_reaches_redis_over_tls_and_a_job_succeeds(cluster):
    assert cluster.env["REDIS_URL"].startswith("rediss://")
    assert cluster.redis.user_url("node-a").startswith("rediss://")
    job = cluster.submit(spec("tls", 30, 10, resources={"nodes": 2, "procs_per_node": 1}))
    done = cluster.wait_status(job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    cluster.wait_for(lambda: len(cluster.metrics(job["id"])) >= 60, 60, "the telemetry, relayed over TLS")
    assert sorted(r["node"] for r in done["attempts"][-1]["ranks"]) == ["node-a", "node-b"]


def test_plaintext_and_untrusted_clients_are_refused(cluster):
    with socket.create_connection(("127.0.0.1", cluster.redis.port), timeout=5) as s:  # no TLS at all
        s.sendall(b"PING\r\n")
        try:
            reply = s.recv(64)
        except (ConnectionResetError, socket.timeout):
            reply = b""
        assert not reply.startswith((b"+PONG", b"-NOAUTH"))
    untrusted = cluster.env["REDIS_URL"].split("&ssl_ca_certs=")[0]  # the system CAs, not ours
    with pytest.raises(redis.ConnectionError) as exc:
        redis.Redis.from_url(untrusted, socket_timeout=5).ping()
    assert isinstance(exc.value.__context__, ssl.SSLError) or "certificate" in str(exc.value).lower()
