"""What the GPU checks share: the device under test, a Redis for the runtime's telemetry, and
running `python -m workers.runtime` (or any module) under a real torchrun.

GPU_CHECKS_DEVICE (set by bench/gpu_checks.py): cuda, or cpu for a dry run on CPU/gloo of the
checks that do not need CUDA itself.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Skip(Exception):
    """The check cannot run here; the message says why."""


def device() -> str:
    return os.environ.get("GPU_CHECKS_DEVICE", "cuda")


def need_cuda() -> None:
    if device() != "cuda":
        raise Skip("needs CUDA itself (no CPU dry run)")


def env() -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    paths = [str(REPO)] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**base, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as d:
        yield Path(d)


@contextlib.contextmanager
def redis_server(where: Path) -> Iterator[str]:
    """A real redis-server on a free loopback port (the tests' fixture class); yields its URL."""
    from tests.conftest import RedisServer
    server = RedisServer(where / "redis").start()
    try:
        yield server.url
    finally:
        server.stop()


def torchrun(module: str, args: list[str], *, nproc: int, cwd: Path, log_dir: Path | None = None,
             extra_env: dict | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if log_dir is not None:
        argv += ["--log-dir", str(log_dir)]
    argv += ["-m", module, *args]
    return subprocess.run(argv, cwd=REPO, env={**env(), **(extra_env or {})}, capture_output=True,
                          text=True, timeout=timeout_s)


def run_training(where: Path, redis_url: str, name: str, *, nproc: int, job_id: int = 1,
                 extra_env: dict | None = None, timeout_s: float = 120, **sections) -> dict:
    """One `workers.runtime` job to completion on device(): its per-(rank, step) samples, the
    ranks' "finished" lines and the process's exit code and output tail."""
    from tests.workers.runtime.conftest import make_launch_config, read_stream, write_launch_config
    from tests.workers.runtime.conftest import SMALL_MODEL
    sections.setdefault("model", SMALL_MODEL)
    sections["resources"] = {"nodes": 1, "procs_per_node": nproc, "device": device(),
                             **sections.get("resources", {})}
    sections.setdefault("parallel", {"dp": nproc, "tp": 1, "pp": 1, "fsdp": False})
    cfg = make_launch_config(where / name, redis_url, **sections)
    cfg.update(job_id=job_id, stream=f"trainyard:job:{job_id}")
    proc = torchrun("workers.runtime", ["--config", str(write_launch_config(where / name, cfg))],
                    nproc=nproc, cwd=where, extra_env=extra_env, timeout_s=timeout_s)
    samples, events, _ = read_stream(redis_url, cfg["stream"])
    text = proc.stdout + proc.stderr
    finished = [line for line in text.splitlines() if " finished steps " in line]
    return {"rc": proc.returncode, "samples": {(s["rank"], s["step"]): s for s in samples},
            "events": events, "finished": finished, "tail": text[-3000:]}


def losses(run: dict, rank: int = 0) -> list[float]:
    return [s["loss"] for (r, _step), s in sorted(run["samples"].items()) if r == rank]


def dumps(obj) -> str:
    return json.dumps(obj, default=str)
