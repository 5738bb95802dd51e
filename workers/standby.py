"""Standby launchers: interpreters with torch and the runtime imported, started by the node agent
ahead of need for the next attempt of a job that runs on this node (issue 24: recovery).

Once an attempt of the built-in runtime has all its ranks up here, the agent starts one standby for
its job: procwrap -> bwrap -> `python -m workers.warmrun --standby <dir>/go.json`, which imports
and waits. When the next attempt of that job is launched here on the same slots (a restart after a
failure lands on the same healthy nodes), the agent hands it over instead of starting a launcher:
it writes the attempt's config.json and go.json in place (the files the sandbox binds) and
supervises the standby's wrapper as the attempt's (Supervisor.take_over). Its ranks are forks of a
launcher that had finished importing before the failure, so a restart waits only for the
rendezvous.

Isolation is that of any attempt (workers/sandbox.py): the standby runs in a sandbox of its own as
a uid of its own, from a range reserved at the top of the agent's id range (no attempt's uid: those
are UID_BASE + attempt id, and attempt ids never come near it), that no live process holds, with
its job's gid (the job's checkpoints); it binds only its own directory, the job's checkpoint
directory and what every sandbox binds. Until the hand-over it has no credential and no attempt
environment: it has run only imports. It becomes exactly one attempt, then ends with it.

A standby that no launch takes is stopped: when a launch for its job does not fit it (other slots,
another interpreter), when its job has had no attempt here for STANDBY_TTL_S, and with the agent.
A new agent stops those an earlier one left (their directories are named standby-*).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainyard.private import private_dir, write_private
from workers import sandbox
from workers.launch_spec import SYSTEM_PATH, LaunchRequest, build_argv, build_env
from workers.launcher import Supervisor
from workers.procwrap import WrapperHandle, kill_all, live_process

log = logging.getLogger("trainyard.agent.standby")
STANDBY_TTL_S = 60.0
STANDBY_IDS = 4096  # the top of the agent's id range: the standbys' uids
STANDBY_NICE = 10  # its imports yield the CPU to the attempt training beside it; 0 again at hand-over
STANDBY_DELAY_S = 3.0  # after the attempt's ranks are up: their first steps (the resumed run's) go first


@dataclass
class Standby:
    job_id: int
    fits: tuple  # what a launch must match: (slots, device, interpreter, cores per slot)
    run_dir: str
    plan: "sandbox.SandboxPlan | None"
    wrap: WrapperHandle
    idle_since: float | None = None  # its job had no attempt here from then on


def fits(req: LaunchRequest) -> tuple:
    return (tuple(req.slots), req.device, req.interpreter, req.cores_per_slot)


def standby_uid(cfg: sandbox.SandboxConfig, taken: set[int]) -> int | None:
    """A uid from the standbys' range that no live process holds and `taken` does not name."""
    if cfg.id_range <= 2 * STANDBY_IDS:
        return None
    live = set()
    for p in psutil.process_iter(["uids"]):
        uids = p.info.get("uids")
        if uids:
            live.update(uids)
    top = cfg.uid_base + cfg.id_range - 1
    free = [top - k for k in range(STANDBY_IDS) if top - k not in live | taken]
    return random.choice(free) if free else None


def write_in_place(path: str, text: str) -> None:
    """Rewrite a file the sandbox binds (it sees the inode, so no rename): truncate, write, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def spawn(req: LaunchRequest, plan: "sandbox.SandboxPlan | None") -> WrapperHandle:
    """Start a standby for `req` (the request of the attempt it is for, with its own run_dir; its
    attempt fields unused): procwrap, and in it bwrap and the waiting launcher."""
    run_dir = req.run_dir
    for name in sandbox.SANDBOX_DIRS:
        os.makedirs(os.path.join(run_dir, name), mode=0o700, exist_ok=True)
    go, config = os.path.join(run_dir, "go.json"), req.config_path
    write_private(go, "")
    write_private(config, "")
    sandboxed = plan is not None and plan.enabled
    env = build_env(req, passes=plan.cfg.passes if plan else (lambda name: False), user=plan.user if plan else "")
    argv = [req.interpreter, "-m", "workers.warmrun", "--standby", go]
    wrap = [sys.executable, "-m", "workers.procwrap", "--exit-file", os.path.join(run_dir, "exit.json")]
    if sandboxed:
        plan.prepare()  # config.json: its uid's alone, 0400; go.json the same
        os.chown(go, plan.uid, plan.gid, follow_symlinks=False)
        os.chmod(go, 0o400)
        bwrap, options, command = plan.command(env, argv, req.cwd)
        args_path = os.path.join(run_dir, "sandbox.args")
        write_private(args_path, sandbox.encode_args(options).decode())
        cmd = [*wrap, "--sandbox-args", args_path, "--", bwrap, "--", *command]
        outer = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "PYTHONPATH": sandbox.REPO_ROOT.as_posix()}
        cwd = "/"
    else:
        cmd, outer, cwd = [*wrap, "--", *argv], env, req.cwd
    with open(os.path.join(run_dir, "torchrun.stdout.log"), "ab") as out, \
            open(os.path.join(run_dir, "torchrun.stderr.log"), "ab") as err:
        popen = subprocess.Popen(cmd, env=outer, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 start_new_session=True, cwd=cwd, preexec_fn=lambda: os.nice(STANDBY_NICE))
    p = live_process(popen.pid, None)
    handle = WrapperHandle(popen.pid, p.create_time() if p else None, popen)
    write_private(os.path.join(run_dir, "standby.json"),
                  json.dumps({"wrapper_pid": handle.pid, "wrapper_create_time": handle.create_time}))
    return handle


def hand_over(sb: Standby, req: LaunchRequest, go: dict) -> None:
    """Give the standby its attempt: its priority back, the attempt's config.json, then go.json
    (which starts it)."""
    for p in [*sb.wrap.descendants(), sb.wrap.process()]:
        try:
            if p is not None:
                p.nice(0)  # the agent is root (a sandboxing agent must be); unsandboxed it may not be
        except psutil.Error as exc:
            log.warning("standby %s keeps nice %s: %s", sb.run_dir, STANDBY_NICE, exc)
            break
    write_in_place(req.config_path, json.dumps(req.config))
    write_in_place(os.path.join(sb.run_dir, "go.json"), json.dumps(go))


def launch_in(sb: Standby, req: LaunchRequest, cbs: dict, marker: Path) -> Supervisor | None:
    """Start req's attempt in the standby `sb` and supervise it; None if `marker` (the attempt's
    own `launched`, which refuses a second launch) is taken already."""
    req = dataclasses.replace(req, run_dir=sb.run_dir, config=dict(req.config, run_dir=sb.run_dir))
    plan = sb.plan if sb.plan is not None and sb.plan.enabled else None
    env = build_env(req, passes=plan.cfg.passes if plan else (lambda name: False), user=plan.user if plan else "")
    go = {"argv": build_argv(req, req.config_path, os.path.join(sb.run_dir, "logs"))[3:], "env": env, "cwd": req.cwd}
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None
    sup = Supervisor.take_over(req, sb.wrap, **cbs, sandbox=plan)
    if sup is not None:
        hand_over(sb, req, go)
    return sup


def stop(wrap: WrapperHandle, run_dir: str) -> None:
    """End a standby that no attempt took, and remove its directory."""
    kill_all([p.pid for p in wrap.descendants()] + [wrap.pid], timeout_s=3.0)
    wrap.wait(2.0)
    shutil.rmtree(run_dir, ignore_errors=True)


class Standbys:
    """The agent's standbys, at most one per job."""

    def __init__(self, run_base: Path, cfg: sandbox.SandboxConfig):
        self.run_base, self.cfg = run_base, cfg
        self._by_job: dict[int, Standby] = {}
        self._launched: dict[int, tuple[LaunchRequest, sandbox.SandboxPlan]] = {}  # attempt -> what a standby copies
        self._lock = threading.Lock()

    def clean_leftovers(self) -> None:
        """Stop the standbys an earlier agent process left (never handed over: no supervisor.json)."""
        for d in self.run_base.glob("standby-*"):
            info = {}
            try:
                info = json.loads((d / "standby.json").read_text())
            except (OSError, ValueError):
                pass
            if (d / "supervisor.json").exists():
                continue  # handed over: an attempt's, adopted like any other
            if info.get("wrapper_pid"):
                stop(WrapperHandle(info["wrapper_pid"], info.get("wrapper_create_time")), str(d))
            else:
                shutil.rmtree(d, ignore_errors=True)

    def start(self, req: LaunchRequest, attempt_plan: "sandbox.SandboxPlan") -> None:
        """A standby for the next attempt of req's job, like req (same slots and interpreter) in a
        sandbox like `attempt_plan`'s, with its own directory and uid. Logs and gives up on errors."""
        with self._lock:
            if req.job_id in self._by_job:
                return
            taken = {sb.plan.uid for sb in self._by_job.values() if sb.plan is not None}
        uid = standby_uid(self.cfg, taken) if self.cfg.enabled else 0
        if uid is None:
            return
        run_dir = str(private_dir(self.run_base / f"standby-{req.job_id}-{int(time.time() * 1000)}"))
        proto = dataclasses.replace(req, run_dir=run_dir, config={})
        try:
            mounts = dataclasses.replace(attempt_plan.mounts, run_dir=run_dir, extra_ro=(
                *attempt_plan.mounts.extra_ro, os.path.join(run_dir, "go.json")))
            plan = dataclasses.replace(attempt_plan, mounts=mounts, uid=uid)
            wrap = spawn(proto, plan)
        except (sandbox.SandboxUnavailable, OSError, ValueError) as exc:
            log.warning("no standby for job %s: %s", req.job_id, exc)
            shutil.rmtree(run_dir, ignore_errors=True)
            return
        with self._lock:
            self._by_job[req.job_id] = Standby(req.job_id, fits(req), run_dir, plan, wrap)
        log.info("standby for job %s started (%s)", req.job_id, run_dir)

    def ranks_up(self, attempt_id: int, delay_s: float = STANDBY_DELAY_S) -> None:
        """An attempt's ranks are up here: in delay_s, if it still runs here, start (in a thread) a
        standby for its job's next attempt."""
        def later() -> None:
            time.sleep(delay_s)
            with self._lock:
                req, plan = self._launched.get(attempt_id, (None, None))
            if req is not None:
                self.start(req, plan)

        threading.Thread(target=later, daemon=True, name=f"standby-for-{attempt_id}").start()

    def forget(self, attempt_id: int) -> None:
        with self._lock:
            self._launched.pop(attempt_id, None)

    def take(self, req: LaunchRequest, plan: "sandbox.SandboxPlan") -> Standby | None:
        """The live standby for req's job if it fits req (req and its sandbox `plan` are kept for
        the next one); one that does not fit is stopped."""
        with self._lock:
            self._launched[req.attempt_id] = (req, plan)
            sb = self._by_job.pop(req.job_id, None)
        if sb is None:
            return None
        if sb.fits == fits(req) and sb.wrap.process() is not None and not os.path.exists(
                os.path.join(sb.run_dir, "exit.json")):
            return sb
        self.discard(sb)
        return None

    def discard(self, sb: Standby) -> None:
        threading.Thread(target=stop, args=(sb.wrap, sb.run_dir), daemon=True).start()

    def expire(self, running_jobs: set[int], ttl_s: float = STANDBY_TTL_S) -> list[int]:
        """Stop standbys whose job has had no attempt here for ttl_s (or whose launcher died)."""
        try:
            return self._expire(running_jobs, ttl_s)
        except Exception:  # called from the heartbeat thread, which must go on
            log.exception("standby expiry failed")
            return []

    def _expire(self, running_jobs: set[int], ttl_s: float) -> list[int]:
        now = time.time()
        with self._lock:
            for j, sb in self._by_job.items():  # idle from the first check that finds its job gone from here
                sb.idle_since = None if j in running_jobs else (sb.idle_since or now)
            gone = [j for j, sb in self._by_job.items() if sb.wrap.process() is None or (
                sb.idle_since is not None and now - sb.idle_since > ttl_s)]
            done = [self._by_job.pop(j) for j in gone]
        for sb in done:
            stop(sb.wrap, sb.run_dir)
        return gone

    def stop_all(self) -> None:
        with self._lock:
            done, self._by_job = list(self._by_job.values()), {}
        for sb in done:
            stop(sb.wrap, sb.run_dir)
