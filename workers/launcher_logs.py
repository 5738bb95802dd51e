"""Reading what torchrun and the ranks leave in a run_dir: logs, error files, failure summary.

torch 2.13 layout with `--log-dir logs --redirects 3` (DefaultLogsSpecs):
    logs/<rdzv-id>_<random>/attempt_<restart>/<local_rank>/{stdout.log,stderr.log,error.json}
error.json is TORCHELASTIC_ERROR_FILE, written by a rank's `@record` on an exception:
    {"message": {"message": "ValueError: bad shape",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1764471234"}}}
A rank that dies by a signal or os._exit writes none; torchrun then only knows its exit code,
which it prints in the ChildFailedError summary on its own stderr. Neither does a user script
that never imports the SDK (no `@record`): its uncaught exception is read back from the
traceback Python printed on the rank's stderr.log.

Everything under logs/ and ranks/ is written by the job (inside its sandbox): it is opened with
trainyard.safefs (no symlink followed, regular files only, sizes bounded), so a rank that plants
`stderr.log -> /etc/shadow` gets nothing back through its own logs.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import stat
from collections import deque
from datetime import datetime
from typing import Callable

from trainyard import safefs

log = logging.getLogger(__name__)

TAIL_LINES = 50  # per rank, in the result: enough for a traceback, small for a Celery message
LOG_BATCH_LINES = 500  # per on_log call, so one chatty rank cannot build a huge message
READ_CAP = 1 << 20  # bytes per file per poll while running; the final pass reads to EOF
LONG_LINE = 1 << 16  # a "line" this long without a newline is sent as it is
RANK_FILE_MAX = 64 << 10  # ranks/<lr>.json: a few numbers
ERROR_FILE_MAX = 4 << 20  # error.json: a message and a traceback


class LogTailer:
    """Follows torchrun's per-rank stdout.log/stderr.log and hands out new complete lines.

    The files are under the job's logs/ (sandbox-writable): each is opened once with
    trainyard.safefs and read through that descriptor, so renaming or replacing it later changes
    nothing about what is read."""

    def __init__(self, log_root: str, nproc: int):
        self.log_root, self.nproc = log_root, nproc
        self._dir: str | None = None  # <rdzv-id>_<random>/attempt_0, relative to log_root
        self._fds: dict[tuple[int, str], int] = {}
        self._pos: dict[tuple[int, str], int] = {}
        self._partial: dict[tuple[int, str], bytes] = {}
        self._tails = {lr: deque(maxlen=TAIL_LINES) for lr in range(nproc)}

    def rank_dir(self, lr: int) -> str | None:
        """The rank's directory relative to log_root (torchrun's layout), or None before torchrun made it."""
        if self._dir is None:
            # --max-restarts 0: there is only attempt_0; the last one would be current anyway.
            found = []
            try:
                for run, mode in safefs.list_beneath(self.log_root):
                    if stat.S_ISDIR(mode):
                        found += [f"{run}/{a}" for a, m in safefs.list_beneath(self.log_root, run)
                                  if a.startswith("attempt_") and stat.S_ISDIR(m)]
            except OSError as exc:
                log.warning("cannot list %s: %s", self.log_root, exc)
            self._dir = sorted(found)[-1] if found else None
        return f"{self._dir}/{lr}" if self._dir else None

    def _fd(self, lr: int, stream: str) -> int | None:
        key = (lr, stream)
        if key not in self._fds:
            d = self.rank_dir(lr)
            if d is None:
                return None
            try:
                self._fds[key] = safefs.open_beneath(self.log_root, f"{d}/{stream}.log")
            except FileNotFoundError:
                return None
            except OSError as exc:  # a symlink or a FIFO planted in its place: never read
                log.warning("not reading %s/%s/%s.log: %s", self.log_root, d, stream, exc)
                self._fds[key] = -1
        fd = self._fds[key]
        return None if fd < 0 else fd

    def close(self) -> None:
        for fd in self._fds.values():
            if fd >= 0:
                os.close(fd)
        self._fds.clear()

    def read_file(self, lr: int, name: str, max_bytes: int) -> tuple[bytes, float] | None:
        """(content, mtime) of a small file in the rank's directory (error.json), or None."""
        d = self.rank_dir(lr)
        if d is None:
            return None
        try:
            fd = safefs.open_beneath(self.log_root, f"{d}/{name}")
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("not reading %s/%s/%s: %s", self.log_root, d, name, exc)
            return None
        try:
            st = os.fstat(fd)
            return (os.pread(fd, max_bytes, 0) if st.st_size <= max_bytes else b""), st.st_mtime
        finally:
            os.close(fd)

    def stderr_tail(self, lr: int, n: int) -> list[str]:
        fd = self._fd(lr, "stderr")
        return _fd_tail(fd, n) if fd is not None else []

    def skip_to_end(self) -> None:
        """After adopt: continue from the files' current end, seeding the tails from them."""
        for lr in range(self.nproc):
            for stream in ("stdout", "stderr"):
                fd = self._fd(lr, stream)
                if fd is None:
                    continue
                size = os.fstat(fd).st_size
                lines = os.pread(fd, LONG_LINE, max(0, size - LONG_LINE)).decode("utf-8", "replace").splitlines()
                self._pos[(lr, stream)] = size
                self._tails[lr].extend(lines[-TAIL_LINES:])

    def poll(self, final: bool, ready: Callable[[int], bool]) -> list[tuple[int, str, list]]:
        """New lines as [(local_rank, stream, lines)]; `final` also flushes a last partial line.

        Ranks for which ready(local_rank) is false are not read yet: their lines wait in the
        file until the rank is known, so every line can be labelled with its global rank.
        """
        out = []
        for lr in range(self.nproc):
            if self.rank_dir(lr) is None or not ready(lr):
                continue
            for stream in ("stdout", "stderr"):
                key = (lr, stream)
                fd = self._fd(lr, stream)
                if fd is None:
                    continue
                data = _read_from(fd, self._pos.get(key, 0), None if final else READ_CAP)
                self._pos[key] = self._pos.get(key, 0) + len(data)
                *complete, rest = (self._partial.get(key, b"") + data).split(b"\n")
                if rest and (final or len(rest) > LONG_LINE):
                    complete, rest = complete + [rest], b""
                self._partial[key] = rest
                lines = [c.decode("utf-8", "replace").rstrip("\r") for c in complete]
                self._tails[lr].extend(lines)
                for i in range(0, len(lines), LOG_BATCH_LINES):
                    out.append((lr, stream, lines[i:i + LOG_BATCH_LINES]))
        return out

    def tails(self) -> dict[int, list[str]]:
        """Last TAIL_LINES lines per local rank, stdout and stderr in the order they were read."""
        return {lr: list(t) for lr, t in self._tails.items() if t}


def _read_from(fd: int, pos: int, cap: int | None) -> bytes:
    """What the file at `fd` holds from `pos`: at most `cap` bytes, or all of it (the final pass)."""
    if cap is not None:
        return os.pread(fd, cap, pos)
    chunks = []
    while chunk := os.pread(fd, 1 << 20, pos):
        chunks.append(chunk)
        pos += len(chunk)
    return b"".join(chunks)


def _fd_tail(fd: int, n: int) -> list[str]:
    size = os.fstat(fd).st_size
    return os.pread(fd, LONG_LINE, max(0, size - LONG_LINE)).decode("utf-8", "replace").splitlines()[-n:]


def read_json(path: str) -> dict | None:
    """A JSON object the agent itself wrote (its run directory's own files)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):  # absent, or caught mid-write
        return None
    return data if isinstance(data, dict) else None


def read_run_json(run_dir: str, rel: str, max_bytes: int = RANK_FILE_MAX) -> dict | None:
    """A JSON object a rank wrote under the run directory (ranks/<lr>.json): no symlink followed,
    at most max_bytes; None when absent, unreadable, caught mid-write or not an object."""
    try:
        data = json.loads(safefs.read_small(run_dir, rel, max_bytes=max_bytes))
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("not reading %s/%s: %s", run_dir, rel, exc)
        return None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def tail_lines(path: str, n: int) -> list[str]:
    """The last n lines of a file the agent itself writes (torchrun.stderr.log)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LONG_LINE))
            return f.read().decode("utf-8", "replace").splitlines()[-n:]
    except FileNotFoundError:
        return []


def signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # real-time signals have no name
        return f"SIG{signum}"


def read_error_file(tailer: LogTailer, lr: int) -> dict | None:
    """message, traceback and failure time from a rank's error.json.

    @record writes whole seconds: too coarse to tell a cause from the "connection closed" it
    triggers ~10-800 ms later on a peer. The file is written at that same moment, so its
    mtime (kernel clock, a few ms resolution) stands in for it. A fractional timestamp
    (a runtime writing its own precise one) is taken as it is.
    """
    got = tailer.read_file(lr, "error.json", ERROR_FILE_MAX)
    if got is None:
        return None
    try:
        data = json.loads(got[0])
    except ValueError:  # caught mid-write, or not JSON
        return None
    if not isinstance(data, dict):
        return None
    msg = data.get("message")
    extra = msg.get("extraInfo", {}) if isinstance(msg, dict) else {}
    try:
        ts = float(extra.get("timestamp", data.get("timestamp")))
    except (TypeError, ValueError):
        ts = None
    mtime = got[1]
    if ts is None or (ts.is_integer() and ts <= mtime < ts + 2):
        ts = mtime
    message = msg.get("message") if isinstance(msg, dict) else msg
    trace = extra.get("py_callstack") if isinstance(extra, dict) else None
    return {"message": str(message)[:ERROR_TEXT_MAX], "traceback": str(trace)[:ERROR_TEXT_MAX] if trace else None,
            "timestamp": ts}


ERROR_TEXT_MAX = 64 << 10  # what one failure carries up the bus


# torchrun's ChildFailedError summary (torch/distributed/elastic/multiprocessing/errors), e.g.
#   time      : 2026-11-30_03:29:26
#   host      : localhost
#   rank      : 1 (local_rank: 1)
#   exitcode  : -9 (pid: 3512)  (SIGKILL)
_SUMMARY_RE = re.compile(
    r"time\s*:\s*(?P<time>\S+)\s*\n\s*host\s*:.*\n"
    r"\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<lr>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)")


def parse_summary(path: str) -> dict[int, dict]:
    """local_rank -> {"rank", "exitcode", "pid", "time"} for each failure torchrun listed."""
    text = "\n".join(tail_lines(path, 2000))
    out = {}
    for m in _SUMMARY_RE.finditer(text):
        try:  # torch prints local time, whole seconds
            t = datetime.strptime(m["time"], "%Y-%m-%d_%H:%M:%S").timestamp()
        except ValueError:
            t = None
        out[int(m["lr"])] = {"rank": int(m["rank"]), "exitcode": int(m["code"]),
                             "pid": int(m["pid"]), "time": t}
    return out


def death_time(window: tuple[float, float] | None, sig: str | None) -> float | None:
    """When a rank without an error file died, within the window the supervisor bracketed
    (last seen alive, first seen gone; <= one 150 ms poll apart).

    The control plane blames the earliest failure, so pick the edge that fits the likely
    story: SIGTERM comes from torchrun stopping the survivors of a failure (a consequence:
    late edge); SIGKILL by the OOM killer, SIGSEGV, os._exit are causes (early edge).
    """
    if window is None:
        return None
    last_alive, seen_gone = window
    return seen_gone if sig == "SIGTERM" else last_alive


TRACEBACK_HEAD = "Traceback (most recent call last):"
# Once a process group exists torch's excepthook prefixes every line of the traceback with this.
_RANK_PREFIX_RE = re.compile(r"^\[rank\d+\]: ?")


def traceback_from_stderr(lines_in: list[str]) -> tuple[str, str] | None:
    """(exception line, traceback) of the last Python traceback in a rank's stderr, if any.

    The exception line is the first unindented line after the header ("ValueError: bad lr"), so
    lines printed after the traceback (shutdown warnings) neither replace nor join it."""
    lines = [_RANK_PREFIX_RE.sub("", line, count=1) for line in lines_in]
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_HEAD)]
    if not starts:
        return None
    tb = lines[starts[-1]:]
    message = next((line for line in tb[1:] if line and not line[0].isspace()), "")
    if not message:
        return None
    end = tb.index(message, 1) + 1
    return message, "\n".join(tb[:end])


def collect_failures(tailer: LogTailer, torchrun_stderr: str, rank_of: Callable[[int], int],
                     died: dict[int, tuple[float, float]], fallback_ts: float) -> list[dict]:
    """This node's failed ranks, earliest first: error files, then torchrun's summary.

    died: local_rank -> (last seen alive, first seen gone), from the supervisor's pidfds.
    """
    summary = parse_summary(torchrun_stderr)
    failures = []
    for lr in range(tailer.nproc):
        d = tailer.rank_dir(lr)
        err = read_error_file(tailer, lr) if d else None
        s = summary.get(lr)
        if err is None and s is None:
            continue
        code = s["exitcode"] if s else None
        sig = signame(-code) if code is not None and code < 0 else None
        f = {"rank": s["rank"] if s else rank_of(lr), "local_rank": lr, "exitcode": code,
             "signal": sig}
        if err is not None:
            f.update(err)
        else:
            # No @record (a user script that never imports the SDK): the traceback Python printed
            # on the rank's stderr names the exception as well as an error file would.
            tb = None if sig or d is None else traceback_from_stderr(tailer.stderr_tail(lr, 400))
            f["message"] = (f"Signal {-code} ({sig}) received by PID {s['pid']}" if sig else
                            tb[0] if tb else f"exit code {code} without an error file (no @record exception)")
            f["traceback"] = tb[1] if tb else None
            f["timestamp"] = death_time(died.get(lr), sig) or s["time"] or fallback_ts
        failures.append(f)
    return sorted(failures, key=lambda f: f["timestamp"])
