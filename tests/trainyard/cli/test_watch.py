"""`watch` against a small websocket server speaking the job socket's protocol: acks, the progress
summary, exit codes 0/1, the 4401/4404 closes and a reconnect after a drop. (The real socket is
driven by tests/integration/test_cli.py.)"""
from __future__ import annotations

import json
import threading

import pytest
from click.testing import CliRunner
from websockets.sync.server import serve

from trainyard.cli.app import cli

JOB = {"id": 5, "name": "w", "status": "RUNNING", "status_reason": "", "step": 0, "total_steps": 4}


def sample(step, rank, attempt=9):
    return {"attempt": attempt, "rank": rank, "step": step, "loss": 2.0 + rank, "samples_per_s": 5.0}


class Socket:
    def __init__(self, script):
        self.script, self.acks, self.headers, self.connections = script, [], [], 0
        self.done = threading.Event()  # set when a connection's script has run
        self.server = serve(self.handler, "127.0.0.1", 0, process_request=self.rest)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.socket.getsockname()[1]

    def rest(self, connection, request):
        """GET /api/v1/jobs/5/ (what the CLI reads after a drop) on the same port; sockets pass."""
        if request.headers.get("Upgrade") is None:
            self.rest_reads += 1
            return connection.respond(200, json.dumps(JOB))
        return None

    rest_reads = 0

    def handler(self, ws):
        self.connections += 1
        self.headers.append({k: ws.request.headers.get(k) for k in ("Authorization", "Origin")})
        try:
            for seq, msg in enumerate(self.script(self.connections), 1):
                if isinstance(msg, int):
                    return ws.close(msg)
                ws.send(json.dumps({**msg, "seq": seq}))
                self.acks.append(json.loads(ws.recv(timeout=5)))
        finally:
            self.done.set()


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("TRAINYARD_TOKEN", "tok")

    def start(script):
        sock = Socket(script)
        monkeypatch.setenv("TRAINYARD_URL", f"http://127.0.0.1:{sock.port}")
        return sock
    yield start


def test_succeeded_exits_0_and_acks_everything(env):
    sock = env(lambda n: [{"type": "snapshot", "job": JOB, "samples": [sample(1, 0)], "events": []},
                          {"type": "telemetry", "samples": [sample(4, 0), sample(4, 1)]},
                          {"type": "status", "status": "SUCCEEDED", "status_reason": "", "step": 4}])
    result = CliRunner().invoke(cli, ["watch", "5"])
    assert result.exit_code == 0, result.output
    assert "job 5 (w): RUNNING" in result.output and "status RUNNING -> SUCCEEDED" in result.output
    assert result.output.rstrip().endswith("job 5 SUCCEEDED, step 4/4, loss 2.5")
    assert sock.done.wait(5)
    assert sock.acks == [{"type": "ack", "seq": s} for s in (1, 2, 3)]
    assert sock.headers == [{"Authorization": "Token tok", "Origin": None}]


def test_failed_exits_1_after_a_reconnect(env):
    def script(n):
        if n == 1:
            return [{"type": "snapshot", "job": JOB, "samples": [], "events": []}, 1011]  # dropped
        return [{"type": "snapshot", "job": JOB | {"step": 2}, "samples": [], "events": []},
                {"type": "status", "status": "FAILED", "status_reason": "user_error: boom", "step": 2}]

    sock = env(script)
    result = CliRunner().invoke(cli, ["watch", "5"])
    assert result.exit_code == 1, result.output
    assert (sock.connections, sock.rest_reads) == (2, 1)  # the job was still RUNNING: the socket reopened
    assert result.output.rstrip().endswith("job 5 FAILED, step 2/4, user_error: boom")


@pytest.mark.parametrize("code, message", [
    (4401, "error: the server refused the token on the job socket: run `trainyard login URL` again"),
    (4404, "error: job 5 not found (or not visible to you)")])
def test_refusals_are_one_line(env, code, message):
    env(lambda n: [code])
    result = CliRunner().invoke(cli, ["watch", "5"])
    assert result.exit_code == 2 and result.stderr.strip() == message
