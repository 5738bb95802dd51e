"""Several daphne processes on one listening socket: `python -m controlplane.serve --workers N`.

One daphne process runs one event loop, so it uses one core at most; under load (hundreds of
dashboard sockets and tens of API requests a second) that core saturates while the others idle
(bench/load.py). This launcher binds the address once and starts N daphne processes that all
accept on that socket (`daphne --fd`): the kernel hands each new connection to whichever process
is free to accept it, so a busy process does not take new work from an idle one. Everything the
processes share lives outside them already: sessions and data in the database, websocket groups
in the Redis channel layer. Per-process limits (the in-memory throttle counts, the per-user
socket cap) then allow N times their figure (docs/deploy.md, TRAINYARD_WEB_WORKERS).

A worker that dies is started again (backoff from 1 s doubling to 30 s while it keeps dying
within 30 s of its start); the socket stays open meanwhile, so connections wait in its backlog
instead of being refused. A worker that dies 5 times in a row within 30 s of its start (bad
settings, a database that refuses it) stops the launcher with exit status 1, so its supervisor
(systemd, `make run`) sees the failure instead of a launcher that looks alive. SIGTERM/SIGINT stop every worker (SIGKILL after --grace seconds) and
then the launcher. Arguments it does not know (`--proxy-headers`, daphne's timeouts) go to every
daphne as they are. No Django here: the workers import the application.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

APP = "controlplane.asgi:application"
BACKOFF_MAX_S = 30.0
HEALTHY_AFTER_S = 30.0  # a worker that lived this long starts again after 1 s, whatever came before
GIVE_UP_AFTER = 5  # quick deaths in a row (each within HEALTHY_AFTER_S): a crash loop, not bad luck


def log(msg: str) -> None:
    print(f"serve[{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


def default_workers(env=os.environ) -> int:
    raw = env.get("TRAINYARD_WEB_WORKERS", "").strip()
    if raw:
        return int(raw)
    return max(1, min(4, os.cpu_count() or 1))


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m controlplane.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=None,
                   help="daphne processes (default: TRAINYARD_WEB_WORKERS, else the cores up to 4)")
    p.add_argument("-b", "--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("-p", "--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--backlog", type=int, default=1024, help="listen backlog shared by the workers")
    p.add_argument("--grace", type=float, default=10.0, help="seconds a worker gets to stop before SIGKILL")
    p.add_argument("--backoff", type=float, default=1.0, help="first restart delay of a dead worker (s)")
    p.add_argument("--app", default=APP, help=f"ASGI application (default {APP})")
    args, daphne_args = p.parse_known_args(argv)
    if args.workers is None:
        try:
            args.workers = default_workers()
        except ValueError:
            p.error("TRAINYARD_WEB_WORKERS must be a whole number")
    if not 1 <= args.workers <= 64:
        p.error("--workers must be between 1 and 64")
    if not 0 <= args.port <= 65535:
        p.error("--port must be between 0 and 65535")
    if "--fd" in daphne_args or any(a in daphne_args for a in ("-b", "--bind", "-p", "--port", "-u", "-e")):
        p.error("the launcher owns the socket: give -b/-p to it, not daphne's own endpoints")
    return args, daphne_args


def _die_with(parent: int):
    def before_exec() -> None:
        """In the worker before exec: SIGTERM when the launcher dies, even by SIGKILL, so no
        orphaned daphne keeps serving the inherited socket (Linux's PR_SET_PDEATHSIG)."""
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)
    return before_exec


def listen(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


class Launcher:
    def __init__(self, args: argparse.Namespace, daphne_args: list[str], sock: socket.socket):
        self.args, self.daphne_args, self.sock = args, daphne_args, sock
        self.workers: list[subprocess.Popen | None] = [None] * args.workers
        self.started_at = [0.0] * args.workers
        self.backoff = [args.backoff] * args.workers
        self.due = [0.0] * args.workers  # monotonic time a dead worker starts again
        self.quick_deaths = [0] * args.workers
        self.failed = False
        self.stopping = False

    def command(self) -> list[str]:
        return [sys.executable, "-m", "daphne", "--fd", str(self.sock.fileno()), *self.daphne_args, self.args.app]

    def start(self, i: int) -> None:
        proc = subprocess.Popen(self.command(), pass_fds=(self.sock.fileno(),),
                                preexec_fn=_die_with(os.getpid()) if sys.platform == "linux" else None)
        self.workers[i], self.started_at[i] = proc, time.monotonic()
        log(f"worker {i} started: pid {proc.pid}")

    def reap(self) -> None:
        now = time.monotonic()
        for i, proc in enumerate(self.workers):
            if proc is None:
                if not self.stopping and now >= self.due[i]:
                    self.start(i)
                continue
            code = proc.poll()
            if code is None:
                continue
            self.workers[i] = None
            if self.stopping:
                continue
            lived = now - self.started_at[i]
            if lived >= HEALTHY_AFTER_S:
                self.backoff[i], self.quick_deaths[i] = self.args.backoff, 0
            self.quick_deaths[i] += lived < HEALTHY_AFTER_S
            if self.quick_deaths[i] >= GIVE_UP_AFTER:
                log(f"worker {i} (pid {proc.pid}) exited with {code} after {lived:.1f} s, the "
                    f"{GIVE_UP_AFTER}th quick exit in a row: stopping (see its output above)")
                self.failed = self.stopping = True
                continue
            self.due[i] = now + self.backoff[i]
            log(f"worker {i} (pid {proc.pid}) exited with {code} after {lived:.1f} s; "
                f"starting it again in {self.backoff[i]:.1f} s")
            self.backoff[i] = min(BACKOFF_MAX_S, self.backoff[i] * 2)

    def stop(self) -> int:
        self.stopping = True
        live = [p for p in self.workers if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"pid {p.pid} ignored SIGTERM for {self.args.grace:.0f} s; killing it")
                p.kill()
                p.wait()
        self.sock.close()
        return 1 if self.failed else 0

    def run(self) -> int:
        def _stop(*_):
            self.stopping = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        host, port = self.sock.getsockname()[:2]
        log(f"listening on {host}:{port} with {len(self.workers)} daphne worker(s)")
        for i in range(len(self.workers)):
            self.start(i)
        while not self.stopping:
            self.reap()
            time.sleep(0.2)
        return self.stop()


def main(argv: list[str] | None = None) -> int:
    args, daphne_args = parse(sys.argv[1:] if argv is None else argv)
    try:
        sock = listen(args.bind, args.port, args.backlog)
    except OSError as exc:
        print(f"cannot listen on {args.bind}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return Launcher(args, daphne_args, sock).run()


if __name__ == "__main__":
    sys.exit(main())
