"""scripts/supervise.py, `make run`'s process manager: a process that exits is restarted with a
capped exponential backoff (reset once it ran stably) while the others keep running, every exit is
logged with its code or signal, the state is kept in a 0600 JSON file, and SIGTERM stops everything.
honcho, which ran `make run` before, stopped every process when any one exited."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "supervise.py"


def _module():
    spec = importlib.util.spec_from_file_location("supervise", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["supervise"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_backoff_doubles_caps_and_resets_after_a_stable_run():
    b = _module().Backoff(initial=1.0, maximum=8.0, stable=30.0)
    assert [b.after_exit(0.5) for _ in range(6)] == [1, 2, 4, 8, 8, 8]  # a crash loop is still retried
    assert b.after_exit(31.0) == 1 and b.after_exit(0.1) == 2


def test_procfile_is_split_like_a_shell_and_expands_variables_without_one():
    mod = _module()
    procs = mod.parse_procfile('# comment\nredis: redis-server --port ${PORT} --save ""\nweb: run $PORT "a b"\n',
                               {"PORT": "6390"})
    assert procs == {"redis": ["redis-server", "--port", "6390", "--save", ""], "web": ["run", "6390", "a b"]}
    # a value is one word, never re-split or run through a shell
    assert mod.parse_procfile("x: echo ${V}\n", {"V": "a; rm -rf /"}) == {"x": ["echo", "a; rm -rf /"]}
    for text, msg in (("x: echo ${NOPE}\n", r"line 1 \(x\): \$NOPE is not set"),
                      ("no colon here\n", "expected 'name: command'"), ("x: a\nx: b\n", "defined twice"),
                      ("", "names no process")):
        with pytest.raises(ValueError, match=msg):
            mod.parse_procfile(text, {})


@pytest.mark.procs
def test_a_procfile_line_may_set_its_process_environment_as_a_shell_would(tmp_path):
    """make run's agents start as `REDIS_URL=<the node's ACL user URL> python -m workers.agent ...`."""
    mod = _module()
    procs = mod.parse_procfile("a: REDIS_URL=${U} X=1 python3 -c pass\n", {"U": "redis://node-a:pw@h/0"})
    assert procs == {"a": ["env", "REDIS_URL=redis://node-a:pw@h/0", "X=1", "python3", "-c", "pass"]}
    out = subprocess.run(mod.parse_procfile("a: GREETING=hi python3 -c 'import os; print(os.environ[\"GREETING\"])'\n",
                                            {})["a"], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "hi"


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())["processes"]
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@pytest.mark.procs
def test_a_killed_process_is_restarted_with_backoff_and_sigterm_stops_all(tmp_path):
    procfile = tmp_path / "Procfile"
    procfile.write_text(
        "steady: python3 -c \"import time; print('steady up', flush=True); time.sleep(600)\"\n"
        "victim: sleep 600\n"
        "flaky: sh -c \"exit 3\"\n")
    status = tmp_path / "var" / "supervisor.json"
    status.parent.mkdir()
    sup = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--procfile", str(procfile), "--status-file", str(status),
         "--backoff-initial", "0.2", "--backoff-max", "0.8", "--stable-after", "30", "--grace", "5"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = _wait(lambda: (s := _status(status)) and all(s[n]["pid"] for n in ("steady", "victim")) and s,
                      10, "steady and victim to start")
        assert status.stat().st_mode & 0o777 == 0o600
        os.kill(first["victim"]["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        again = _wait(lambda: (s := _status(status))["victim"]["pid"] not in (None, first["victim"]["pid"]) and s,
                      5, "victim to be restarted")
        assert time.monotonic() - killed_at >= 0.15  # after the backoff, not at once
        assert again["victim"]["restarts"] == 1 and again["victim"]["last_exit"]["signal"] == "SIGKILL"
        assert again["steady"]["pid"] == first["steady"]["pid"] and again["steady"]["restarts"] == 0
        assert psutil.pid_exists(first["steady"]["pid"])
        # the crash-looping one keeps being retried, each wait doubling up to the cap
        _wait(lambda: _status(status)["flaky"]["restarts"] >= 5, 10, "flaky to be retried 5 times")
        children = [p.pid for p in psutil.Process(sup.pid).children(recursive=True)]
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(15) == 0
    finally:
        if sup.poll() is None:
            sup.kill()
    out = sup.stdout.read()
    assert re.search(r"victim +\| killed by SIGKILL after [\d.]+ s; restart #1 in 0.2 s", out), out
    delays = [float(d) for d in re.findall(r"flaky +\| exited with code 3 after [\d.]+ s; restart #\d+ in ([\d.]+) s",
                                           out)]
    assert delays[:5] == [0.2, 0.4, 0.8, 0.8, 0.8], out
    assert "steady up" in out and "stopping every process" in out
    assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not status.exists()


@pytest.mark.procs
def test_a_stable_process_restarts_after_the_initial_delay_the_store_stops_last_a_stubborn_one_is_killed(tmp_path):
    procfile = tmp_path / "Procfile"
    procfile.write_text("store: python3 -c \"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: "
                        "(print('store got SIGTERM', flush=True), sys.exit(0))); time.sleep(600)\"\n"
                        "steady: sh -c \"sleep 0.4; exit 1\"\n"
                        "app: python3 -c \"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: "
                        "(time.sleep(0.5), print('app stopped', flush=True), sys.exit(0))); time.sleep(600)\"\n"
                        "stubborn: python3 -c \"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                        "time.sleep(600)\"\n")
    sup = subprocess.Popen([sys.executable, str(SCRIPT), "--procfile", str(procfile), "--backoff-initial", "0.1",
                            "--backoff-max", "5", "--stable-after", "0.3", "--stop-last", "store", "--grace", "1"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(2.5)
    sup.send_signal(signal.SIGINT)
    assert sup.wait(15) == 0
    out = sup.stdout.read()
    delays = re.findall(r"steady +\| exited with code 1 after [\d.]+ s; restart #\d+ in ([\d.]+) s", out)
    assert len(delays) >= 3 and set(delays) == {"0.1"}, out  # each run was "stable": no doubling
    assert out.index("app stopped") < out.index("store got SIGTERM"), out
    assert "stubborn   | still running 1 s after SIGTERM: SIGKILL" in out
    assert "stubborn   | stopped (killed by SIGKILL)" in out
