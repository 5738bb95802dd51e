"""Runs examples/heal/train.py as a heal-in-place job through real processes: a lighthouse
(`python -m trainyard.sdk.heal lighthouse`) and two replicas, each under its own torchrun with
--max-restarts; SIGKILLs replica 1's rank after a step and waits for both to finish.
Used by tests/workers/runtime/test_heal.py and bench/recovery.py (its `heal` case)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "heal" / "train.py"


@dataclass
class HealRun:
    codes: list[int | None]  # the two torchruns' exit codes
    replicas: list[list[dict]]  # each replica's JSON lines
    killed_step: int  # replica 1's last committed step before the kill
    killed_at: float
    log_tail: str

    @property
    def after_restart(self) -> list[dict]:
        rows = self.replicas[1]
        return rows[max(i for i, x in enumerate(rows) if x["event"] == "up"):]

    @property
    def heal(self) -> dict | None:
        return next((x for x in self.after_restart if x["event"] == "healed"), None)

    @property
    def kill_to_first_healed_step_s(self) -> float | None:
        t = next((x["t"] for x in self.after_restart if x["event"] == "step" and x["committed"]), None)
        return None if t is None else t - self.killed_at

    @property
    def digests(self) -> list[str | None]:
        return [next((x["digest"] for x in rows if x["event"] == "done"), None) for rows in self.replicas]


def committed(rows: list[dict]) -> list[int]:
    return [x["step"] for x in rows if x["event"] == "step" and x["committed"]]


def retried(rows: list[dict]) -> list[int]:
    return [x["step"] for x in rows if x["event"] == "step" and not x["committed"]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _worker(torchrun: subprocess.Popen) -> psutil.Process | None:
    try:
        kids = psutil.Process(torchrun.pid).children(recursive=True)
    except psutil.Error:
        return None
    return next((k for k in kids if str(SCRIPT) in " ".join(k.cmdline())), None)


def _wait(cond, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def kill_one_replica(tmp: Path, *, steps: int, kill_after_step: int, sleep_s: float = 0.03) -> HealRun:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", RUST_LOG="warn",
               TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", TRAINYARD_HEAL_REPLICAS="2")
    outs = [tmp / f"replica-{r}.jsonl" for r in (0, 1)]
    procs: list[subprocess.Popen] = []
    try:
        with open(tmp / "lighthouse.log", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "trainyard.sdk.heal", "lighthouse", "--bind",
                                           f"127.0.0.1:{port}"], env=env, stdout=subprocess.PIPE, stderr=log))
        assert procs[0].stdout.readline(), "the lighthouse did not start"
        for r in (0, 1):
            with open(tmp / f"torchrun-{r}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                     "--max-restarts", "2", "--monitor-interval", "0.1", str(SCRIPT), "--steps", str(steps),
                     "--sleep", str(sleep_s), "--out", str(outs[r])],
                    env=dict(env, TRAINYARD_HEAL_REPLICA=str(r)), stdout=log, stderr=subprocess.STDOUT))
        _wait(lambda: any(x.get("step", 0) >= kill_after_step and x.get("committed") for x in _rows(outs[1])), 120,
              f"replica 1 at step {kill_after_step}")
        victim = _wait(lambda: _worker(procs[2]), 10, "replica 1's rank")
        killed_at = time.time()
        killed_step = max(committed(_rows(outs[1])))
        victim.send_signal(signal.SIGKILL)
        codes = []
        for p in procs[1:]:
            try:
                codes.append(p.wait(timeout=180))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return HealRun(codes=codes, replicas=[_rows(o) for o in outs], killed_step=killed_step, killed_at=killed_at,
                   log_tail=(tmp / "torchrun-1.log").read_text(errors="replace")[-3000:])
