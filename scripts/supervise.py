#!/usr/bin/env python3
"""`make run`'s process manager: runs every line of a Procfile and restarts what exits.

honcho (which ran `make run` before) stops everything when any one process exits; the node
agents then stop all the training they run. Here a process that exits (crash, SIGKILL, even exit 0)
is started again after a backoff: INITIAL s, doubled after each exit that came sooner than
STABLE s after its start, capped at MAX s (a process that crash-loops is still retried, every MAX s);
once a process has run STABLE s, its next restart waits INITIAL s again. Every exit is logged with
its code or signal and the delay before the restart.

SIGTERM or SIGINT (Ctrl-C) stops everything: SIGTERM to every process's group except the --stop-last
ones (Redis: the agents report the attempts they stop through it), SIGKILL to what is left after
GRACE s, then the same for the --stop-last ones. A second SIGTERM/SIGINT kills at once.

With --status-file, the state of every process (pid, running, restarts, last exit) is written there
as JSON each second and on every change (0600, replaced atomically); the web process reads it for
/metrics and the nodes page (jobs/fleet/liveness.py).

With --log-dir, each process's whole output goes to DIR/NAME.log (0600, appended, never through a
link; at --log-max-bytes it becomes NAME.log.1, replacing the one before, so a process holds at most
twice that on disk however often it or the supervisor restarts), with its starts and exits, and the
terminal shows only what a person acts on (TerminalFilter): the supervisor's own lines (starts,
exits, restarts, stops), warnings and errors, tracebacks, the `trainyard.lifecycle` logger's job and
node events and the web launcher's worker starts and exits. --verbose shows every line as well;
without --log-dir every line is shown (it is kept nowhere else). Only the standard library: no shell, a Procfile line
is split like a shell would (shlex) and ${VAR} / $VAR in each word are taken from the environment.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_OUT_LOCK = threading.Lock()
MAX_LINE = 64 * 1024  # a longer line (or output with no newline) is read, kept and shown in pieces


def log(name: str, text: str) -> None:
    """One prefixed line on stdout. A closed stdout (`make run | head`) is ignored: the readers must
    keep draining the children's pipes, or a child blocks on its next write."""
    with _OUT_LOCK:
        try:
            sys.stdout.write(f"{time.strftime('%H:%M:%S')} {name:<10} | {text}\n")
            sys.stdout.flush()
        except (OSError, ValueError):
            pass


# A line the terminal shows: a level of WARNING or worse (`WARNING name: ...` from the control plane
# with TRAINYARD_LOG_FORMAT=levels, the agents' `<time> node-a ERROR ...`, Redis's `# WARNING ...`),
# a Python warning or exception line (`...: SecurityWarning: ...`, `ValueError: ...`) and what
# controlplane.serve says about its daphne workers (`serve[pid]: worker 0 exited ...`).
_NOTABLE = re.compile(r"\b(?:WARNING|ERROR|CRITICAL|FATAL)\b|\b[A-Z]\w*(?:Warning|Error|Exception):|^serve\[\d+\]: ")
_TRACEBACK = "Traceback (most recent call last):"
# Job and node lifecycle (jobs/attempts/services/events.py, jobs/fleet/services/nodes.py), shown
# without the logger's prefix: `INFO trainyard.lifecycle: job 4 'mnist' succeeded: ...`.
_LIFECYCLE = re.compile(r"^(?:INFO )?trainyard\.lifecycle: ")


class TerminalFilter:
    """Which of one process's output lines the terminal shows (all of them go to its log file):
    `__call__` returns the text to show, or None. A traceback is shown whole, from its first line
    to the exception line (the first one not indented after it). Stateful: one per process."""

    def __init__(self) -> None:
        self.in_traceback = False

    def __call__(self, line: str) -> str | None:
        if self.in_traceback:
            if not line[:1].isspace():
                self.in_traceback = line.startswith(_TRACEBACK)  # the exception line ends it
            return line
        if line.startswith(_TRACEBACK):
            self.in_traceback = True
            return line
        m = _LIFECYCLE.match(line)
        if m:
            return line[m.end():]
        return line if _NOTABLE.search(line) else None


class LogFile:
    """One process's whole output: DIR/NAME.log, appended, created 0600 and never opened through
    a link (one left readable by others is tightened). Each line is stamped with the date and time it
    was read. At max_bytes the file is renamed NAME.log.1 (replacing the one before) and begun
    again. A failing write (full disk) is reported once on the terminal; supervision goes on."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.lock = threading.Lock()
        self.broken = self.closed = False
        self.fd = self._open()

    def _open(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            self.size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        return fd

    def write(self, text: str) -> None:
        data = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n".encode(errors="replace")
        with self.lock:
            if self.closed:  # a reader still draining an orphan's pipe after the supervisor stopped
                return
            try:
                if self.size and self.size + len(data) > self.max_bytes:
                    os.close(self.fd)
                    self.fd = -1
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                    self.fd = self._open()
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view):]
                self.size += len(data)
                self.broken = False
            except OSError as e:
                if not self.broken:
                    self.broken = True
                    log("supervise", f"could not write {self.path}: {e} (its lines are lost until it works again)")
                if self.fd < 0:
                    try:
                        self.fd = self._open()
                    except OSError:
                        pass

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


def expand(word: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            raise ValueError(f"${name} is not set")
        return env[name]
    return _VAR.sub(sub, word)


def parse_procfile(text: str, env: dict[str, str]) -> dict[str, list[str]]:
    """{name: argv} in the file's order; a clear ValueError for a bad line or an unset variable."""
    procs: dict[str, list[str]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, command = line.partition(":")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not command.strip():
            raise ValueError(f"Procfile line {n}: expected 'name: command', got {line!r}")
        if name in procs:
            raise ValueError(f"Procfile line {n}: {name!r} is defined twice")
        try:
            argv = [expand(w, env) for w in shlex.split(command)]
        except ValueError as e:
            raise ValueError(f"Procfile line {n} ({name}): {e}") from None
        # Leading NAME=value words set that process's environment, as in a shell; env(1) applies
        # them, so the command still runs without a shell.
        if re.match(r"[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
            argv = ["env", *argv]
        procs[name] = argv
    if not procs:
        raise ValueError("the Procfile names no process")
    return procs


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass
class Backoff:
    """Delay before the next start: initial, doubled per quick exit, capped; reset once stable."""
    initial: float
    maximum: float
    stable: float
    quick_exits: int = 0

    def after_exit(self, ran_s: float) -> float:
        if ran_s >= self.stable:
            self.quick_exits = 0
        delay = min(self.maximum, self.initial * (2 ** self.quick_exits))
        self.quick_exits += 1
        return delay


@dataclass
class Child:
    name: str
    argv: list[str]
    backoff: Backoff
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    next_start: float | None = 0.0  # monotonic time of the next start; None while running or stopped
    last_exit: dict | None = None
    readers: list[threading.Thread] = field(default_factory=list)
    logfile: LogFile | None = None  # with --log-dir
    show_all: bool = True  # every output line on the terminal, not only what TerminalFilter passes

    def note(self, text: str) -> None:
        """The supervisor's own line about this process: on the terminal and in its log file."""
        log(self.name, text)
        if self.logfile is not None:
            self.logfile.write(f"supervise: {text}")

    def start(self) -> None:
        self.next_start = None
        self.started = time.monotonic()
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:  # a missing executable: counted as an exit, retried like one
            self.note(f"could not start {self.argv[0]!r}: {e}")
            self.proc = None
            self.exited(127)
            return
        self.note(f"started (pid {self.proc.pid})")
        t = threading.Thread(target=self._pump, args=(self.proc,), daemon=True)
        t.start()
        self.readers = [t]

    def _pump(self, proc: subprocess.Popen) -> None:
        shown = None if self.show_all else TerminalFilter()
        for raw in iter(lambda: proc.stdout.readline(MAX_LINE), b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if self.logfile is not None:
                self.logfile.write(line)
            text = line if shown is None else shown(line)
            if text is not None:
                log(self.name, text)
        proc.stdout.close()

    def exited(self, returncode: int) -> None:
        ran = time.monotonic() - self.started
        delay = self.backoff.after_exit(ran)
        self.last_exit = {"code": returncode if returncode >= 0 else None,
                          "signal": describe_exit(returncode).removeprefix("killed by ") if returncode < 0 else None,
                          "at": time.time(), "ran_s": round(ran, 3)}
        self.restarts += 1
        self.next_start = time.monotonic() + delay
        self.proc = None
        self.note(f"{describe_exit(returncode)} after {ran:.1f} s; restart #{self.restarts} in {delay:g} s")

    def signal_group(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def status(self) -> dict:
        now = time.monotonic()
        running = self.proc is not None and self.proc.poll() is None
        return {"pid": self.proc.pid if running else None, "running": running,
                "started_at": time.time() - (now - self.started) if running else None,
                "restarts": self.restarts, "last_exit": self.last_exit,
                "next_start_in_s": round(max(0.0, self.next_start - now), 3) if self.next_start is not None else None}


def write_status(path: Path | None, children: list[Child]) -> None:
    """The state file, created 0600 (never through a link) and renamed into place: a reader sees the
    old or the new document, never half of one. A failure is logged; supervision goes on."""
    if path is None:
        return
    doc = {"supervisor_pid": os.getpid(), "updated_at": time.time(),
           "processes": {c.name: c.status() for c in children}}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError as e:
        log("supervise", f"could not write {path}: {e}")


def open_logs(log_dir: Path, names: list[str], max_bytes: int) -> dict[str, LogFile]:
    """DIR (created 0700 if missing) and NAME.log for each process; an OSError names the file."""
    log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    files: dict[str, LogFile] = {}
    try:
        for name in names:
            path = log_dir / f"{name}.log"
            try:
                files[name] = LogFile(path, max_bytes)
            except OSError as e:
                raise OSError(f"cannot open {path}: {e.strerror or e}") from None
    except OSError:
        for f in files.values():
            f.close()
        raise
    return files


class Supervisor:
    def __init__(self, procs: dict[str, list[str]], args: argparse.Namespace,
                 logs: dict[str, LogFile] | None = None):
        logs = logs or {}
        self.children = [Child(name, argv, Backoff(args.backoff_initial, args.backoff_max, args.stable_after),
                               logfile=logs.get(name), show_all=args.verbose or name not in logs)
                         for name, argv in procs.items()]
        self.status_path = Path(args.status_file).resolve() if args.status_file else None
        self.grace = args.grace
        self.stop_last = set(args.stop_last or [])
        self.stop_requests = 0

    def request_stop(self, signum, _frame) -> None:
        self.stop_requests += 1
        if self.stop_requests > 1:  # a second Ctrl-C: no more waiting
            for c in self.children:
                c.signal_group(signal.SIGKILL)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        last_write = 0.0
        while not self.stop_requests:
            changed = False
            now = time.monotonic()
            for c in self.children:
                if c.proc is not None and c.proc.poll() is not None:
                    c.exited(c.proc.returncode)
                    changed = True
                if c.proc is None and c.next_start is not None and now >= c.next_start:
                    c.start()
                    changed = True
            if changed or now - last_write >= 1.0:
                write_status(self.status_path, self.children)
                last_write = now
            time.sleep(0.1)
        log("supervise", "stopping every process")
        self.stop([c for c in self.children if c.name not in self.stop_last])
        self.stop([c for c in self.children if c.name in self.stop_last])
        if self.status_path is not None:
            self.status_path.unlink(missing_ok=True)
        for c in self.children:
            for t in c.readers:
                t.join(timeout=0.5)  # what the last lines said is written before the files close
            if c.logfile is not None and not any(t.is_alive() for t in c.readers):
                c.logfile.close()
        return 0

    def stop(self, children: list[Child]) -> None:
        for c in children:
            c.next_start = None
            c.signal_group(signal.SIGTERM)
        deadline, killed = time.monotonic() + self.grace, False
        while any(c.proc is not None and c.proc.poll() is None for c in children):
            if time.monotonic() >= deadline:
                if killed:  # unkillable (uninterruptible sleep): report it rather than hang
                    break
                for c in children:
                    if c.proc is not None and c.proc.poll() is None:
                        c.note(f"still running {self.grace:g} s after SIGTERM: SIGKILL")
                        c.signal_group(signal.SIGKILL)
                deadline, killed = time.monotonic() + 5.0, True
            time.sleep(0.05)
        for c in children:
            if c.proc is not None:
                rc = c.proc.poll()
                c.note(f"stopped ({describe_exit(rc)})" if rc is not None else
                       f"pid {c.proc.pid} did not exit even after SIGKILL")
                c.proc = None
            for t in c.readers:
                t.join(timeout=0.2)  # orphans may hold the pipe; their output keeps flowing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procfile", default="Procfile")
    ap.add_argument("--status-file", help="write every process's state here as JSON (0600)")
    ap.add_argument("--backoff-initial", type=float, default=1.0, help="seconds before the first restart")
    ap.add_argument("--backoff-max", type=float, default=60.0, help="cap of the doubling delay")
    ap.add_argument("--stable-after", type=float, default=30.0,
                    help="a process that ran this long restarts after --backoff-initial again")
    ap.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL on stop")
    ap.add_argument("--stop-last", action="append", metavar="NAME",
                    help="stop this process after all the others (repeatable)")
    ap.add_argument("--log-dir", metavar="DIR",
                    help="each process's whole output to DIR/NAME.log (0600); the terminal shows only its "
                         "warnings, errors, tracebacks, job and node events, and the starts and exits")
    # 32 MiB: about 12 hours of an idle cluster's control worker (its busiest file), a day with NAME.log.1
    ap.add_argument("--log-max-bytes", type=int, default=32 * 1024 * 1024, metavar="N",
                    help="a log file this big becomes NAME.log.1, replacing the one before (default 32 MiB)")
    ap.add_argument("--verbose", action="store_true",
                    help="with --log-dir, still show every line of every process on the terminal")
    args = ap.parse_args(argv)
    if not (0 < args.backoff_initial <= args.backoff_max) or args.stable_after <= 0 or args.grace < 0:
        ap.error("need 0 < --backoff-initial <= --backoff-max, --stable-after > 0 and --grace >= 0")
    if args.log_max_bytes < 4096:
        ap.error("--log-max-bytes must be at least 4096")
    try:
        procs = parse_procfile(Path(args.procfile).read_text(), dict(os.environ))
    except (OSError, ValueError) as e:
        ap.error(str(e))
    unknown = set(args.stop_last or []) - set(procs)
    if unknown:
        ap.error(f"--stop-last names no Procfile process: {', '.join(sorted(unknown))}")
    logs = None
    if args.log_dir:
        try:
            logs = open_logs(Path(args.log_dir).resolve(), list(procs), args.log_max_bytes)
        except OSError as e:
            ap.error(f"--log-dir: {e}")
    return Supervisor(procs, args, logs).run()


if __name__ == "__main__":
    sys.exit(main())
