"""run.prepare for a user's own model, measured side by side in one run.

The model is examples/own_model/train.py's minGPT-style GPT (its own attention,
MLP and block list), 2 gloo ranks on the CPU under `torchrun --standalone`, one thread per rank,
fixed random token windows, AdamW.

1. Overhead: the script wiring DDP itself (`DDP(model)`, plain AdamW, no SDK) against the same
   loop through `run.prepare` + `run.loader` + `run.micro_batches` + `run.log` (telemetry into a
   redis-server started here). Runs alternate hand, prepare, hand, ... so drift on a shared
   machine hits both alike; throughput = global batch / rank 0's median step interval after
   --warmup. Target (issue 23): prepare / hand >= 0.98.
2. Bytes on the wire: through prepare with comm.compression none, topk (ratio 0.01, error
   feedback) and powersgd (rank 4), each after the same 5 dense steps: bytes each rank sent over
   the run, their ratio to none, and the final loss (mean of the last 10 steps) against none's.

Prints one JSON object. Usage:
    python bench/prepare.py [--pairs 3] [--steps 120] [--warmup 20] [--width 128]
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
from overhead import REPO, start_redis  # noqa: E402  (bench/ helpers)

WORLD, BATCH, TARGET = 2, 16, 0.98  # BATCH: the global batch


def launch_config(work: Path, name: str, redis_url: str, steps: int, width: int, comm: dict) -> Path:
    run_dir = work / name
    run_dir.mkdir()
    cfg = {"job_id": 1, "attempt_id": len(list(work.iterdir())), "node": "bench", "run_dir": str(run_dir),
           "redis_url": redis_url, "stream": f"trainyard:job:1:{name}", "data_root": str(work),
           "checkpoint_dir": str(work / f"ckpt-{name}"), "resume": None,
           "spec": {"name": "prepare-bench", "entrypoint": {"script": str(Path(__file__).resolve())},
                    "train": {"steps": steps, "global_batch": BATCH, "seed": 1},
                    "resources": {"nodes": 1, "procs_per_node": WORLD, "device": "cpu"},
                    "checkpoint": {"every_steps": 1_000_000}, "comm": comm, "config": {"width": width}}}
    path = run_dir / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def side(args, work: Path, name: str, redis_url: str, *, prepare: bool, comm: dict | None = None) -> dict:
    out = work / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("TRAINYARD_RUN_CONFIG", None)
    if prepare:
        env["TRAINYARD_RUN_CONFIG"] = str(launch_config(work, name, redis_url, args.steps, args.width, comm or {}))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
            __file__, "--role", "worker", "--out", str(out), "--steps", str(args.steps), "--width", str(args.width)]
    subprocess.run(argv + (["--prepare"] if prepare else []), env=env, check=True, capture_output=True, timeout=900)
    result = json.loads(out.read_text())
    stamps = result["stamps"][args.warmup:]
    result["samples_per_s"] = BATCH / statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    return result


def worker(args) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(REPO / "examples" / "own_model"))
    from train import MinGPT, Windows

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MinGPT(n_embd=args.width, n_layer=2, n_head=4)
    data = Windows(n=BATCH * 64)
    stamps, losses, sent = [], [], 0
    if args.prepare:
        import trainyard

        run = trainyard.init()
        model, opt = run.prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
        loader = run.loader(data)
        for step in range(1, args.steps + 1):
            total = 0.0
            for x, y in run.micro_batches(loader):
                loss = model(x, y)
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            sample = run.log(step, loss=total, samples=loader.batch_size)
            sent += sample["bytes_sent"]
            losses.append(total)
            stamps.append(time.perf_counter())
        run.finish()
    else:  # what a script does by hand: DDP, AdamW, its own sharding of the batch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        share = BATCH // world
        g = torch.Generator().manual_seed(1)
        order = torch.randperm(len(data), generator=g)
        for step in range(1, args.steps + 1):
            idx = order[((step - 1) * BATCH + rank * share) % len(data):][:share].tolist()
            x = torch.stack([data[i][0] for i in idx])
            y = torch.stack([data[i][1] for i in idx])
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            stamps.append(time.perf_counter())
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps({"stamps": stamps, "losses": losses, "bytes_sent": sent}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--role", default="main")
    ap.add_argument("--out")
    ap.add_argument("--prepare", action="store_true")
    args = ap.parse_args()
    if args.role == "worker":
        worker(args)
        return
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        work = Path(tmp)
        redis, redis_url = start_redis(work)
        try:
            pairs = []
            for i in range(args.pairs):
                hand = side(args, work, f"hand-{i}", redis_url, prepare=False)["samples_per_s"]
                prep = side(args, work, f"prepare-{i}", redis_url, prepare=True)["samples_per_s"]
                pairs.append({"hand_samples_per_s": round(hand, 2), "prepare_samples_per_s": round(prep, 2),
                              "ratio": round(prep / hand, 3)})
            comm = {}
            for kind, extra in (("none", {}), ("topk", {"ratio": 0.01}), ("powersgd", {"rank": 4})):
                r = side(args, work, f"comm-{kind}", redis_url, prepare=True,
                         comm={"compression": kind, "start_step": 5, **extra})
                comm[kind] = {"bytes_sent": r["bytes_sent"], "final_loss": statistics.mean(r["losses"][-10:])}
            for kind in ("topk", "powersgd"):
                comm[kind]["bytes_ratio_to_none"] = round(comm[kind]["bytes_sent"] / comm["none"]["bytes_sent"], 4)
                comm[kind]["loss_ratio_to_none"] = round(comm[kind]["final_loss"] / comm["none"]["final_loss"], 4)
        finally:
            redis.terminate()
            redis.wait(10)
    ratio = statistics.median(p["ratio"] for p in pairs)
    print(json.dumps({"bench": "prepare", "world": WORLD, "global_batch": BATCH, "width": args.width,
                      "steps": args.steps, "overhead": {"ratio_median": ratio, "target": TARGET,
                                                        "target_met": ratio >= TARGET, "pairs": pairs},
                      "compression": comm, "wall_s": round(time.time() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
