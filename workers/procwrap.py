"""Parent of one torchrun: waits for it, records how it ended, and leaves nothing behind.

    python -m workers.procwrap --exit-file RUN_DIR/exit.json -- python -m torch.distributed.run ...

Why a wrapper: a process's exit status is only visible to its parent. The node agent that
launched an attempt can restart while training goes on; the wrapper (in its own session, so
the agent's death does not touch it) outlives it and leaves `exit.json` for the next agent.

- The child runs in a new session, so forwarding SIGTERM/SIGINT/SIGHUP to its group reaches
  torchrun exactly once (torchrun turns a second SIGTERM into a second shutdown mid-cleanup).
- On Linux the wrapper is a child subreaper: ranks orphaned by a dying torchrun (torch 2.13
  starts every rank in its own session, so torchrun's group does not contain them) are
  re-parented here instead of to init. That lets it kill them and reap them before writing
  `exit.json`, so "exit.json exists" means "no process of this attempt is alive".
- exit.json = {"exit_code": int|None, "signal": "SIGKILL"|None, "ended_at": unix float}; a
  child killed by a signal gets exit_code = -signum (the subprocess convention).
- `--sandbox-args FILE` (workers/sandbox.py): the command is bubblewrap, and its arguments (binds,
  the ranks' environment, the drop to the attempt's uid, torchrun's argv) are read by bwrap from
  FILE through `--args FD`, so none of them shows in `ps`; bwrap runs with the umask that makes the
  job's checkpoint files group-shared (007). bwrap forwards no signal, so a stop signal goes to the
  sandboxed command itself (the children of the sandbox's init, found from here), and bwrap's
  exit status 128+n for a command killed by signal n is reported as -n, as without the sandbox.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time

import psutil

from trainyard.private import write_private

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
ORPHAN_REAP_S = 5.0  # SIGKILL cannot be ignored; 5 s covers a loaded 2-core machine


def become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def write_json_atomic(path: str, data: dict) -> None:
    """Written 0600 (config.json holds the Redis URL with its password; issue 15, section 3)."""
    write_private(path, json.dumps(data))


# ---- helpers the launcher shares: finding and ending an attempt's processes ----------

def live_process(pid: int, create_time: float | None) -> psutil.Process | None:
    """The live process `pid`, if it is still the one we started (pids get reused)."""
    try:
        p = psutil.Process(pid)
        # 1 s: create_time is boot time (whole seconds, moved by clock steps) + ticks.
        if create_time is not None and abs(p.create_time() - create_time) > 1.0:
            return None
        return None if p.status() == psutil.STATUS_ZOMBIE else p
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)  # readable the moment the process exits: exact death time
    except (AttributeError, OSError):
        return None


def kill_group_and_pid(pid: int, sig: int) -> None:
    try:
        pgid = os.getpgid(pid)
        if pgid == pid and pgid != os.getpgid(0):  # a session leader: its helpers go too
            os.killpg(pgid, sig)
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all(pids: list[int], timeout_s: float) -> bool:
    """SIGKILL each process (and its group when it leads one); True once all are gone.

    SIGKILL is asynchronous: waiting for the exits lets callers promise "nothing left".
    """
    for pid in pids:
        kill_group_and_pid(pid, signal.SIGKILL)
    fds = [fd for fd in map(pidfd, pids) if fd is not None]
    deadline = time.monotonic() + timeout_s
    try:
        while any(live_process(pid, None) for pid in pids):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if fds:
                select.select(fds, [], [], min(left, 0.05))  # woken by the first exit
            else:
                time.sleep(min(left, 0.02))
        return True
    finally:
        for fd in fds:
            os.close(fd)


class WrapperHandle:
    """The launcher's view of one procwrap process, from its parent or from a later agent."""

    def __init__(self, pid: int, create_time: float | None, popen=None):
        self.pid, self.create_time, self._popen = pid, create_time, popen

    def process(self) -> psutil.Process | None:
        if self._popen is not None:
            self._popen.poll()  # our own child: reap it, or it lingers as a zombie
        return live_process(self.pid, self.create_time)

    def wait(self, timeout_s: float) -> bool:
        """True once the wrapper has exited; pidfd-woken, no polling where Linux allows."""
        deadline = time.monotonic() + timeout_s
        fd = pidfd(self.pid)
        try:
            while self.process() is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if fd is not None:
                    select.select([fd], [], [], left)
                else:
                    time.sleep(min(left, 0.05))
            return True
        finally:
            if fd is not None:
                os.close(fd)

    def descendants(self) -> list[psutil.Process]:
        p = self.process()
        try:
            return p.children(recursive=True) if p is not None else []
        except psutil.Error:
            return []


def kill_leftovers() -> None:
    """SIGKILL every remaining descendant (with its process group) and reap it."""
    me = psutil.Process()
    deadline = time.monotonic() + ORPHAN_REAP_S
    while time.monotonic() < deadline:
        kids = me.children(recursive=True)
        if not kids:
            return
        for p in kids:
            kill_group_and_pid(p.pid, signal.SIGKILL)  # a rank's group: its helpers too
        reap_any(timeout_s=0.1)


def reap_any(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)


SANDBOX_UMASK = 0o007  # the job's files: the attempt's uid and the job's group (sandbox.py)


def sandboxed_targets(bwrap_pid: int) -> list[int]:
    """The processes a stop signal is for inside a sandbox: the children of its init (bwrap's
    child, pid 1 of the sandbox's PID namespace), i.e. torchrun and whatever was re-parented there."""
    try:
        return [c.pid for init in psutil.Process(bwrap_pid).children() for c in init.children()]
    except psutil.Error:
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.procwrap")
    parser.add_argument("--exit-file", required=True)
    parser.add_argument("--sandbox-args", default="", help="bwrap's --args file (the command is bwrap)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command after --")

    become_subreaper()
    child: subprocess.Popen | None = None
    pending: list[int] = []
    sandboxed = bool(args.sandbox_args)

    def forward(signum, _frame):
        if child is None:  # a stop that races the spawn is delivered right after it
            pending.append(signum)
            return
        targets = sandboxed_targets(child.pid) if sandboxed else []
        for pid in targets:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if not targets:  # not sandboxed, or the sandbox is still being set up: its group (bwrap dies, and all with it)
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass

    # Handlers before the spawn: a SIGTERM between spawn and handler would kill the wrapper
    # by default action and orphan a running torchrun.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    popen: dict = {}
    if sandboxed:
        args_fd = os.open(args.sandbox_args, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        cmd = [cmd[0], "--args", str(args_fd), *cmd[1:]]  # bwrap --args FD -- <command>
        popen = {"pass_fds": (args_fd,), "umask": SANDBOX_UMASK}
    try:
        child = subprocess.Popen(cmd, start_new_session=True, **popen)
    except OSError as exc:
        print(f"procwrap: cannot start {cmd[0]!r}: {exc}", file=sys.stderr, flush=True)
        write_json_atomic(args.exit_file, {"exit_code": 127, "signal": None,
                                           "ended_at": time.time(), "error": str(exc)})
        return 127
    for signum in pending:
        forward(signum, None)

    # waitpid(-1) rather than child.wait(): orphaned ranks re-parented to us must be reaped
    # too, or they stay zombies that psutil still lists as processes of the attempt.
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child.pid:
            break
    ended_at = time.time()
    kill_leftovers()

    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        sig_name = _signame(signum)
        code = -signum
    else:
        code, sig_name = os.WEXITSTATUS(status), None
        if sandboxed and 128 < code <= 128 + 64:  # bwrap: the command died of signal code - 128
            code, sig_name = 128 - code, _signame(code - 128)
    write_json_atomic(args.exit_file, {"exit_code": code, "signal": sig_name,
                                       "ended_at": ended_at})
    return code if code >= 0 else 128 - code


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # real-time signals have no name
        return f"SIG{signum}"


if __name__ == "__main__":
    sys.exit(main())
