"""`manage.py relay --workers N`: the relay as N processes, one per core, each reading its share of the
job streams (issue 26 §3; jobs/telemetry/relay_streams.py `shard_of`).

One relay process is one core: at ~100k samples/s its Python (decoding, checking, building rows, the
fan-out) is most of it, and only the database's own writes are serialised (SQLite's one writer;
PostgreSQL's rows of different attempts never meet). The streams are split by attempt id, all read
under one consumer name, so exactly once holds as with one process: a stream's entries
are acknowledged only after their commit, by the one process reading it, and its pending entries are
read again by whichever process reads it after a restart, whatever N was before.

`Workers` is their supervisor: it starts `manage.py relay --shard i/N` for each i, restarts one that
exits (after RESTART_MIN_S, doubling up to RESTART_MAX_S while it keeps failing fast), and on SIGTERM or
SIGINT passes the signal on and waits for them (each commits or abandons its round, then exits).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger("trainyard.relay")
RESTART_MIN_S, RESTART_MAX_S = 1.0, 30.0
STOP_WAIT_S = 30.0


def shard_argv(index: int, count: int, consumer: str, batch: int) -> list[str]:
    """The command line of relay process `index` of `count` (manage.py relay --shard): the manage.py this
    process runs (by its absolute path: the children find the project wherever they start), else
    `python -m django` with this process' DJANGO_SETTINGS_MODULE."""
    script = sys.argv[0]
    django = [os.path.abspath(script)] if os.path.basename(script) == "manage.py" else ["-m", "django"]
    return [sys.executable, *django, "relay", "--shard", f"{index}/{count}", "--consumer", consumer,
            "--batch", str(batch)]


def parse_shard(text: str) -> tuple[int, int]:
    """"i/N" -> (i, N), 0 <= i < N."""
    index, _, count = text.partition("/")
    i, n = int(index), int(count)
    if not 0 <= i < n:
        raise ValueError(f"shard {text!r}: want i/N with 0 <= i < N")
    return i, n


class Workers:
    def __init__(self, argvs: list[list[str]]):
        self.argvs = argvs
        self.procs: list[subprocess.Popen | None] = [None] * len(argvs)
        self.started = [0.0] * len(argvs)
        self.backoff = [RESTART_MIN_S] * len(argvs)
        self.restart_at = [0.0] * len(argvs)
        self.stopping = False

    def _start(self, i: int) -> None:
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "controlplane.settings")}
        self.procs[i] = subprocess.Popen(self.argvs[i], env=env)
        self.started[i] = time.monotonic()

    def _stop(self, signum, _frame) -> None:
        self.stopping = True
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.send_signal(signum)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        for i in range(len(self.argvs)):
            self._start(i)
        log.info("relay: %d processes started", len(self.argvs))
        while not self.stopping:
            now = time.monotonic()
            for i, p in enumerate(self.procs):
                if p is not None and p.poll() is not None and not self.stopping:
                    ran = now - self.started[i]
                    self.backoff[i] = RESTART_MIN_S if ran > 60 else min(RESTART_MAX_S, self.backoff[i] * 2)
                    log.warning("relay process %d exited (%s) after %.0f s; restarting in %.0f s",
                                i, p.returncode, ran, self.backoff[i])
                    self.procs[i], self.restart_at[i] = None, now + self.backoff[i]
                elif p is None and now >= self.restart_at[i]:
                    self._start(i)
            time.sleep(0.2)
        deadline = time.monotonic() + STOP_WAIT_S
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return 0
