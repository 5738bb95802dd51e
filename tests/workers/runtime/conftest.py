"""Helpers for runtime tests: launch configs, real torchrun runs, reading the job stream."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.conftest import REPO

# The full JobSpec the control plane would hand over for {"name": "x"}, all defaults filled
# (docs/architecture.md, section 7), except resources/parallel sized for one machine.
DEFAULT_SPEC = {
    "name": "x",
    "model": {"kind": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 256},
    "data": {"kind": "demo"},
    "train": {"steps": 200, "global_batch": 32, "lr": 1.0e-3, "warmup_steps": 0,
              "lr_schedule": "constant", "seed": 0, "grad_accum": 1, "balance": "none"},
    "resources": {"nodes": 1, "procs_per_node": 2, "device": "cpu"},
    "parallel": {"dp": 2, "tp": 1, "pp": 1, "fsdp": False, "microbatches": 4, "schedule": "1f1b"},
    "comm": {"compression": "none", "ratio": 0.01, "rank": 2, "start_step": 10, "sync": "allreduce",
             "period": 4, "periods": {"node": 2, "global": 8}},
    "checkpoint": {"every_steps": 50, "async": True, "keep": 3},
    "priority": "normal",
    "max_restarts": 3,
    "hang_timeout_s": "auto",
}

# Small enough for ~25 ms steps on one core, big enough that loss visibly falls in 30 steps.
SMALL_MODEL = {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 256}


def make_launch_config(tmp_path: Path, redis_url: str, **sections) -> dict:
    """A launch config like the agent's; keyword args replace/merge spec sections."""
    spec = copy.deepcopy(DEFAULT_SPEC)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key].update(value)
        else:
            spec[key] = value
    return {
        "job_id": 7, "attempt_id": 9, "node": "node-a",
        "run_dir": str(tmp_path / "run"), "redis_url": redis_url, "stream": "trainyard:job:7",
        "data_root": str(tmp_path / "data"), "checkpoint_dir": str(tmp_path / "ckpt"),
        "spec": spec,
    }


def write_launch_config(tmp_path: Path, cfg: dict) -> Path:
    run_dir = Path(cfg["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def torchrun_argv(config_path: Path, nproc: int = 2, log_dir: Path | None = None,
                  module: str = "workers.runtime") -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc)]
    if log_dir is not None:
        argv += ["--log-dir", str(log_dir)]
    return argv + ["-m", module, "--config", str(config_path)]


def start_torchrun(config_path: Path, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen(torchrun_argv(config_path, **kw), cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def read_stream(url: str, stream: str) -> tuple[list[dict], list[dict], list[tuple]]:
    """(samples, events, raw entries) from a job stream, in stream order."""
    client = redis.Redis.from_url(url)
    try:
        entries = client.xrange(stream)
    finally:
        client.close()
    samples, events, raw = [], [], []
    for entry_id, fields in entries:
        raw.append((entry_id, fields))
        payload = json.loads(fields[b"data"])
        if fields[b"type"] == b"metrics":
            samples.extend(payload)
        else:
            events.append(payload)
    return samples, events, raw


@pytest.fixture
def dead_redis_url():
    """A Redis URL with nothing listening: the port was free a moment ago."""
    from tests.conftest import free_port
    return f"redis://127.0.0.1:{free_port()}/0"
