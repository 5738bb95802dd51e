"""The CLI never passes a job's (or the server's) control sequences to the user's terminal, and never
reads rich markup in them (issue 21, section 6): `logs` (and -f), `show`, `ls`, `watch`'s lines and
summary, and error messages that echo server text show ESC, the other C0/C1 controls and the bidi
overrides visibly (`\\x1b`), keep tabs and text, and print `[bold]`-style text literally."""
from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from tests.trainyard.cli.test_watch import JOB as WATCH_JOB
from tests.trainyard.cli.test_watch import env  # noqa: F401 (fixture)
from trainyard.cli.app import cli
from trainyard.cli.safe import clean

CLEAR = "\x1b[2J\x1b[H"                               # clear the screen, cursor home
TITLE = "\x1b]0;pwned\x07"                             # set the window title
CLIPBOARD = "\x1b]52;c;ZWNobyBoaQ==\x07"               # OSC 52: write the clipboard
LINK = "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\"  # OSC 8 hyperlink
C1_CSI = "\x9b31m"                                     # the 8-bit CSI
BIDI = "\u202eexe.txt"                                 # right-to-left override
HOSTILE = [f"step 1{CLEAR}", f"title{TITLE}", f"clip{CLIPBOARD}", f"see {LINK}", f"red{C1_CSI}",
           f"file {BIDI}", "tab\there", "back\rspace\x08\x7f", "[bold red]markup[/] :skull: ünïcödé ✓"]
# what must never reach the terminal: ESC, BEL, BS, CR, DEL, C1 controls, bidi overrides
RAW = set("\x1b\x07\x08\r\x7f\x9b\u202e")


def assert_safe(output: str) -> None:
    assert not RAW & set(output), [c for c in output if c in RAW]


def test_clean_shows_controls_and_keeps_text():
    assert clean(f"a{CLEAR}b") == "a\\x1b[2J\\x1b[Hb"
    assert clean(CLIPBOARD) == "\\x1b]52;c;ZWNobyBoaQ==\\x07"
    assert clean(C1_CSI) == "\\x9b31m" and clean(BIDI) == "\\u202eexe.txt"
    assert clean("tab\there ünïcödé ✓ [b]x[/b]") == "tab\there ünïcödé ✓ [b]x[/b]"
    assert clean("a\nb\x00c\x7f") == "a\\x0ab\\x00c\\x7f" and clean(42) == "42"


JOB = {"id": 7, "name": f"evil{TITLE}[blink]job[/]", "status": "FAILED", "status_reason": f"user_error{CLEAR}",
       "owner": "mallory", "step": 3, "total_steps": 40, "restarts": 0, "created_at": "2026-12-01T12:00:00+00:00",
       "spec": {"entrypoint": {"script": f"train.py{BIDI}"}},
       "attempts": [{"id": 3, "number": 1, "status": "FAILED", "outcome": "failed:user_error", "last_step": 3,
                     "ranks": [{"rank": 0, "node": "node-a"}],
                     "failure": {"class": "user_error", "message": f"Traceback{CLIPBOARD} [red]x[/red]"}}]}


class Fake(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, status: int, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        path = urllib.parse.urlsplit(self.path)
        if path.path == "/api/v1/jobs/7/logs/":
            q = dict(urllib.parse.parse_qsl(path.query))
            offset = int(q.get("offset", 0))
            page = HOSTILE[offset:offset + int(q.get("limit", 1000))]
            return self._send(200, {"job": 7, "attempt": 3, "rank": 0, "offset": offset, "total": len(HOSTILE),
                                    "next_offset": None, "lines": page, "dropped_lines": 0, "note": "",
                                    "attempts": [{"id": 3, "number": 1, "ranks": [0]}]})
        if path.path == "/api/v1/jobs/7/":
            return self._send(200, JOB)
        if path.path == "/api/v1/jobs/":
            return self._send(200, {"count": 1, "next": None, "previous": None, "results": [JOB]})
        return self._refuse()

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return self._refuse()

    def _refuse(self):
        return self._send(400, {"errors": {f"field{CLEAR}": [f"bad value{TITLE} [red]x[/red]"]}})


@pytest.fixture
def server(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TRAINYARD_TOKEN", "good")
    monkeypatch.setenv("COLUMNS", "250")  # rich tables: no cell cut short
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("TRAINYARD_URL", f"http://127.0.0.1:{httpd.server_port}")
    yield
    httpd.shutdown()
    httpd.server_close()


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_logs_show_control_sequences_instead_of_sending_them(server):
    result = run("logs", "7", "--rank", "0")
    assert result.exit_code == 0, result.output
    assert_safe(result.output)
    lines = result.stdout.splitlines()
    assert lines == [clean(line) for line in HOSTILE]
    assert lines[0] == "step 1\\x1b[2J\\x1b[H" and lines[6] == "tab\there"
    assert lines[-1] == "[bold red]markup[/] :skull: ünïcödé ✓"


def test_logs_follow_and_every_rank_are_cleaned_too(server, monkeypatch):
    monkeypatch.setattr("trainyard.cli.logs.POLL_S", 0.0)
    monkeypatch.setattr("trainyard.cli.logs.SETTLE_S", 0.0)
    for args in (["logs", "7", "-f"], ["logs", "7"]):
        result = run(*args)
        assert result.exit_code == 0, result.output
        assert_safe(result.output)
        assert result.stdout.splitlines()[0] == "[rank 0] step 1\\x1b[2J\\x1b[H"


def test_show_and_ls_print_names_and_failures_literally(server):
    for args in (["show", "7"], ["ls"]):
        result = run(*args)
        assert result.exit_code == 0, result.output
        assert_safe(result.output)
        assert "[blink]job[/]" in result.output and "\\x1b]0;pwned\\x07" in result.output
    show = run("show", "7").output
    assert "\\x1b]52;c;ZWNobyBoaQ==\\x07" in show and "[red]x[/red]" in show and "\\u202e" in show


def test_error_messages_that_echo_server_text_are_cleaned(server, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("name: x\n")
    result = run("submit", str(spec))
    assert result.exit_code == 2
    assert_safe(result.stderr)
    assert "field\\x1b[2J\\x1b[H: bad value\\x1b]0;pwned\\x07 [red]x[/red]" in result.stderr


def test_watch_prints_events_reasons_and_summary_literally(env):  # noqa: F811
    job = WATCH_JOB | {"name": f"w{TITLE}"}
    env(lambda n: [{"type": "snapshot", "job": job, "samples": [], "events": []},
                   {"type": "event", "event": {"id": 1, "kind": "note", "message": f"hello{CLEAR} [bold]x[/bold] :skull:"}},
                   {"type": "status", "status": "FAILED", "status_reason": f"boom{CLIPBOARD}[/]", "step": 2}])
    result = CliRunner().invoke(cli, ["watch", "5"])
    assert result.exit_code == 1, result.output
    assert_safe(result.output)
    assert "hello\\x1b[2J\\x1b[H [bold]x[/bold] :skull:" in result.output
    assert "boom\\x1b]52;c;ZWNobyBoaQ==\\x07[/]" in result.output and "w\\x1b]0;pwned\\x07" in result.output
