"""What parallel.recompute full and parallel.shard_optimizer cost and save, on the demo GPT.

1. `activations` (one process, one thread, in-process): the demo job's GPT (4 layers, hidden
   128, heads 4, seq 128, vocab 256) on one rank's micro-batch of the demo job (global batch 32
   over dp 2 = 16 samples): bytes of the distinct non-parameter tensors autograd keeps for the
   backward (torch.autograd.graph.saved_tensors_hooks; with recompute full torch's checkpoint
   saves each block's input through the same hooks), and how much a fresh child process's RSS
   grows over its first forward (`--rss-worker`: activations held, before the backward),
   and the forward+backward time of that micro-batch, none and full interleaved `--reps` times
   (median and minimum; interleaving and the minimum resist other work on a shared machine).
2. `runs` (the real runtime: `python -m workers.runtime` under torchrun, 2 gloo ranks, a
   redis-server started here): the demo job with recompute none/full x shard_optimizer
   false/true, alternating `--rounds` times so drift hits every variant alike: rank 0's median
   step_s after `--warmup` steps, each rank's optimizer bytes (the `rank_plan` event) and its
   peak RSS (mem_bytes).

Prints one JSON object (progress on stderr).
Usage: python bench/recompute_zero.py [--rounds 3] [--steps 40] [--warmup 10] [--reps 30] [--skip-runs]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from overhead import REPO, start_redis  # bench/ is sys.path[0]

sys.path.insert(0, str(REPO))

MODEL = {"kind": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 256}
MICRO_BATCH = 16  # the demo job's per-rank batch: global 32 over dp 2
VARIANTS = [("none", False), ("full", False), ("none", True), ("full", True)]


def _batch():
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab"], (MICRO_BATCH, MODEL["seq_len"] + 1), generator=g)


def saved_bytes(recompute: bool) -> dict:
    import torch

    from trainyard.spec import ModelSpec
    from workers.runtime.model import build_model, lm_loss

    torch.manual_seed(0)
    model = build_model(ModelSpec(**MODEL), recompute=recompute)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    x = _batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    return {"saved_tensor_bytes": sum(seen.values()), "saved_tensors": len(seen)}


def rss_worker(recompute: str) -> None:
    """A fresh process: how much its RSS grows while a forward's activations are held (after the
    forward, before the backward), after one warm-up step (lazy initialisation), printed as JSON.
    Run with a fixed glibc mmap threshold (activations()), so every tensor over 64 KiB is its own
    mapping, returned on free: RSS then follows the live tensors instead of malloc's arenas."""
    import psutil
    import torch

    from trainyard.spec import ModelSpec
    from workers.runtime.model import build_model, lm_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(ModelSpec(**MODEL), recompute=recompute == "full")
    x = _batch()
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()  # warm-up: lazy initialisation, gradients
    proc = psutil.Process()
    before = proc.memory_info().rss
    loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    held = proc.memory_info().rss - before
    loss.backward()
    print(json.dumps({"rss_growth_after_forward_bytes": held}))


def fwd_bwd_seconds(reps: int) -> dict:
    import time

    import torch

    from trainyard.spec import ModelSpec
    from workers.runtime.model import build_model, lm_loss

    models = {}
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        models[recompute] = build_model(ModelSpec(**MODEL), recompute=recompute == "full")
    x = _batch()
    times: dict[str, list[float]] = {"none": [], "full": []}
    for rep in range(reps + 2):  # the first two rounds warm up
        for recompute, model in models.items():
            t0 = time.perf_counter()
            lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
            model.zero_grad(set_to_none=True)
            if rep >= 2:
                times[recompute].append(time.perf_counter() - t0)
    out = {k: {"median_s": round(statistics.median(v), 5), "min_s": round(min(v), 5)} for k, v in times.items()}
    out["cost_median"] = round(out["full"]["median_s"] / out["none"]["median_s"] - 1, 4)
    out["cost_min"] = round(out["full"]["min_s"] / out["none"]["min_s"] - 1, 4)
    return out


def activations(reps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    out = {"fwd_bwd": fwd_bwd_seconds(reps)}
    for recompute in ("none", "full"):
        child = subprocess.run([sys.executable, __file__, "--rss-worker", recompute], cwd=REPO,
                               env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536"),
                               capture_output=True, text=True,
                               check=True)
        out[recompute] = {**saved_bytes(recompute == "full"), **json.loads(child.stdout)}
    none, full = out["none"]["saved_tensor_bytes"], out["full"]["saved_tensor_bytes"]
    out["saved_fraction"] = round(1 - full / none, 4)
    return out


def spec(args, recompute: str, shard: bool) -> dict:
    return {"name": "recompute-zero", "model": MODEL, "data": {"kind": "synthetic"},
            "train": {"steps": args.steps, "global_batch": 32, "lr": 1e-3, "seed": 0},
            "resources": {"nodes": 1, "procs_per_node": 2, "device": "cpu"},
            "parallel": {"dp": 2, "recompute": recompute, "shard_optimizer": shard},
            "checkpoint": {"every_steps": 1_000_000, "async": True, "keep": 1}}


def run_once(args, work: Path, i: int, redis_url: str, recompute: str, shard: bool) -> dict:
    import redis

    run_dir = work / f"run-{i}"
    run_dir.mkdir()
    stream = f"trainyard:job:{i}"
    (run_dir / "config.json").write_text(json.dumps({
        "job_id": i, "attempt_id": 1, "node": "bench", "run_dir": str(run_dir), "redis_url": redis_url,
        "stream": stream, "data_root": str(work), "checkpoint_dir": str(work / f"ckpt-{i}"),
        "spec": spec(args, recompute, shard)}))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "workers.runtime", "--config", str(run_dir / "config.json")]
    done = subprocess.run(argv, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"run {i} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    client = redis.Redis.from_url(redis_url)
    samples, plans = [], {}
    for _, f in client.xrange(stream):
        data = json.loads(f[b"data"])
        if f[b"type"] == b"metrics":
            samples += data
        elif data.get("kind") == "rank_plan":
            plans[data["rank"]] = data
    client.close()
    steady = [s["step_s"] for s in samples if s["rank"] == 0 and s["step"] > args.warmup]
    return {"step_s": statistics.median(steady),
            "optim_bytes": [plans[r]["optim_bytes"] for r in sorted(plans)],
            "peak_rss_bytes": [max(s["mem_bytes"] for s in samples if s["rank"] == r) for r in (0, 1)]}


def runs(args) -> dict:
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-") as tmp:
        work = Path(tmp)
        redis_proc, redis_url = start_redis(work)
        try:
            i = 0
            for r in range(args.rounds):
                for recompute, shard in VARIANTS:
                    i += 1
                    got = run_once(args, work, i, redis_url, recompute, shard)
                    results.setdefault(f"recompute={recompute},shard_optimizer={str(shard).lower()}", []).append(got)
                    print(f"round {r + 1}: recompute {recompute} shard {shard}: {got}", file=sys.stderr, flush=True)
        finally:
            redis_proc.terminate()
            redis_proc.wait(10)
    summary = {}
    for name, rs in results.items():
        summary[name] = {"step_s_median": round(statistics.median(r["step_s"] for r in rs), 5),
                         "step_s": [round(r["step_s"], 5) for r in rs],
                         "optim_bytes_per_rank": rs[0]["optim_bytes"],
                         "peak_rss_bytes_per_rank_max": max(max(r["peak_rss_bytes"]) for r in rs)}
    base = summary["recompute=none,shard_optimizer=false"]["step_s_median"]
    for s in summary.values():
        s["step_time_vs_base"] = round(s["step_s_median"] / base, 4)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=30, help="interleaved forward+backward timings")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--skip-runs", action="store_true", help="only the in-process activation figures")
    p.add_argument("--rss-worker", choices=["none", "full"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rss_worker:
        return rss_worker(args.rss_worker)
    out = {"model": MODEL, "micro_batch": MICRO_BATCH, "activations": activations(args.reps)}
    print(f"activations: {out['activations']}", file=sys.stderr, flush=True)
    if not args.skip_runs:
        out["runs"] = runs(args)
        out.update(rounds=args.rounds, steps=args.steps, warmup_steps=args.warmup, world_size=2,
                   backend="gloo", device="cpu", data="synthetic")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
