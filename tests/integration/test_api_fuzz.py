"""Property-based fuzzing of the REST API from its own OpenAPI schema (schemathesis), against a
real daphne serving the control plane on a free port, as staff (every operation reachable).

Zero 5xx responses (`not_a_server_error`) and every response body matching the schema's
documented shape for its status (`response_schema_conformance`), over the coverage, fuzzing and
stateful phases with a fixed seed, bounded by --max-time. A failure prints schemathesis's report,
which includes a curl command that reproduces each failing request.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .cluster import Cluster

pytestmark = pytest.mark.procs

FUZZ_S = 45  # the coverage phase (every operation, boundary values) finishes first; the rest is fuzzing


class WebOnly(Cluster):
    """Redis, the database and daphne: what the API needs to answer (no workers, no agents)."""

    def commands(self) -> dict[str, list[str]]:
        return {"web": super().commands()["web"]}

    def start(self) -> "WebOnly":
        self.redis.start()
        self.env["REDIS_URL"] = self.redis.url
        self.env.update(FUZZ_ENV)
        for d in ("var", "data", "agents", "ckpt"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        node = ("from jobs import services\nfrom trainyard.launch import Heartbeat\n"
                "for n in ('a', 'b'): services.node_add('node-' + n, slots=2, "
                "address='127.0.0.1'); services.node_heartbeat(Heartbeat(name='node-' + n, "
                "address='127.0.0.1', slots=2, labels={}, cpu_percent=1.0, mem_percent=2.0))")
        for args in (["migrate", "--noinput", "-v", "0"], ["ensure_admin"], ["shell", "-c", node]):
            subprocess.run([sys.executable, "manage.py", *args], cwd=self._repo, env=self.env, check=True,
                           capture_output=True)
        self.token = subprocess.run([sys.executable, "manage.py", "api_token", "admin"], cwd=self._repo,
                                    env=self.env, check=True, capture_output=True, text=True).stdout.strip().split()[-1]
        self.start_proc("web")
        self.wait_web()
        return self

    @property
    def _repo(self) -> Path:
        from tests.conftest import REPO
        return REPO


# The fuzzer sends thousands of requests a minute as one user: the abuse limits are not under test
# here (tests/jobs/test_limits.py is), so they are raised out of its way.
FUZZ_ENV = {"TRAINYARD_THROTTLE_USER": "100000/min", "TRAINYARD_THROTTLE_ANON": "100000/min",
            "TRAINYARD_THROTTLE_SUBMIT": "100000/min", "TRAINYARD_MAX_QUEUED_JOBS_PER_USER": "100000"}


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    c = WebOnly(tmp_path_factory.mktemp("fuzz"))
    try:
        c.start()
        status, job = c.request("POST", "/api/v1/jobs/", {"name": "fuzz-seed"})  # something to link to
        assert status == 201, job
        yield c
    finally:
        c.stop()


def test_no_request_the_schema_allows_gets_a_5xx_or_an_undocumented_body(web):
    st = Path(sys.executable).parent / "st"
    argv = [str(st), "run", f"http://127.0.0.1:{web.port}/api/schema/",
            "-H", f"Authorization: Token {web.token}",
            "--checks", "not_a_server_error,response_schema_conformance",
            "--phases", "coverage,fuzzing,stateful", "-n", "10", "--seed", "1", "--workers", "1",
            "--max-time", str(FUZZ_S), "--request-timeout", "20", "--no-color"]
    proc = subprocess.run(argv, cwd=web.dir, capture_output=True, text=True, timeout=FUZZ_S + 120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-12000:] + "\n" + web.logs(40)
    m = re.search(r"(\d+) generated, (\d+) passed", out)
    assert m and int(m.group(1)) >= 300 and m.group(1) == m.group(2), out[-4000:]
    print(m.group(0))
