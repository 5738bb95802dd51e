"""The click app through CliRunner against a small fake HTTP server: output formats, one-line
errors and exit codes. (tests/integration/test_cli.py drives the real cluster.)"""
from __future__ import annotations

import gzip
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from trainyard.cli import config
from trainyard.cli.app import cli
from trainyard.cli.watch import JobState

COMMANDS = ["login", "submit", "ls", "show", "logs", "watch", "cancel", "checkpoints", "rollback", "nodes", "plan"]
JOB = {"id": 7, "name": "demo", "status": "QUEUED", "status_reason": "", "owner": "alice", "step": 0,
       "total_steps": 40, "restarts": 0, "created_at": "2026-12-01T12:00:00+00:00", "spec": {}, "attempts": []}


class Fake(BaseHTTPRequestHandler):
    seen: list = []

    def log_message(self, *a):
        pass

    def _send(self, status: int, body, content_type="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_GET(self):  # noqa: N802
        self.seen.append(("GET", self.path, self.headers.get("Authorization"), b""))
        if self.headers.get("Authorization") != "Token good":
            return self._send(401, {"errors": {"detail": ["Invalid token."]}})
        if self.path == "/api/v1/jobs/":
            return self._send(200, {"count": 1, "next": None, "previous": None, "results": [JOB]})
        if self.path == "/api/v1/nodes/":
            return self._send(200, {"count": 0, "next": None, "previous": None, "results": []})
        if self.path.startswith("/api/v1/jobs/7/logs/"):
            return self._logs(dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query)))
        if self.path == "/api/v1/jobs/7/":
            return self._send(200, JOB)
        return self._send(404, b"<html>Not Found</html>", "text/html")

    def _logs(self, q: dict):
        """The kept-logs API's shape: one attempt and rank per page, paged by line offset."""
        files = {(3, 0): ["hello", "again"], (3, 1): ["world"], (4, 0): ["restarted"]}
        attempt, rank = int(q.get("attempt", 4)), int(q.get("rank", 0))
        offset, limit = int(q.get("offset", 0)), int(q.get("limit", 1000))
        lines = files.get((attempt, rank), [])
        page = lines[offset:offset + limit]
        end = offset + len(page)
        return self._send(200, {"job": 7, "attempt": attempt, "rank": rank, "offset": offset, "limit": limit,
                                "total": len(lines), "next_offset": end if end < len(lines) else None,
                                "lines": page, "dropped_lines": 0, "note": "",
                                "attempts": [{"id": 3, "number": 1, "ranks": [0, 1]},
                                             {"id": 4, "number": 2, "ranks": [0]}]})

    def do_POST(self):  # noqa: N802
        body = self._body()
        self.seen.append(("POST", self.path, self.headers.get("Authorization"), body))
        if self.path == "/api/v1/auth/token/":
            creds = json.loads(body)
            if creds == {"username": "alice", "password": "pw-alice"}:
                return self._send(200, {"token": "good", "username": "alice", "is_staff": False})
            return self._send(400, {"errors": {"credentials": ["wrong username or password"]}})
        if self.headers.get("Authorization") != "Token good":
            return self._send(401, {"errors": {"detail": ["Invalid token."]}})
        if self.path == "/api/v1/code/":
            return self._send(201, {"bundle": "sha256:" + "ab" * 32, "bytes": len(body), "files": 1})
        if self.path == "/api/v1/jobs/":
            spec = json.loads(body)
            if spec.get("model", {}).get("kind") == "rnn":
                return self._send(400, {"errors": {"model.kind": ["Input should be 'gpt' or 'mlp'"]}})
            return self._send(201, JOB | {"spec": spec})
        if self.path == "/api/v1/jobs/7/rollback/":
            return self._send(403, {"errors": {"detail": ["only staff may roll a job back"]}})
        return self._send(404, b"<html>Not Found</html>", "text/html")


@pytest.fixture
def server():
    Fake.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TRAINYARD_URL", raising=False)
    monkeypatch.delenv("TRAINYARD_TOKEN", raising=False)
    monkeypatch.delenv("TRAINYARD_DEBUG", raising=False)


def run(*args, input=None):
    return CliRunner().invoke(cli, list(args), input=input)


def one_error_line(result, code=2) -> str:
    assert result.exit_code == code, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("command", [None] + COMMANDS)
def test_help_everywhere(command):
    result = run(*([command] if command else []), "--help")
    assert result.exit_code == 0 and "Usage: " in result.output


def test_login_with_password_then_commands(server, tmp_path, monkeypatch):
    result = run("login", server, input="alice\npw-alice\n")
    assert result.exit_code == 0, result.output
    assert f"logged in to {server} as alice" in result.output  # (CliRunner itself echoes the typed input)
    assert config.load() == config.Login(server, "good")
    result = run("ls")
    assert result.exit_code == 0 and "demo" in result.stdout and "QUEUED" in result.stdout
    assert json.loads(run("show", "7", "--json").stdout)["id"] == 7
    assert run("logs", "7").stdout == "[rank 0] restarted\n"  # the newest attempt by default
    assert run("logs", "7", "--attempt", "3").stdout == "[rank 0] hello\n[rank 0] again\n[rank 1] world\n"
    assert run("logs", "7", "--attempt", "3", "--rank", "1").stdout == "world\n"
    assert ("GET", "/api/v1/jobs/7/logs/?attempt=3&rank=1&offset=0&limit=5000", "Token good", b"") in Fake.seen
    monkeypatch.setattr("trainyard.cli.logs.PAGE", 1)  # one line a page: next_offset is followed
    assert run("logs", "7", "--attempt", "3").stdout == "[rank 0] hello\n[rank 0] again\n[rank 1] world\n"


def test_login_errors_are_one_line(server):
    assert one_error_line(run("login", server, input="alice\nnope\n")) == \
        "error: login: credentials: wrong username or password (HTTP 400)"
    assert one_error_line(run("login", server, "--token", "bad")) == \
        "error: login: the server refused the token (HTTP 401): run `trainyard login URL` again"
    assert one_error_line(run("login", "ftp://x")).startswith("error: the server URL must start with http")
    assert not config.config_path().exists()
    assert one_error_line(run("login", "http://127.0.0.1:1", "--token", "t")).startswith(
        "error: login: cannot reach http://127.0.0.1:1")
    assert one_error_line(run("login", server)) == "error: aborted"  # no input to prompt from


def test_not_logged_in(server):
    for args in (["ls"], ["show", "1"], ["watch", "1"], ["nodes"], ["logs", "1", "-f"]):
        assert one_error_line(run(*args)) == ("error: not logged in: run `trainyard login URL` or set "
                                              "TRAINYARD_URL and TRAINYARD_TOKEN")


def test_submit_with_code_uploads_and_sets_the_bundle(server, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_URL", server)
    monkeypatch.setenv("TRAINYARD_TOKEN", "good")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    (tmp_path / "job.yaml").write_text("name: mine\nentrypoint: {script: train.py}\n")
    result = run("submit", str(tmp_path / "job.yaml"), "--code", str(tmp_path / "code"))
    assert result.exit_code == 0, result.output
    assert result.stdout == "7\n" and "-> sha256:abab" in result.stderr
    (_, _, _, upload), (_, path, _, submitted) = [s[:4] for s in Fake.seen if s[0] == "POST"]
    assert b'name="file"; filename="code.tar.gz"' in upload
    gz = upload[upload.index(b"\x1f\x8b"):upload.rindex(b"\r\n--")]
    assert gzip.decompress(gz)[:8] == b"train.py"
    assert json.loads(submitted) == {"name": "mine", "entrypoint": {"script": "train.py"},
                                     "code": {"bundle": "sha256:" + "ab" * 32}}
    result = run("submit", str(tmp_path / "job.yaml"), "--json")
    assert json.loads(result.stdout)["spec"] == {"name": "mine", "entrypoint": {"script": "train.py"}}


def test_submit_errors(server, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_URL", server)
    monkeypatch.setenv("TRAINYARD_TOKEN", "good")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {kind: rnn}\n")
    assert one_error_line(run("submit", str(bad))) == \
        "error: job refused: model.kind: Input should be 'gpt' or 'mlp' (HTTP 400)"
    bad.write_text("name: x\nmodel: {kind: [\n")
    assert one_error_line(run("submit", str(bad))).startswith(f"error: {bad} is not valid YAML at line 3")
    bad.write_text("a: &a [1, 2]\nname: x\nconfig: {b: *a}\n")  # issue 15: no alias is expanded
    assert one_error_line(run("submit", str(bad))).startswith(f"error: {bad}: YAML anchors and aliases")
    bad.write_text("name: x\nconfig: {when: 2026-12-01}\n")
    assert one_error_line(run("submit", str(bad))).startswith(f"error: {bad}: every value must be plain JSON data")
    bad.write_text("- a list\n")
    assert "a JobSpec is a YAML mapping" in one_error_line(run("submit", str(bad)))
    assert one_error_line(run("submit", str(tmp_path / "missing.yaml"))).startswith("error: cannot read")
    assert one_error_line(run("rollback", "7", "3")) == \
        "error: rollback of job 7: only staff may roll a job back (HTTP 403)"
    assert one_error_line(run("show", "8")) == ("error: job 8: HTTP 404 from GET /api/v1/jobs/8/ is not a "
                                                f"Trainyard API answer (is {server} a Trainyard server?)")
    assert one_error_line(run("show", "x")).startswith("error: Invalid value for 'ID': 'x' is not a valid integer")
    monkeypatch.setenv("TRAINYARD_TOKEN", "stale")
    assert one_error_line(run("ls")) == ("error: job list: the server refused the token (HTTP 401): "
                                         "run `trainyard login URL` again")
    assert not [s for s in Fake.seen if s[:2] == ("POST", "/api/v1/jobs/") and b"rnn" not in s[3]]


def test_job_state_folds_socket_messages():
    s = JobState(7)
    assert s.apply({"type": "snapshot", "job": JOB | {"status": "RUNNING"}, "events": [{"id": 1}],
                    "samples": [{"attempt": 3, "rank": 0, "step": 1, "loss": 4.0, "samples_per_s": 10.0}]}) \
        == ["job 7 (demo): RUNNING"]
    s.apply({"type": "telemetry", "samples": [
        {"attempt": 3, "rank": 0, "step": 2, "loss": 3.0, "samples_per_s": 10.0},
        {"attempt": 3, "rank": 1, "step": 2, "loss": 5.0, "samples_per_s": 12.0}]})
    assert (s.step, s.loss, s.samples_per_s) == (2, 4.0, 22.0)
    s.apply({"type": "telemetry", "samples": [{"attempt": 4, "rank": 0, "step": 1, "loss": 9.0}]})  # a restart
    assert (s.step, s.loss) == (1, 9.0)
    assert s.apply({"type": "event", "event": {"id": 1, "kind": "x", "message": "old"}}) == []
    assert s.apply({"type": "event", "event": {"id": 2, "kind": "restart", "message": "m"}}) == ["event restart: m"]
    assert s.apply({"type": "status", "status": "SUCCEEDED", "status_reason": ""}) == ["status RUNNING -> SUCCEEDED"]
    assert s.summary() == "job 7 SUCCEEDED, step 1/40, loss 9"
