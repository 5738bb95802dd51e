"""The harness: the matmul sweep in this process, then one torchrun of worker.py for the
collectives and the run grid, assembled into trainyard/calibration.py's document (validated
before it is written).

Ranks: 2 on CPU (a collective needs two; each rank gets the one thread a slot gets,
OMP_NUM_THREADS=1 as the launcher sets), one per GPU on CUDA. torchrun is started with an argv
list on 127.0.0.1 (--standalone: a c10d rendezvous on a free local port) under a timeout.
"""
from __future__ import annotations

import collections
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from trainyard.calibration import VERSION, parse_measurements

from . import matmul

CPU_PROCS = 2
THREADS_PER_PROC = 1
TIMEOUT_S = {True: 300, False: 1200}  # quick, default


def _kill_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """torchrun and its ranks (each rank in a session of its own, so not in torchrun's group):
    SIGTERM torchrun (it stops its ranks), then SIGKILL whatever of the tree is left."""
    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.Error:
        return
    try:
        tree[0].send_signal(signal.SIGTERM)
    except psutil.Error:
        pass
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


class HarnessError(RuntimeError):
    """The distributed part failed or timed out; the message holds its output's tail."""


def device_info() -> dict:
    cuda = torch.cuda.is_available()
    return {"name": torch.cuda.get_device_name(0) if cuda else "cpu", "kind": "cuda" if cuda else "cpu",
            "procs": torch.cuda.device_count() if cuda else CPU_PROCS,
            "threads_per_proc": THREADS_PER_PROC, "host": platform.node()[:255],
            "torch": torch.__version__.split("+")[0]}


def distributed_part(procs: int, quick: bool, timeout_s: float, log=print) -> dict:
    """torchrun of worker.py with `procs` ranks; its rank 0's JSON."""
    with tempfile.TemporaryDirectory(prefix="trainyard-calibrate-") as tmp:
        out = Path(tmp) / "dist.json"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(procs), "-m", "workers.calibrate.worker", "--out", str(out)]
        if quick:
            argv.append("--quick")
        env = {**os.environ, "OMP_NUM_THREADS": str(THREADS_PER_PROC), "MASTER_ADDR": "127.0.0.1",
               "PYTHONWARNINGS": "ignore::FutureWarning"}
        repo = Path(__file__).resolve().parents[2]  # workers.calibrate importable from there
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
        # its output is read as it comes (progress lines logged live, the rest kept for an
        # error); a timer takes torchrun and its ranks down at the timeout
        proc = subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        fired = threading.Event()

        def on_timeout() -> None:
            fired.set()
            _kill_tree(proc)
        timer = threading.Timer(timeout_s, on_timeout)
        timer.start()
        kept: collections.deque[str] = collections.deque(maxlen=200)
        try:
            for line in proc.stdout:
                if line.startswith(("run ", "collectives:")):
                    log(line.rstrip())
                kept.append(line)
            rc = proc.wait()
        finally:
            timer.cancel()
            timer.join()  # a kill under way completes first
            if proc.poll() is None:  # the reading failed: take torchrun and its ranks down too
                _kill_tree(proc)
                proc.wait()
        if fired.is_set():
            raise HarnessError(f"torchrun did not finish in {timeout_s:.0f} s\n{''.join(kept)[-2000:]}")
        if rc != 0 or not out.exists():
            raise HarnessError(f"torchrun exited {rc}\n{''.join(kept)[-4000:]}")
        return json.loads(out.read_text())


def measure(quick: bool, timeout_s: float | None = None, log=print, procs: int | None = None) -> tuple[dict, dict]:
    """The validated measurement document and the wall time of each part (seconds). The default
    sweep measures the GEMMs before and again after the distributed part and keeps each
    shape's better median (as the run grid keeps each point's faster pass). `procs`: ranks of the
    distributed part instead of the node's devices (more than its cores oversubscribes it)."""
    torch.set_num_threads(THREADS_PER_PROC)
    info = device_info()
    if procs:
        info["procs"] = procs
    device = torch.device("cuda", 0) if info["kind"] == "cuda" else torch.device("cpu")
    walls = {"matmul_s": 0.0}

    def gemms() -> list[dict]:
        t0 = time.perf_counter()
        pts = matmul.sweep(device, quick)
        walls["matmul_s"] += time.perf_counter() - t0
        log(f"matmul: {len(pts)} shapes, best {max(p['tflops'] for p in pts):.3f} TFLOP/s "
            f"({time.perf_counter() - t0:.1f} s)")
        return pts
    points = gemms()
    t0 = time.perf_counter()
    dist_part = distributed_part(info["procs"], quick, timeout_s or TIMEOUT_S[quick], log)
    walls["distributed_s"] = time.perf_counter() - t0
    if not quick:
        points = [max(a, b, key=lambda p: p["tflops"]) for a, b in zip(points, gemms())]
    doc = {"version": VERSION, "device": info, "matmul": points, **dist_part}
    parse_measurements(doc)  # what is written is what the control plane accepts
    return doc, walls
