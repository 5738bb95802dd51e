"""run.prepare for a user's own model, measured side by side in one run.

The model is examples/own_model/train.py's minGPT-style GPT (its own attention,
MLP and block list), 2 gloo ranks on the CPU under `torchrun --standalone`, one thread per rank,
fixed random token windows, AdamW.

1. Overhead, for DDP and for FSDP2: the script wiring the plan itself (`DDP(model)`, or
   `fully_shard` on each block and then the root, plain AdamW, its own slice of each global
   batch) against the same loop through `run.prepare` + `run.loader` + `run.micro_batches`. Both
   report every step with `run.log` (telemetry into a redis-server started here), so the ratio is
   what prepare itself costs; `bare` (hand-wired DDP without the SDK at all) is measured alongside,
   so telemetry's own cost shows too. Runs alternate hand, prepare, bare, hand, ... so drift on a
   shared machine hits all alike; throughput = global batch / rank 0's median step interval after
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


def launch_config(work: Path, name: str, redis_url: str, steps: int, width: int, comm: dict,
                  parallel: dict | None = None) -> Path:
    run_dir = work / name
    run_dir.mkdir()
    cfg = {"job_id": 1, "attempt_id": len(list(work.iterdir())), "node": "bench", "run_dir": str(run_dir),
           "redis_url": redis_url, "stream": f"trainyard:job:1:{name}", "data_root": str(work),
           "checkpoint_dir": str(work / f"ckpt-{name}"), "resume": None,
           "spec": {"name": "prepare-bench", "entrypoint": {"script": str(Path(__file__).resolve())},
                    "train": {"steps": steps, "global_batch": BATCH, "seed": 1},
                    "resources": {"nodes": 1, "procs_per_node": WORLD, "device": "cpu"},
                    "checkpoint": {"every_steps": 1_000_000}, "comm": comm, "config": {"width": width},
                    **({"parallel": {"dp": WORLD, **parallel}} if parallel else {})}}
    path = run_dir / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def side(args, work: Path, name: str, redis_url: str, *, mode: str, fsdp: bool = False,
         comm: dict | None = None) -> dict:
    """mode: "prepare" (run.prepare applies the plan), "hand" (the script wires it, the SDK
    reports), "bare" (hand-wired DDP, no SDK)."""
    out = work / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("TRAINYARD_RUN_CONFIG", None)
    if mode != "bare":
        parallel = {"fsdp": True} if fsdp and mode == "prepare" else {}
        env["TRAINYARD_RUN_CONFIG"] = str(launch_config(work, name, redis_url, args.steps, args.width, comm or {},
                                                        parallel))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
            __file__, "--role", "worker", "--out", str(out), "--steps", str(args.steps), "--width", str(args.width),
            "--mode", mode] + (["--fsdp"] if fsdp else [])
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
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
    if args.mode == "prepare":
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
            sent += sample.get("bytes_sent") or 0
            losses.append(total)
            stamps.append(time.perf_counter())
        run.finish()
    else:  # what a script does by hand: DDP or FSDP2, AdamW, its own sharding of the batch
        import torch.distributed as dist

        run = None
        if args.mode == "hand":
            import trainyard

            run = trainyard.init()  # the SDK's process group and telemetry, nothing of prepare
        else:
            dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model.h:
                fully_shard(block, mesh=mesh)
            model = fully_shard(model, mesh=mesh)
        else:
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
            if run is not None:
                run.log(step, loss=losses[-1], samples=share)
            stamps.append(time.perf_counter())
        if run is not None:
            run.finish()
        else:
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
    ap.add_argument("--mode", choices=("prepare", "hand", "bare"), default="prepare")
    ap.add_argument("--fsdp", action="store_true")
    args = ap.parse_args()
    if args.role == "worker":
        worker(args)
        return
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        work = Path(tmp)
        redis, redis_url = start_redis(work)
        try:
            overhead = {}
            for plan in ("ddp", "fsdp"):
                rounds = []
                for i in range(args.pairs):
                    got = {mode: side(args, work, f"{plan}-{mode}-{i}", redis_url, mode=mode,
                                      fsdp=plan == "fsdp")["samples_per_s"]
                           for mode in (("hand", "prepare", "bare") if plan == "ddp" else ("hand", "prepare"))}
                    rounds.append({f"{m}_samples_per_s": round(v, 2) for m, v in got.items()}
                                  | {"ratio": round(got["prepare"] / got["hand"], 3)}
                                  | ({"telemetry_ratio": round(got["hand"] / got["bare"], 3)} if "bare" in got else {}))
                ratio = statistics.median(r["ratio"] for r in rounds)
                overhead[plan] = {"ratio_median": ratio, "target": TARGET, "target_met": ratio >= TARGET,
                                  "rounds": rounds}
                if plan == "ddp":
                    overhead[plan]["telemetry_ratio_median"] = statistics.median(r["telemetry_ratio"] for r in rounds)
            comm = {}
            for kind, extra in (("none", {}), ("topk", {"ratio": 0.01}), ("powersgd", {"rank": 4})):
                r = side(args, work, f"comm-{kind}", redis_url, mode="prepare",
                         comm={"compression": kind, "start_step": 5, **extra})
                comm[kind] = {"bytes_sent": r["bytes_sent"], "final_loss": statistics.mean(r["losses"][-10:])}
            for kind in ("topk", "powersgd"):
                comm[kind]["bytes_ratio_to_none"] = round(comm[kind]["bytes_sent"] / comm["none"]["bytes_sent"], 4)
                comm[kind]["loss_ratio_to_none"] = round(comm[kind]["final_loss"] / comm["none"]["final_loss"], 4)
        finally:
            redis.terminate()
            redis.wait(10)
    print(json.dumps({"bench": "prepare", "world": WORLD, "global_batch": BATCH, "width": args.width,
                      "steps": args.steps, "overhead": overhead,
                      "compression": comm, "wall_s": round(time.time() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
