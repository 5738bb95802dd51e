"""Launch this node's share of an attempt under torchrun and supervise it until it ends.

Runs inside the node agent, which needs only Redis: no django/jobs/controlplane imports.

Process tree (every level its own session, so a dying agent touches none of it):
    agent --> python -m workers.procwrap (writes exit.json) --> torchrun --> ranks
torch 2.13 starts each rank in a session of its own, so "kill torchrun's group" misses the
ranks; procwrap is a child subreaper and kills and reaps whatever torchrun leaves behind.

run_dir layout (one per attempt per node):
    launched            O_EXCL marker: an attempt starts at most once per run_dir
    supervisor.json     wrapper pid + create time + the request, for adopt()
    config.json         the runtime's --config
    torchrun.{stdout,stderr}.log   agent-level output of procwrap and torchrun
    logs/<rdzv-id>_<random>/attempt_0/<local_rank>/{stdout.log,stderr.log,error.json}
    ranks/<local_rank>.json        {"rank","local_rank","pid","node"}: written by the rank through
                                   the SDK (the built-in runtime uses it too)
    rank-<local_rank>.agent.json   the same, found by the supervisor from a rank's environment
                                   (user code without the SDK; workers/launcher_ranks.py)
    code/               the extracted bundle of a user-code job (read-only; written by the agent)
    exit.json           written by procwrap: {"exit_code","signal","ended_at"}
    stop_requested      stop() was called (survives an agent restart)
    reported            on_exit returned without raising; adopt() skips this run_dir

Ranks get an allow-listed environment (workers.launch_spec.build_env: a minimal PATH, HOME and
TMPDIR in the run directory, OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES (cuda), req.env (a user job's
`env`), TRAINYARD_{RUN_CONFIG,NODE,RUN_DIR,JOB_ID,ATTEMPT_ID,LOCAL_ADDR}), nothing else of the
agent's; with a `sandbox` (workers/sandbox.py) they run in bubblewrap as the attempt's own uid and
see only home/, tmp/, logs/, ranks/ (theirs), config.json and code/ (read-only) of the run directory.

on_exit result (JSON-safe; the agent sends it as a trainyard.launch.NodeExit, and on_ranks'
list as trainyard.launch.RankInfo): attempt_id, job_id, node, exit_code (torchrun's; -signum
when it was killed; None when lost), signal, stopped, lost, failures (earliest first: rank,
local_rank, exitcode, signal, timestamp, message, traceback), log_tail {"<rank>": lines},
duration_s; plus torchrun_tail (its last stderr lines) when exit_code != 0.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from trainyard.private import private_dir, write_private
from workers import sandbox
from workers.launch_spec import (  # noqa: F401 - the launcher's public API
    SYSTEM_PATH, LaunchRequest, build_argv, build_env, pick_free_port, validate)
from workers.launcher_logs import LogTailer, collect_failures, read_json, tail_lines
from workers.launcher_ranks import RankTracker
from workers.procwrap import (
    WrapperHandle, kill_all, live_process, pidfd, write_json_atomic)

log = logging.getLogger(__name__)

POLL_S = 0.15  # log/ranks poll: lines reach the UI within ~150 ms at ~7 wakeups/s
TREE_SNAPSHOT_S = 1.0  # how often to remember the tree's pids, for cleanup if procwrap dies
STACK_SIGNAL = signal.SIGUSR1  # faulthandler.register'ed by the runtime and the SDK
DUMP_WAIT_S = 2.0  # for the ranks to write their stacks before a hung attempt is stopped


def catches_signal(pid: int, signum: int) -> bool:
    """Whether `pid` has a handler installed for `signum` (Linux: SigCgt in /proc/<pid>/status)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            caught = next((int(line.split()[1], 16) for line in f if line.startswith("SigCgt:")), 0)
    except (OSError, ValueError, IndexError):
        return False
    return bool(caught >> (signum - 1) & 1)


def launched_attempts(base_dir) -> list[str]:
    """run_dirs under base_dir to adopt on agent start: launched and not yet reported.

    That is running attempts plus those that ended (or were lost) while no agent watched,
    whose outcome adopt() will report.
    """
    found = []
    for root, dirs, files in os.walk(base_dir):
        if "supervisor.json" in files and "reported" not in files:
            found.append(root)
        dirs[:] = [d for d in dirs if d not in ("logs", "ranks")]
    return sorted(found)


class Supervisor:
    """One attempt on this node: start it once, stream what it does, report how it ended.

    Callbacks run on the supervisor's daemon thread (one per attempt); exceptions they raise
    are logged and swallowed. on_exit fires exactly once per Supervisor that started or
    adopted the attempt, after every line the ranks wrote has gone through on_log.
    """

    def __init__(self, req: LaunchRequest, *, on_ranks: Callable, on_log: Callable,
                 on_exit: Callable, sandbox: "sandbox.SandboxPlan | None" = None):
        validate(req)
        self.req = req
        self.sandbox = sandbox  # None: unsandboxed, no agent variable passed on (tests of the launcher)
        self.sandboxed = sandbox is not None and sandbox.enabled
        self.run_dir = os.path.abspath(req.run_dir)
        self._on_ranks, self._on_log, self._on_exit = on_ranks, on_log, on_exit
        self._thread: threading.Thread | None = None
        self._wrap: WrapperHandle | None = None  # None: procwrap could not be started
        self._started_at = time.time()
        self._abandoned = threading.Event()
        self._finished = threading.Event()
        self._escalated = False  # stop() had to SIGKILL the wrapper itself
        self._tracker = RankTracker(req, self.run_dir, self._descendants)  # who, pids, deaths
        self._ranks_sent = False
        self._tailer = LogTailer(os.path.join(self.run_dir, "logs"), req.nproc)

    def _path(self, name: str) -> str:
        return os.path.join(self.run_dir, name)

    def _descendants(self) -> list[psutil.Process]:
        return self._wrap.descendants() if self._wrap else []

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> bool:
        private_dir(self.run_dir)  # 0700: config.json holds the Redis URL and its password
        try:
            fd = os.open(self._path("launched"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False  # redelivered message or restarted agent: never a second torchrun
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {time.time()}\n")
        try:
            cmd, env, cwd = self._command()
        except BaseException:  # nothing started: let a retried message try again
            os.unlink(self._path("launched"))
            raise
        self._started_at = time.time()
        try:
            with open(self._path("torchrun.stdout.log"), "ab") as out, \
                    open(self._path("torchrun.stderr.log"), "ab") as err:
                popen = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=err, start_new_session=True, cwd=cwd)
        except OSError as exc:  # reported through on_exit like any other failed launch
            log.error("attempt %s: cannot start procwrap: %s", self.req.attempt_id, exc)
            write_json_atomic(self._path("exit.json"), {"exit_code": None, "signal": None,
                              "ended_at": time.time(), "error": str(exc)})
        else:
            p = live_process(popen.pid, None)
            self._wrap = WrapperHandle(popen.pid, p.create_time() if p else None, popen)
        write_json_atomic(self._path("supervisor.json"), {
            "wrapper_pid": self._wrap and self._wrap.pid,
            "wrapper_create_time": self._wrap and self._wrap.create_time,
            "started_at": self._started_at, "request": dataclasses.asdict(self.req),
            "sandboxed": self.sandboxed})
        self._spawn_thread()
        return True

    def _command(self) -> tuple[list[str], dict[str, str], str]:
        """procwrap's argv, environment and cwd: torchrun directly, or bwrap reading the sandbox's
        arguments from a root-only file (the ranks' environment travels there, not in procwrap's)."""
        for name in sandbox.SANDBOX_DIRS:  # HOME, TMPDIR, torchrun's logs, the ranks' files
            os.makedirs(self._path(name), mode=0o700, exist_ok=True)
        config_path = self._path("config.json")
        write_json_atomic(config_path, self.req.config)
        argv = build_argv(self.req, config_path, self._path("logs"))
        passes = self.sandbox.cfg.passes if self.sandbox is not None else (lambda name: False)
        env = build_env(self.req, passes=passes, user=self.sandbox.user if self.sandbox else "")
        wrap = [sys.executable, "-m", "workers.procwrap", "--exit-file", self._path("exit.json")]
        if not self.sandboxed:
            return [*wrap, "--", *argv], env, self.req.cwd
        self.sandbox.prepare()
        bwrap, options, command = self.sandbox.command(env, argv, self.req.cwd)
        args_path = self._path("sandbox.args")
        write_private(args_path, sandbox.encode_args(options).decode())
        outer = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "PYTHONPATH": sandbox.REPO_ROOT.as_posix()}
        return [*wrap, "--sandbox-args", args_path, "--", bwrap, "--", *command], outer, "/"

    @classmethod
    def take_over(cls, req: LaunchRequest, wrap: WrapperHandle, *, on_ranks, on_log, on_exit,
                  sandbox: "sandbox.SandboxPlan | None" = None) -> "Supervisor | None":
        """Supervise a standby launcher (workers/standby.py) as req's attempt, from the moment the
        agent handed it over; None if this run_dir was launched already."""
        sup = cls(req, on_ranks=on_ranks, on_log=on_log, on_exit=on_exit, sandbox=sandbox)
        try:
            fd = os.open(sup._path("launched"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return None
        os.close(fd)
        sup._wrap, sup._started_at = wrap, time.time()
        write_json_atomic(sup._path("supervisor.json"), {
            "wrapper_pid": wrap.pid, "wrapper_create_time": wrap.create_time, "started_at": sup._started_at,
            "request": dataclasses.asdict(req), "sandboxed": sup.sandboxed})
        sup._spawn_thread()
        return sup

    @classmethod
    def adopt(cls, run_dir, *, on_ranks, on_log, on_exit) -> "Supervisor | None":
        """Re-attach to an attempt launched by an earlier agent process.

        Log streaming resumes at the current end of each rank's files: lines written while
        no agent watched are not re-sent (no duplicates in the UI) but stay in the files and
        in the result's log_tail. on_ranks is sent again once all ranks are known.
        """
        run_dir = os.path.abspath(run_dir)
        info = read_json(os.path.join(run_dir, "supervisor.json"))
        if info is None or os.path.exists(os.path.join(run_dir, "reported")):
            return None
        fields = dict(info["request"], slots=tuple(info["request"]["slots"]), run_dir=run_dir)
        sup = cls(LaunchRequest(**fields), on_ranks=on_ranks, on_log=on_log, on_exit=on_exit)
        sup.sandboxed = bool(info.get("sandboxed"))
        if info.get("wrapper_pid"):
            sup._wrap = WrapperHandle(info["wrapper_pid"], info.get("wrapper_create_time"))
        sup._started_at = info.get("started_at", sup._started_at)
        sup._tailer.skip_to_end()
        sup._spawn_thread()
        return sup

    def alive(self) -> bool:
        return (not self._finished.is_set() and self._wrap is not None
                and self._wrap.process() is not None)

    def stop(self, grace_s: float = 3.0, *, dump_stacks: bool = False) -> None:
        """SIGTERM the attempt, SIGKILL what is left after grace_s; on_exit follows.

        dump_stacks (a hung attempt): first SIGUSR1 every rank that catches it (the runtime and
        the SDK register faulthandler for it) and give them DUMP_WAIT_S to write every thread's
        stack to their stderr, which reaches the job's log stream and the failure's log tail."""
        if self._wrap is None or self._finished.is_set():
            return
        Path(self._path("stop_requested")).touch()
        if dump_stacks and self.dump_stacks():
            time.sleep(DUMP_WAIT_S)
        try:  # procwrap forwards it to torchrun's group once; torchrun SIGTERMs each rank
            if self._wrap.process() is not None:
                os.kill(self._wrap.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if not self._wrap.wait(grace_s):
            kill_all(self._tracker.tree_pids(), timeout_s=3.0)  # procwrap then writes exit.json
            if not self._wrap.wait(3.0):
                self._escalated = True
                kill_all(self._tracker.tree_pids() + [self._wrap.pid], timeout_s=1.0)
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)  # so on_exit has fired when stop() returns

    def dump_stacks(self) -> list[int]:
        """SIGUSR1 to each live rank whose handler table catches it; the pids signalled.

        A rank that never registered a handler (user code without the SDK) is left alone:
        SIGUSR1's default action would kill it before the stop could report anything."""
        sent = []
        for info in list(self._tracker.ranks.values()):
            proc = live_process(info["pid"], None)
            if proc is None or proc.create_time() < self._started_at - 1 \
                    or not catches_signal(proc.pid, STACK_SIGNAL):
                continue
            try:
                os.kill(proc.pid, STACK_SIGNAL)
                sent.append(proc.pid)
            except ProcessLookupError:
                pass
        return sent

    def _abandon(self) -> None:
        """Tests: behave like a dead agent (threads stop, processes and files stay)."""
        self._abandoned.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    # ---- supervision thread --------------------------------------------------------------
    def _spawn_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"supervise-attempt-{self.req.attempt_id}")
        self._thread.start()

    def _call(self, fn: Callable, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception:  # a broken callback must not end supervision
            log.exception("attempt %s: callback %s failed", self.req.attempt_id,
                          getattr(fn, "__name__", fn))
            return False

    def _run(self) -> None:
        poller = select.poll()
        wfd = pidfd(self._wrap.pid) if self._wrap else None
        if wfd is not None:
            poller.register(wfd, select.POLLIN)
        last_snapshot = 0.0
        try:
            while not self._abandoned.is_set():
                self._scan_ranks(poller)
                self._pump_logs(final=False)
                if time.monotonic() - last_snapshot > TREE_SNAPSHOT_S:
                    self._tracker.snapshot_tree()
                    last_snapshot = time.monotonic()
                if self._ended():
                    self._tracker.note_deaths(poller, {fd for fd, _ in poller.poll(0)})
                    break
                ready = {fd for fd, _ in poller.poll(POLL_S * 1000)}
                self._tracker.note_deaths(poller, ready)
            else:
                return  # abandoned: the next agent adopts and reports
            self._finish()
        except Exception as exc:  # a bug here must still end in exactly one on_exit
            log.exception("attempt %s: supervisor crashed", self.req.attempt_id)
            if not self._finished.is_set():
                self._finished.set()
                self._call(self._on_exit, {
                    "attempt_id": self.req.attempt_id, "job_id": self.req.job_id,
                    "node": self.req.node, "exit_code": None, "signal": None,
                    "stopped": False, "lost": True, "failures": [], "log_tail": {},
                    "duration_s": round(time.time() - self._started_at, 3),
                    "error": f"supervisor crashed: {exc!r}"})
        finally:
            if wfd is not None:
                os.close(wfd)
            self._tracker.close()
            self._tailer.close()

    def _ended(self) -> bool:
        if os.path.exists(self._path("exit.json")):
            return True
        return self._wrap is None or self._wrap.process() is None

    def _scan_ranks(self, poller) -> None:
        self._tracker.scan(poller, self._started_at, sandboxed=self.sandboxed)
        if not self._ranks_sent and self._tracker.complete():
            self._ranks_sent = True
            self._call(self._on_ranks, self._tracker.listed())

    def _pump_logs(self, final: bool) -> None:
        ready = (lambda lr: True) if final else (lambda lr: lr in self._tracker.ranks)
        for lr, stream, lines in self._tailer.poll(final=final, ready=ready):
            self._call(self._on_log, self._tracker.rank_of(lr), stream, lines)

    def _finish(self) -> None:
        exit_info = read_json(self._path("exit.json"))
        self._scan_ranks(select.poll())
        self._pump_logs(final=True)  # everything the ranks wrote, before on_exit
        stopped = os.path.exists(self._path("stop_requested"))
        if not self._ranks_sent and self._tracker.ranks:
            self._ranks_sent = True
            self._call(self._on_ranks, self._tracker.listed())
        lost = exit_info is None and not stopped
        if exit_info is None:
            # procwrap died without a word (OOM killer, kill -9): make sure nothing of the
            # attempt runs on unsupervised, then report it lost.
            kill_all(self._tracker.tree_pids(), timeout_s=3.0)
            exit_info = {"exit_code": None, "signal": "SIGKILL" if self._escalated else None,
                         "ended_at": time.time()}
        code = exit_info.get("exit_code")
        failures = [] if code == 0 else collect_failures(
            self._tailer, self._path("torchrun.stderr.log"), self._tracker.rank_of,
            self._tracker.died_at, fallback_ts=exit_info["ended_at"])
        result = {
            "attempt_id": self.req.attempt_id, "job_id": self.req.job_id,
            "node": self.req.node, "exit_code": code, "signal": exit_info.get("signal"),
            "stopped": stopped, "lost": lost, "failures": failures,
            "log_tail": {str(self._tracker.rank_of(lr)): lines
                         for lr, lines in self._tailer.tails().items()},
            "duration_s": round(max(0.0, exit_info["ended_at"] - self._started_at), 3),
        }
        if code != 0:  # rendezvous timeouts, a taken port...: only torchrun's log says so
            result["torchrun_tail"] = tail_lines(self._path("torchrun.stderr.log"), 20)
        if exit_info.get("error"):
            result["error"] = exit_info["error"]
        self._finished.set()
        if self._call(self._on_exit, result):
            Path(self._path("reported")).touch()
