"""Overhead of the SDK's per-step calls: the same small DDP script with and without the SDK lines.

Both sides are the loop at the bottom of this file (`worker`): an MLP (--width hidden units, 3
layers) on fixed random batches, DDP over 2 gloo ranks on the CPU under `torchrun --standalone`,
SGD with momentum, one thread per rank. The SDK side adds exactly the lines of the user guide's
example: `trainyard.init()` (launch config in TRAINYARD_RUN_CONFIG, telemetry into a
redis-server started here), `run.restore`, the data/compute/optim phases, `run.log` with a user
metric, `run.should_checkpoint` / `run.should_stop` (the preemption vote), `run.finish`. Saves
are out of the measured window (checkpoint.every_steps beyond the run; bench/checkpoint.py
measures saves): this is the per-step cost. Runs alternate plain, sdk, plain, sdk ... so drift on
a shared machine hits both sides alike. Throughput from rank 0's end-of-step stamps over the
steps after --warmup: global batch / median step interval (robust to another process taking a
core for a moment), and the wall-clock rate over the same steps.

Prints one JSON object: each side's samples/s (median of the pairs), the ratio sdk / plain (the
issue's target: >= 0.98), the time rank 0 spends in the SDK's per-step calls (log,
should_checkpoint, should_stop) as microseconds and as a share of the plain step, and every pair. Usage:
    python bench/sdk_overhead.py [--pairs 5] [--steps 300] [--warmup 30] [--width 512]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import REPO, free_port, start_redis, throughput  # noqa: E402,F401  (bench/ helpers)

BATCH = 64  # per rank
WORLD = 2
TARGET = 0.98


def launch_config(work: Path, i: int, redis_url: str, steps: int) -> Path:
    run_dir = work / f"sdk-{i}"
    run_dir.mkdir()
    cfg = {"job_id": 1, "attempt_id": i + 1, "node": "bench", "run_dir": str(run_dir),
           "redis_url": redis_url, "stream": f"trainyard:job:1:{i}", "data_root": str(work),
           "checkpoint_dir": str(work / f"ckpt-{i}"), "resume": None,
           "spec": {"name": "sdk-overhead", "entrypoint": {"script": str(Path(__file__).resolve())},
                    "train": {"steps": steps + 1},
                    "resources": {"nodes": 1, "procs_per_node": WORLD, "device": "cpu"},
                    "checkpoint": {"every_steps": 1_000_000}, "config": {"lr": 0.01}}}
    path = run_dir / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def run_side(args, work: Path, i: int, sdk: bool, redis_url: str) -> tuple[float, float, float | None]:
    out = work / f"{'sdk' if sdk else 'plain'}-{i}.timing.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("TRAINYARD_RUN_CONFIG", None)
    if sdk:
        env["TRAINYARD_RUN_CONFIG"] = str(launch_config(work, i, redis_url, args.steps))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
            str(Path(__file__).resolve()), "--worker", "sdk" if sdk else "plain", "--out", str(out),
            "--steps", str(args.steps), "--width", str(args.width)]
    r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    timing = json.loads(out.read_text())
    calls = timing["calls"][args.warmup:]
    return (*throughput(timing["ts"], BATCH * WORLD, args.warmup),
            1e6 * statistics.median(calls) if calls else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--worker", choices=["plain", "sdk"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker == "sdk", args.steps, args.width, Path(args.out))
        return
    with tempfile.TemporaryDirectory(prefix="trainyard-sdk-bench-") as tmp:
        work = Path(tmp)
        (work / "redis").mkdir()
        redis_proc, url = start_redis(work / "redis")
        pairs = []
        try:
            for i in range(args.pairs):
                plain = run_side(args, work, i, False, url)
                sdk = run_side(args, work, i, True, url)
                pairs.append({"plain": [round(v, 1) for v in plain[:2]], "sdk": [round(v, 1) for v in sdk[:2]],
                              "sdk_calls_us": round(sdk[2], 1)})
                print(f"pair {i + 1}/{args.pairs}: plain {plain[0]:.0f} sdk {sdk[0]:.0f} samples/s",
                      file=sys.stderr)
        finally:
            redis_proc.terminate()
            redis_proc.wait(10)
    plain = statistics.median(p["plain"][0] for p in pairs)
    sdk = statistics.median(p["sdk"][0] for p in pairs)
    plain_wall = statistics.median(p["plain"][1] for p in pairs)
    sdk_wall = statistics.median(p["sdk"][1] for p in pairs)
    print(json.dumps({
        "bench": "sdk_overhead", "world_size": WORLD, "backend": "gloo", "device": "cpu",
        "model": f"MLP 3 layers x {args.width}", "batch_per_rank": BATCH, "steps": args.steps,
        "warmup": args.warmup, "plain_samples_per_s": round(plain, 1), "sdk_samples_per_s": round(sdk, 1),
        "ratio": round(sdk / plain, 4), "plain_step_ms": round(1000 * BATCH * WORLD / plain, 3),
        "sdk_step_ms": round(1000 * BATCH * WORLD / sdk, 3),
        "plain_wall_samples_per_s": round(plain_wall, 1), "sdk_wall_samples_per_s": round(sdk_wall, 1),
        "wall_ratio": round(sdk_wall / plain_wall, 4), "target": TARGET,
        # rank 0's median time per step in run.log + should_checkpoint + should_stop (the stop
        # vote included), a figure the machine's load disturbs far less than the throughputs
        "sdk_calls_us_per_step": statistics.median(p["sdk_calls_us"] for p in pairs),
        "sdk_calls_share_of_step": round(statistics.median(p["sdk_calls_us"] for p in pairs) / (1e6 * BATCH * WORLD / plain), 4),
        "pairs": pairs,
    }))


def worker(sdk: bool, steps: int, width: int, out: Path) -> None:
    """One rank of either side; rank 0 writes its end-of-step wall-clock stamps to `out`."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    if sdk:
        import trainyard

        run = trainyard.init()
        rank = run.rank
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(BATCH, width, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(8)]
    loss_fn = nn.CrossEntropyLoss()
    ts, calls = [], []  # calls: seconds per step in log + should_checkpoint + should_stop
    if sdk:
        start = run.restore({"model": model, "optim": opt})
        for step in range(start + 1, steps + 1):
            with run.phase("data"):
                x, y = data[step % len(data)]
            with run.phase("compute"):
                loss = loss_fn(model(x), y)
                loss.backward()
            with run.phase("optim"):
                opt.step()
                opt.zero_grad()
            loss_v = loss.item()
            t_calls = time.perf_counter()
            run.log(step, loss=loss_v, samples=len(x), lr=0.01)
            if run.should_checkpoint(step):
                run.checkpoint(step, {"model": model, "optim": opt})
            if run.should_stop():
                break
            calls.append(time.perf_counter() - t_calls)
            ts.append(time.time())
    else:
        for step in range(1, steps + 1):
            x, y = data[step % len(data)]
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
            ts.append(time.time())
    if rank == 0:
        out.write_text(json.dumps({"ts": ts, "calls": calls}))
    if sdk:
        run.finish()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
