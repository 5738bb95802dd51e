"""Issue 15: a slow-loris client cannot hold the web server's sockets. Against a real daphne: clients
that open a websocket upgrade and send its headers one byte at a time (each byte resetting
Twisted's idle timeout, 12 h) are dropped at TRAINYARD_HTTP_HEADER_TIMEOUT_S, while an ordinary
request is served meanwhile."""
from __future__ import annotations

import http.client
import os
import socket
import time

import pytest

from tests import postgres
from tests.conftest import REPO
from tests.integration.cluster import start_daphne

pytestmark = pytest.mark.procs

DEADLINE_S = 1.5
CLIENTS = 20


@pytest.fixture
def web(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), DJANGO_SETTINGS_MODULE="controlplane.settings",
               TRAINYARD_VAR_DIR=str(tmp_path / "var"), **postgres.fresh_database_env(tmp_path / "db.sqlite3"),
               DJANGO_SECRET_KEY="integration-tests-only", TRAINYARD_HTTP_HEADER_TIMEOUT_S=str(DEADLINE_S))
    proc, port = start_daphne(env, tmp_path, probe="/api/v1/jobs/")
    yield port
    proc.terminate()
    proc.wait(20)


def test_slow_websocket_handshakes_are_dropped_and_others_served(web):
    request = (b"GET /ws/cluster/ HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nX-Slow: ")
    slow = []
    for _ in range(CLIENTS):
        s = socket.create_connection(("127.0.0.1", web), timeout=5)
        s.sendall(request)
        slow.append(s)
    opened = time.monotonic()
    closed_at: dict[int, float] = {}
    while len(closed_at) < CLIENTS and time.monotonic() - opened < DEADLINE_S + 6:
        for i, s in enumerate(slow):
            if i in closed_at:
                continue
            try:
                s.sendall(b"a")  # one more header byte: the line never ends
                s.settimeout(0.01)
                if s.recv(1) == b"":
                    closed_at[i] = time.monotonic() - opened
            except socket.timeout:
                pass
            except OSError:  # reset by the server
                closed_at[i] = time.monotonic() - opened
        time.sleep(0.2)
        # an ordinary client is served meanwhile
        conn = http.client.HTTPConnection("127.0.0.1", web, timeout=5)
        conn.request("GET", "/api/v1/jobs/")
        assert conn.getresponse().status == 401
    for s in slow:
        s.close()
    assert len(closed_at) == CLIENTS, f"{CLIENTS - len(closed_at)} slow clients still connected"
    assert max(closed_at.values()) < DEADLINE_S + 3, closed_at
