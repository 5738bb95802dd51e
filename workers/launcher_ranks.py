"""An attempt's ranks and process tree as the launcher's supervisor sees them (workers.launcher).

Who each local rank is (global rank, host pid: from the agent's own rank-<lr>.agent.json, the
rank's ranks/<lr>.json or torchrun's children), when each died (the last check it passed and the
first it failed, by pidfd or psutil), and every process of the tree ever seen, so that what
procwrap leaves behind can still be found and killed if procwrap itself dies.

Runs inside the node agent, on the supervisor's thread (and in stop()): no django/jobs imports.
"""
from __future__ import annotations

import os
import select
import time
from typing import Callable

import psutil

from workers import sandbox
from workers.launch_spec import LaunchRequest
from workers.launcher_logs import read_json, read_run_json
from workers.procwrap import live_process, pidfd, write_json_atomic


def _mtime(path: str) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return time.time()


class RankTracker:
    """The ranks of one attempt on this node and the pids of its process tree.

    descendants: the wrapper's (procwrap's) live descendants now; empty when there is none.
    """

    def __init__(self, req: LaunchRequest, run_dir: str,
                 descendants: Callable[[], list[psutil.Process]]):
        self.req = req
        self.run_dir = run_dir
        self._descendants = descendants
        self.ranks: dict[int, dict] = {}  # local_rank -> {"rank","local_rank","pid","node"}
        self._rank_fds: dict[int, int] = {}  # local_rank -> pidfd
        # local_rank -> (last seen alive, first seen gone): a death we did not witness
        self.died_at: dict[int, tuple[float, float]] = {}
        self._alive_at: dict[int, float] = {}  # local_rank -> last time known running
        self._known: dict[int, float] = {}  # pid -> create_time, every process of the tree

    def _path(self, name: str) -> str:
        return os.path.join(self.run_dir, name)

    def complete(self) -> bool:
        """Every local rank is known."""
        return len(self.ranks) == self.req.nproc

    def listed(self) -> list[dict]:
        """The known ranks, by local rank (what on_ranks gets)."""
        return [self.ranks[lr] for lr in sorted(self.ranks)]

    def scan(self, poller, started_at: float, *, sandboxed: bool) -> None:
        """Learn the ranks not known yet; watch each live one's pidfd on `poller`."""
        for lr in range(self.req.nproc):
            if lr in self.ranks:
                continue
            path = os.path.join(self.run_dir, "ranks", f"{lr}.json")
            # The agent's own record (a host pid) first; then what the rank wrote (its pid in the
            # sandbox: translated); then the tree (a host pid, recorded by the agent).
            info, host = read_json(self._path(f"rank-{lr}.agent.json")), True
            if info is None:
                info, host = read_run_json(self.run_dir, f"ranks/{lr}.json"), False
            if info is None:
                info, host = self._rank_from_tree(lr), True
            try:
                pid = self._host_pid(int(info["pid"]), host=host or not sandboxed)
                self.ranks[lr] = {"rank": int(info["rank"]), "local_rank": lr, "pid": pid,
                                  "node": self.req.node}
            except (TypeError, KeyError, ValueError):  # not written yet, or not the contract
                continue
            self.snapshot_tree()  # the tree is complete enough to remember once ranks run
            proc = live_process(pid, None) if pid > 0 else None
            if proc is None or proc.create_time() < started_at - 1:
                self.died_at.setdefault(lr, (_mtime(path), time.time()))  # gone already
                continue
            self._alive_at[lr] = time.time()
            self._known[proc.pid] = proc.create_time()
            fd = pidfd(proc.pid)
            if fd is not None:
                self._rank_fds[lr] = fd
                poller.register(fd, select.POLLIN)

    def _host_pid(self, pid: int, host: bool) -> int:
        """A rank's pid on this host. A rank in a sandbox reports its pid inside the sandbox's PID
        namespace (and may report any number): translated among this attempt's own processes, or
        -1 when none has it (a rank that already exited, or a made-up pid). host: `pid` needs no
        translation (recorded by the agent, or the attempt is not sandboxed)."""
        if host:
            return pid
        found = sandbox.outer_pid(pid, [p.pid for p in self._descendants()])
        return -1 if found is None else found

    def _rank_from_tree(self, lr: int) -> dict | None:
        """A rank that wrote no ranks/<lr>.json (user code that never imports the SDK): found
        among torchrun's children by the environment torchrun gave it (RANK is its global rank,
        the one the runtime would have written), with its host pid. Recorded in the agent's own
        rank-<lr>.agent.json (not in ranks/, which the job writes), so that an adopting agent and
        the death bookkeeping see it the same way."""
        run_id = f"attempt-{self.req.attempt_id}"
        for proc in self._descendants():
            try:
                env = proc.environ()
                if env.get("TORCHELASTIC_RUN_ID") != run_id or env.get("LOCAL_RANK") != str(lr):
                    continue
                parent = proc.parent()
                if parent is not None and "LOCAL_RANK" in parent.environ():
                    continue  # a process the rank started (a data loader worker): not the rank
                info = {"rank": int(env["RANK"]), "local_rank": lr, "pid": proc.pid,
                        "node": self.req.node, "source": "agent"}
            except (psutil.Error, KeyError, ValueError):
                continue
            write_json_atomic(self._path(f"rank-{lr}.agent.json"), info)
            return info
        return None

    def note_deaths(self, poller, ready: set[int]) -> None:
        """Bracket each rank's death between the last check it passed and the first it failed.

        With pidfds the poll wakes when a rank dies; without, psutil is asked every poll.
        """
        now = time.time()
        for lr, info in self.ranks.items():
            fd = self._rank_fds.get(lr)
            if lr in self.died_at or lr not in self._alive_at:
                continue
            gone = fd in ready if fd is not None else live_process(info["pid"], None) is None
            if not gone:
                self._alive_at[lr] = now
                continue
            self.died_at[lr] = (self._alive_at[lr], now)
            if fd is not None:
                poller.unregister(fd)
                os.close(self._rank_fds.pop(lr))

    def snapshot_tree(self) -> None:
        """Remember the pid and create time of every process of the tree now."""
        for p in self._descendants():
            try:
                self._known.setdefault(p.pid, p.create_time())
            except psutil.Error:
                pass

    def tree_pids(self) -> list[int]:
        """torchrun, ranks and their helpers: procwrap's descendants plus those we saw."""
        pids = {p.pid for p in self._descendants()}
        pids.update(pid for pid, ctime in list(self._known.items())
                    if live_process(pid, ctime) is not None)
        return sorted(pids)

    def rank_of(self, lr: int) -> int:
        """The global rank of local rank `lr`, known or inferred."""
        if lr in self.ranks:
            return self.ranks[lr]["rank"]
        if self.ranks:  # torchrun gives a node one contiguous block of global ranks
            known = next(iter(self.ranks.values()))
            return known["rank"] - known["local_rank"] + lr
        # Nothing reported (the runtime died before writing ranks/): the usual placement.
        return self.req.node_rank * self.req.nproc + lr

    def close(self) -> None:
        """Close the ranks' pidfds (supervision is over)."""
        for fd in self._rank_fds.values():
            os.close(fd)
        self._rank_fds.clear()
