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


# ---------------------------------------------------------------- what the terminal shows (issue 22 s6)

CELERY_TICK = "INFO celery.app.trace: Task jobs.tasks.schedule_tick[0b5f] succeeded in 0.01s: {'errors': 0}"


def test_the_terminal_filter_keeps_what_a_person_acts_on():
    """Beat's ticks (four lines every 2 s on an idle cluster) scrolled the URL away at once."""
    show = _module().TerminalFilter()
    hidden = [CELERY_TICK, "INFO celery.worker.strategy: Task jobs.tasks.nodes_check[1c2d] received",
              "INFO celery.beat: Scheduler: Sending due task schedule-tick (jobs.tasks.schedule_tick)",
              " -------------- control@vm v5.7.0 (collider)", "  . jobs.tasks.attempts_check",
              "2026-12-02 21:42:58,905 node-a INFO job sandbox: bubblewrap, uids from 200000000",
              "23025:M 02 Dec 2026 21:42:56.548 * Ready to accept connections",
              "INFO daphne.server: Listening on TCP address 127.0.0.1:8000", ""]
    assert [show(line) for line in hidden] == [None] * len(hidden)
    shown = ["WARNING jobs.tasks: refused periodic task x delivered from queue 'control'",
             "ERROR celery.app.trace: Task jobs.tasks.schedule_tick[1] raised unexpected: OperationalError('locked')",
             "CRITICAL django: out of disk", "2026-12-02 21:42:58,905 node-b ERROR cannot reach Redis",
             "23025:M 02 Dec 2026 21:42:56.548 # WARNING Memory overcommit must be enabled!",
             "/x/celery/platforms.py:893: SecurityWarning: You're running the worker with superuser privileges",
             "serve[23027]: worker 1 (pid 23044) exited with 1 after 0.4 s; restarting in 2 s"]
    assert [show(line) for line in shown] == shown
    # the job and node events without their logger's prefix
    assert show("INFO trainyard.lifecycle: job 4 'mnist' succeeded: finished 100 steps") == \
        "job 4 'mnist' succeeded: finished 100 steps"
    assert show("trainyard.lifecycle: node node-b is back (READY)") == "node node-b is back (READY)"
    # a traceback whole, from its first line to the exception line, and nothing after it
    tb = ["Traceback (most recent call last):", '  File "/x/relay.py", line 3, in run', "    x()",
          "    ^^^", "RuntimeError: relay broke"]
    assert [show(line) for line in [*tb, "INFO jobs: fine again"]] == [*tb, None]


def test_a_log_file_is_private_never_followed_and_rotated_at_its_cap(tmp_path):
    mod = _module()
    path = tmp_path / "web.log"
    path.write_text("an older run\n")
    path.chmod(0o644)  # left readable by an older version: tightened
    f = mod.LogFile(path, max_bytes=1000)
    assert path.stat().st_mode & 0o777 == 0o600
    for i in range(100):
        f.write(f"line {i:03d} " + "x" * 40)
    f.close()
    old = path.with_name("web.log.1")
    assert path.stat().st_size <= 1000 and old.stat().st_size <= 1000 and old.stat().st_mode & 0o777 == 0o600
    assert not path.with_name("web.log.2").exists()  # one previous file kept: at most twice the cap on disk
    assert "line 099" in path.read_text() and re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d line ", path.read_text())
    link = tmp_path / "node-a.log"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        mod.LogFile(link, max_bytes=1000)
    assert not (tmp_path / "elsewhere").exists()


def _supervise(tmp_path, procfile: str, *args: str, secs: float = 2.5) -> str:
    (tmp_path / "Procfile").write_text(procfile)
    sup = subprocess.Popen([sys.executable, str(SCRIPT), "--procfile", "Procfile", "--backoff-initial", "0.3",
                            "--grace", "2", *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        time.sleep(secs)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(15) == 0
    finally:
        if sup.poll() is None:
            sup.kill()
    return sup.stdout.read()


NOISY = ("control: python3 -c \"import sys, time; print(sys.argv[1], flush=True); "
         "print('WARNING jobs.tasks: the queue is late', flush=True); "
         "print('INFO trainyard.lifecycle: job 4 \\'mnist\\' failed: boom', flush=True); time.sleep(0.3); sys.exit(3)\" "
         f"\"{CELERY_TICK}\"\n"
         "beat: python3 -c \"import time; [print('INFO celery.beat: Scheduler: Sending due task', i, flush=True) "
         "for i in range(20)]; time.sleep(600)\"\n")


@pytest.mark.procs
def test_with_a_log_dir_the_terminal_shows_warnings_events_and_restarts_and_each_file_holds_everything(tmp_path):
    out = _supervise(tmp_path, NOISY, "--log-dir", "var/log")
    log_dir = tmp_path / "var" / "log"
    assert log_dir.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in log_dir.iterdir()) == ["beat.log", "control.log"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in log_dir.iterdir())
    # the terminal: the warning, the job's event, the exits and restarts; not the tick lines
    assert "Task jobs.tasks.schedule_tick" not in out and "Sending due task" not in out, out
    assert re.search(r"control +\| WARNING jobs.tasks: the queue is late", out), out
    assert re.search(r"control +\| job 4 'mnist' failed: boom", out), out
    assert re.search(r"control +\| exited with code 3 after [\d.]+ s; restart #1 in 0.3 s", out), out
    assert re.search(r"beat +\| started \(pid \d+\)", out) and re.search(r"beat +\| stopped \(killed by SIGTERM\)", out)
    # each file: every line of its process, and the supervisor's lines about it
    control, beat = (log_dir / "control.log").read_text(), (log_dir / "beat.log").read_text()
    assert control.count(CELERY_TICK) >= 2 and control.count("WARNING jobs.tasks: the queue is late") >= 2, control
    assert re.search(r"supervise: exited with code 3 after [\d.]+ s; restart #1 in 0.3 s", control), control
    assert "Sending due task 19" in beat and "supervise: started (pid" in beat and "Sending due task" not in control
    # a second run appends to the same files
    _supervise(tmp_path, NOISY, "--log-dir", "var/log", secs=1.0)
    assert (log_dir / "beat.log").read_text().count("supervise: started (pid") == 2


@pytest.mark.procs
def test_verbose_or_no_log_dir_streams_every_line_as_before(tmp_path):
    out = _supervise(tmp_path, NOISY, "--log-dir", "var/log", "--verbose", secs=2.0)
    assert "Task jobs.tasks.schedule_tick[0b5f] succeeded" in out and "Sending due task 19" in out, out
    assert "INFO trainyard.lifecycle: job 4" in out  # verbatim, as the file has it
    assert "Sending due task 19" in (tmp_path / "var" / "log" / "beat.log").read_text()
    out = _supervise(tmp_path, NOISY, secs=2.0)  # no file to keep them in: shown
    assert "Task jobs.tasks.schedule_tick[0b5f] succeeded" in out and "Sending due task 19" in out, out


def test_bad_log_options_are_refused_clearly(tmp_path, capsys):
    mod = _module()
    (tmp_path / "Procfile").write_text("a: sleep 1\n")
    (tmp_path / "afile").write_text("")
    for argv, msg in ((["--log-max-bytes", "100"], "--log-max-bytes must be at least 4096"),
                      (["--log-dir", str(tmp_path / "afile")], "--log-dir: .*afile")):
        with pytest.raises(SystemExit):
            mod.main(["--procfile", str(tmp_path / "Procfile"), *argv])
        assert re.search(msg, capsys.readouterr().err)


def test_the_control_planes_log_lines_carry_their_level_with_trainyard_log_format_levels(tmp_path):
    """What make run sets (scripts/run.sh) so that the supervisor can tell a warning from the rest."""
    code = "import django, logging; django.setup(); logging.getLogger('jobs.tasks').warning('the queue is late')"

    def run(fmt):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "TRAINYARD_"))}
        env |= {"DJANGO_SETTINGS_MODULE": "controlplane.settings", "TRAINYARD_VAR_DIR": str(tmp_path / "var"),
                **({"TRAINYARD_LOG_FORMAT": fmt} if fmt else {})}
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=60)

    for fmt, line in ((None, "the queue is late"), ("levels", "WARNING jobs.tasks: the queue is late")):
        out = run(fmt)
        assert out.returncode == 0 and out.stderr.splitlines()[-1] == line, out.stderr
    out = run("json")
    assert out.returncode != 0 and "TRAINYARD_LOG_FORMAT must be one of plain, levels, not 'json'" in out.stderr


def test_make_runs_verbose_switch_takes_1_or_0_and_refuses_anything_else_before_starting(tmp_path):
    env = dict(os.environ, TRAINYARD_VAR_DIR=str(tmp_path / "var"), TRAINYARD_RUN_VERBOSE="yes")
    out = subprocess.run(["bash", str(REPO / "scripts" / "run.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "TRAINYARD_RUN_VERBOSE must be 1 (every line on the terminal) or 0, not 'yes'" \
        in out.stderr, out.stderr
    assert not (tmp_path / "var").exists()
    text = (REPO / "scripts" / "run.sh").read_text()  # and what it hands the supervisor
    assert '--log-dir "$LOG_DIR" "${verbose[@]}"' in text and 'LOG_DIR="$TRAINYARD_VAR_DIR/log"' in text
