"""Checkpoint benchmarks, side by side in one run. Prints one JSON object on stdout; progress
goes to stderr.

Sections (`--sections a,b`, default: all):
- save_blocking: for each `--sizes` (MB of state: fp32 weights plus two AdamW-like moment
  tensors per weight, 1/3 each), in a one-rank gloo group (FileStore; a group of its own, as the
  runtime's checkpoints use), every variant once per repeat, in rotating order:
    sync         dcp.save, then os.fsync of every written file and the directory (the writer
                 already fsyncs its files; the extra pass makes "on disk" explicit): what a
                 synchronous save blocks training for;
    async        dcp.async_save as the runtime calls it (workers/runtime/checkpoint.make_stager:
                 one stager reused across saves): `async_blocking_s` is the call itself (staging
                 the CPU copy: what the training thread waits for), `async_total_s` until its
                 future is done. Measured after one unmeasured first save, whose blocking is
                 `async_first_blocking_s` (it stages into fresh pages);
    async_fresh  plain dcp.async_save (a new stager per call): `async_fresh_blocking_s`.
  Per size, medians over `--repeats`: {"mb", "sync_s", "async_blocking_s", "async_total_s",
  "ratio_blocking_to_sync", ...}; "target_met": ratio <= 0.10 at every size >= 100 MB.
- recovery: bench/recovery.py: SIGKILL one rank of the demo job on a real Trainyard (Redis,
  daphne, Celery, relay, two agents), time to its first new step with the breakdown (detection,
  scheduling, process start, checkpoint load), beside the same job's cold start.
Everything is written under a temporary directory in /tmp, removed at the end.

Usage: python bench/checkpoint.py [--sizes 10,100,500] [--repeats 3] [--sections save_blocking,recovery]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workers.runtime.checkpoint import make_stager  # noqa: E402  (the runtime's staging setup)

TENSOR_MB = 16  # a 2048 x 2048 fp32 matrix: about one transformer layer's weight at hidden 2048
TARGET_RATIO, TARGET_MIN_MB = 0.10, 100


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_state(mb: int) -> dict:
    """~`mb` MB: weights and two moment tensors of the same shapes (AdamW's exp_avg/exp_avg_sq)."""
    n = max(1, round(mb / 3 / TENSOR_MB))
    rows = max(1, round(mb * 2**20 / 3 / n / 4 / 2048))
    weights = {f"layer{i}.weight": torch.randn(rows, 2048) for i in range(n)}
    moments = {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v),
                   "step": torch.tensor(100.0)} for k, v in weights.items()}
    return {"model": weights, "optim": {"state": moments}, "trainer": {"step": 100}}


def state_mb(state: dict) -> float:
    def walk(x):
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        return sum(walk(v) for v in x.values()) if isinstance(x, dict) else 0
    return walk(state) / 2**20


def fsync_tree(path: Path) -> None:
    for p in path.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_blocking(args, work: Path) -> dict:
    dist.init_process_group("gloo", store=dist.FileStore(str(work / "store"), 1), rank=0,
                            world_size=1)
    try:
        group = dist.new_group(backend="gloo")  # as the runtime: a group of the checkpoint's own
        sizes = [_save_blocking_size(args, work, group, mb) for mb in args.sizes]
    finally:
        dist.destroy_process_group()
    big = [s for s in sizes if s["mb"] >= TARGET_MIN_MB * 0.95]
    return {"sizes": sizes, "repeats": args.repeats, "world_size": 1, "backend": "gloo",
            "target": f"ratio_blocking_to_sync <= {TARGET_RATIO} at >= {TARGET_MIN_MB} MB",
            "target_met": bool(big) and all(s["ratio_blocking_to_sync"] <= TARGET_RATIO for s in big)}


def _save_blocking_size(args, work: Path, group, mb: int) -> dict:
    state = make_state(mb)
    stager = make_stager(torch.device("cpu"))  # the runtime's: one per run, reused across saves
    times: dict[str, list[float]] = {k: [] for k in (
        "sync_s", "async_blocking_s", "async_total_s", "async_fresh_blocking_s")}

    def sync(path: Path) -> None:
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path, process_group=group)
        fsync_tree(path)
        times["sync_s"].append(time.perf_counter() - t0)

    def async_(path: Path, stager=stager, key="async_blocking_s") -> float:
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=path, process_group=group, async_stager=stager)
        times.setdefault(key, []).append(time.perf_counter() - t0)
        future.result()
        return time.perf_counter() - t0

    def async_runtime(path: Path) -> None:
        times["async_total_s"].append(async_(path))

    def async_fresh(path: Path) -> None:  # plain async_save: a new stager, fresh pages, each call
        async_(path, stager=None, key="async_fresh_blocking_s")

    first = work / f"first-{mb}"
    async_(first, key="first")  # the runtime's first save stages into fresh memory
    shutil.rmtree(first)
    first_s = times.pop("first")[0]
    variants = [sync, async_runtime, async_fresh]
    for rep in range(args.repeats):
        # rotate the order, so writeback left by the one before hits every variant alike
        for fn in variants[rep % 3:] + variants[:rep % 3]:
            path = work / f"{fn.__name__}-{mb}-{rep}"
            fn(path)
            shutil.rmtree(path)
        log(f"save_blocking {mb} MB #{rep + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()))
    stager.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"mb": round(state_mb(state), 1), **{k: round(v, 4) for k, v in med.items()},
            "async_first_blocking_s": round(first_s, 4),
            "ratio_blocking_to_sync": round(med["async_blocking_s"] / med["sync_s"], 4),
            "ratio_fresh_blocking_to_sync": round(med["async_fresh_blocking_s"] / med["sync_s"], 4)}


# name -> function(args, work_dir) -> JSON-able dict; each section sets up what it needs.
def recovery(args, work: Path) -> dict:
    """SIGKILL of a rank -> the first new step, on a real single-machine Trainyard (bench/recovery.py)."""
    import recovery as rec  # bench/ is on sys.path when this file runs as a script

    return rec.measure(log=log)


SECTIONS = {"save_blocking": save_blocking, "recovery": recovery}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, from {sorted(SECTIONS)}")
    parser.add_argument("--sizes", default="10,100,500", help="state sizes in MB for save_blocking")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {sorted(SECTIONS)}")

    work = Path(tempfile.mkdtemp(prefix="trainyard-bench-ckpt-", dir="/tmp"))
    out: dict = {"torch": torch.__version__}
    try:
        for name in sections:
            log(f"== {name}")
            out[name] = SECTIONS[name](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
