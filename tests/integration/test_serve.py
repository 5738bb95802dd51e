"""controlplane.serve: several daphne workers on one socket (issue 15's load: one daphne process is
one core). Against real daphne processes: a stopped worker does not stop the service, a dead one is
started again, SIGTERM stops them all, SIGKILL of the launcher takes its workers with it, and a
crash loop ends the launcher with status 1 instead of retrying for ever."""
from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from controlplane import serve
from tests import postgres
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.procs


def env_for(tmp_path) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), DJANGO_SETTINGS_MODULE="controlplane.settings",
                TRAINYARD_VAR_DIR=str(tmp_path / "var"), **postgres.fresh_database_env(tmp_path / "db.sqlite3"),
                DJANGO_SECRET_KEY="integration-tests-only")


def get(port: int, timeout: float = 10) -> int:
    h = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        h.request("GET", "/accounts/login/", headers={"Host": "localhost"})
        r = h.getresponse()
        r.read()
        return r.status
    finally:
        h.close()


def launch(tmp_path, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(tmp_path / "serve.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "controlplane.serve", "-b", "127.0.0.1", "-p", str(port), *args],
                            cwd=REPO, env=env_for(tmp_path), stdout=log, stderr=subprocess.STDOUT)
    return proc, port


def workers(proc: subprocess.Popen) -> list[psutil.Process]:
    return [c for c in psutil.Process(proc.pid).children() if "daphne" in " ".join(c.cmdline())]


def wait_for(cond, timeout: float, what: str, tmp_path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = cond()
        except (OSError, psutil.Error):
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n" + (tmp_path / "serve.log").read_text()[-3000:])


def test_workers_share_the_socket_and_are_restarted_and_stopped(tmp_path):
    proc, port = launch(tmp_path, "--workers", "2", "--backoff", "0.2")
    try:
        wait_for(lambda: len(workers(proc)) == 2 and get(port, 2) == 200, 90, "two workers serving", tmp_path)
        first, second = workers(proc)
        for w in (first, second):
            assert "--fd" in w.cmdline()  # each serves the launcher's socket, not one of its own
        # A worker that cannot accept (stopped, as a worker stuck in a long request would be for new
        # connections) leaves the service up: the other one takes every connection.
        first.send_signal(signal.SIGSTOP)
        try:
            assert [get(port, 5) for _ in range(10)] == [200] * 10
        finally:
            first.send_signal(signal.SIGCONT)
        # A worker that dies is started again; the socket stays open meanwhile.
        second.kill()
        replacement = wait_for(lambda: [w for w in workers(proc) if w.pid not in (first.pid, second.pid)],
                               60, "the dead worker's replacement", tmp_path)[0]
        wait_for(lambda: get(port, 2) == 200, 60, "serving after the restart", tmp_path)
        assert "worker 1 (pid" in (tmp_path / "serve.log").read_text()
        # SIGTERM stops the workers, then the launcher (status 0), and frees the port.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not any(psutil.pid_exists(w.pid) and w.status() != psutil.STATUS_ZOMBIE for w in (first, replacement))
        with pytest.raises(OSError):
            get(port, 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_killing_the_launcher_takes_its_workers(tmp_path):
    proc, port = launch(tmp_path, "--workers", "1")
    try:
        wait_for(lambda: workers(proc) and get(port, 2) == 200, 90, "the worker serving", tmp_path)
        worker = workers(proc)[0]
        proc.kill()  # no chance to stop them itself: PR_SET_PDEATHSIG does
        proc.wait()
        psutil.wait_procs([worker], timeout=20)
        assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE
        with pytest.raises(OSError):
            get(port, 2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_crash_loop_stops_the_launcher(tmp_path):
    proc, _ = launch(tmp_path, "--workers", "1", "--backoff", "0.05", "--app", "controlplane.no_such_module:app")
    try:
        assert proc.wait(120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "serve.log").read_text()
    assert f"the {serve.GIVE_UP_AFTER}th quick exit in a row" in out, out[-2000:]


@pytest.mark.parametrize("argv,problem", [
    (["--workers", "0"], "--workers must be between 1 and 64"),
    (["-p", "8001", "--", "-p", "9000"], "the launcher owns the socket"),
    (["--fd", "3"], "the launcher owns the socket"),
])
def test_bad_arguments_are_refused(argv, problem, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.parse(argv)
    assert exc.value.code == 2 and problem in capsys.readouterr().err


def test_workers_default_from_the_environment(monkeypatch, capsys):
    assert serve.default_workers({"TRAINYARD_WEB_WORKERS": "3"}) == 3
    assert 1 <= serve.default_workers({}) <= 4
    monkeypatch.setenv("TRAINYARD_WEB_WORKERS", "many")
    with pytest.raises(SystemExit):
        serve.parse([])
    assert "TRAINYARD_WEB_WORKERS must be a whole number" in capsys.readouterr().err
