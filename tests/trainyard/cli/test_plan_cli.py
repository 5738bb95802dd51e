"""`trainyard plan FILE|-` through CliRunner against a small HTTP server whose /api/v1/plan/
answers with the real planner (trainyard.plan.search.plan_dict, with the default constants: the
server's calibration lookup is tested in tests/jobs) and its 400 for bad input."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from trainyard.plan.search import plan_dict
from trainyard.plan import PlanInputError
from trainyard.cli.app import cli

REQUEST = {"model": {"layers": 8, "hidden": 4096, "heads": 32, "seq_len": 2048, "vocab": 32000},
           "cluster": {"nodes": 2, "devices_per_node": 8, "device": {"name": "A100-80GB", "memory_gb": 80,
                                                                      "peak_tflops": 312},
                       "intra_node_gbs": 300, "inter_node_gbs": 25},
           "global_batch": 64}


class Planner(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        if self.headers.get("Authorization") != "Token good":
            status, out = 401, {"errors": {"detail": ["Invalid token."]}}
        elif self.path != "/api/v1/plan/":
            status, out = 404, {"errors": {"detail": ["Not found."]}}
        else:
            try:
                status, out = 200, plan_dict(body)
            except PlanInputError as exc:
                status, out = 400, {"errors": exc.errors}
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server(monkeypatch, tmp_path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Planner)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TRAINYARD_URL", f"http://127.0.0.1:{httpd.server_port}")
    monkeypatch.setenv("TRAINYARD_TOKEN", "good")
    monkeypatch.delenv("TRAINYARD_DEBUG", raising=False)
    yield
    httpd.shutdown()
    httpd.server_close()


def test_plan_table_from_a_file_and_json_from_stdin(server, tmp_path):
    path = tmp_path / "req.json"
    path.write_text(json.dumps(REQUEST))
    r = CliRunner().invoke(cli, ["plan", str(path), "--top", "3"])
    assert r.exit_code == 0, r.output
    assert "LAYOUT" in r.stdout and "best: " in r.stdout and "(3 shown)" in r.stdout and "rejected" in r.stdout
    r = CliRunner().invoke(cli, ["plan", "-", "--json"], input=json.dumps(REQUEST))
    assert r.exit_code == 0 and json.loads(r.stdout) == plan_dict(REQUEST)


def test_plan_bad_input_is_one_line_naming_the_field(server, tmp_path):
    bad = {**REQUEST, "model": {**REQUEST["model"], "heads": 6}}
    r = CliRunner().invoke(cli, ["plan", "-"], input=json.dumps(bad))
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == ["error: plan: model.heads: 6 heads do not divide hidden 4096 (HTTP 400)"]
    r = CliRunner().invoke(cli, ["plan", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and "cannot read" in r.stderr
    r = CliRunner().invoke(cli, ["plan", "-"], input="[1, 2]")
    assert r.exit_code == 2 and "a plan request is an object" in r.stderr


def test_plan_that_fits_nowhere_names_the_nearest_miss(server):
    huge = {**REQUEST, "model": {**REQUEST["model"], "layers": 2000, "hidden": 16384, "heads": 128}}
    r = CliRunner().invoke(cli, ["plan", "-"], input=json.dumps(huge))
    assert r.exit_code == 0 and "no plan fits: nearest miss" in r.stdout and "GB > 80 GB" in r.stdout
