"""Overhead of the Trainyard runtime against a plain torch DDP loop, side by side.

Both sides train the same GPT (the demo job's shape) on synthetic tokens with 2 gloo ranks
under `torchrun --standalone`, with the same optimizer and DDP settings:
  A  plain: the loop at the bottom of this file (no comm hook, no timing, no telemetry);
  B  trainyard: `python -m workers.runtime`, telemetry on, into a redis-server started here.
Runs alternate A B A B ... so drift on a shared machine hits both sides alike. Throughput is
measured identically from rank 0's end-of-step wall-clock stamps (A writes them to a JSON
file, B reports them as `ts` in its stream samples), over the steady-state steps only
(start-up and the first `--warmup` steps excluded), two ways:
- `*_samples_per_s`: global_batch / median step interval. The median ignores the seconds in
  which another process on a shared machine takes a core, which otherwise swamp a 2% effect.
- `*_wall_samples_per_s`: global_batch * (steps - warmup) / (ts[steps] - ts[warmup]).

Prints one JSON object. Usage: python bench/overhead.py [--pairs 5] [--steps 60] [--warmup 10]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STREAM = "trainyard:job:1"


def spec(args) -> dict:
    return {
        "name": "overhead",
        "model": {"kind": "gpt", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "seq_len": args.seq_len, "vocab": 256},
        "data": {"kind": "synthetic"},
        "train": {"steps": args.steps, "global_batch": args.global_batch, "lr": 1e-3,
                  "warmup_steps": 0, "lr_schedule": "constant", "seed": 0, "grad_accum": 1,
                  "balance": "none"},
        "resources": {"nodes": 1, "procs_per_node": 2, "device": "cpu"},
        "parallel": {"dp": 2, "tp": 1, "pp": 1, "fsdp": False},
        "comm": {"compression": "none", "sync": "allreduce"},
        # No mid-run saves: this measures the runtime's per-step overhead (the final step's save
        # still runs; bench/checkpoint.py measures saves).
        "checkpoint": {"every_steps": 1_000_000, "async": True, "keep": 1},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (make deps)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                             "--save", "", "--appendonly", "no", "--daemonize", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


def torchrun(target: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            *target]
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def throughput(ts: list[float], global_batch: int, warmup: int) -> tuple[float, float]:
    """(median-interval, wall) samples/s over the steps after `warmup` (ts[i] ends step i+1)."""
    steady = ts[warmup - 1:]
    intervals = [b - a for a, b in zip(steady, steady[1:])]
    return (global_batch / statistics.median(intervals),
            global_batch * len(intervals) / (steady[-1] - steady[0]))


def run_plain(args, work: Path, i: int) -> tuple[float, float]:
    cfg = work / f"plain-{i}.json"
    cfg.write_text(json.dumps(spec(args)))
    out = work / f"plain-{i}.timing.json"
    torchrun([str(Path(__file__).resolve()), "--plain-worker", str(cfg), "--out", str(out)])
    return throughput(json.loads(out.read_text())["ts"], args.global_batch, args.warmup)


def run_trainyard(args, work: Path, i: int, redis_url: str) -> tuple[float, float]:
    import redis

    run_dir = work / f"trainyard-{i}"
    run_dir.mkdir()
    stream = f"{STREAM}:{i}"
    (run_dir / "config.json").write_text(json.dumps({
        "job_id": 1, "attempt_id": i, "node": "bench", "run_dir": str(run_dir),
        "redis_url": redis_url, "stream": stream, "data_root": str(work),
        "checkpoint_dir": str(work / "ckpt"), "spec": spec(args)}))
    torchrun(["-m", "workers.runtime", "--config", str(run_dir / "config.json")])
    client = redis.Redis.from_url(redis_url)
    samples = [s for _, f in client.xrange(stream) if f[b"type"] == b"metrics"
               for s in json.loads(f[b"data"]) if s["rank"] == 0]
    client.delete(stream)
    client.close()
    ts = [s["ts"] for s in sorted(samples, key=lambda s: s["step"])]
    if len(ts) != args.steps:
        sys.exit(f"trainyard run {i} reported {len(ts)} of {args.steps} rank-0 samples")
    return throughput(ts, args.global_batch, args.warmup)


def plain_worker(config_path: str, out_path: str) -> None:
    """A. A plain DDP loop: what a user would write by hand, with the runtime's model."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainyard.spec import ModelSpec
    from workers.runtime.model import build_model

    s = json.loads(Path(config_path).read_text())
    m, t = ModelSpec(**s["model"]), s["train"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = t["global_batch"] // world
    gen = torch.Generator().manual_seed(t["seed"] + rank)
    data = torch.randint(0, m.vocab, (64, batch, m.seq_len + 1), generator=gen)
    torch.manual_seed(t["seed"])
    model = DDP(build_model(m), gradient_as_bucket_view=True)  # same DDP settings as the runtime
    opt = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=(0.9, 0.95), weight_decay=0.01)
    ts = []
    for step in range(t["steps"]):
        w = data[step % len(data)]
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        ts.append(time.time())
    if rank == 0:
        Path(out_path).write_text(json.dumps({"ts": ts}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps excluded from the throughput")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--plain-worker", metavar="CONFIG", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plain_worker:
        return plain_worker(args.plain_worker, args.out)
    if not 1 <= args.warmup < args.steps:
        p.error("need 1 <= --warmup < --steps")

    with tempfile.TemporaryDirectory(prefix="trainyard-bench-") as tmp:
        work = Path(tmp)
        redis_proc, redis_url = start_redis(work)
        try:
            plain, trainyard = [], []
            for i in range(args.pairs):
                plain.append(run_plain(args, work, i))
                trainyard.append(run_trainyard(args, work, i, redis_url))
                print(f"pair {i + 1}/{args.pairs}: plain {plain[-1][0]:.1f} trainyard "
                      f"{trainyard[-1][0]:.1f} samples/s (median step)", file=sys.stderr, flush=True)
        finally:
            redis_proc.terminate()
            redis_proc.wait(10)
    ratios = [b[0] / a[0] for a, b in zip(plain, trainyard)]
    wall_ratios = [b[1] / a[1] for a, b in zip(plain, trainyard)]
    print(json.dumps({
        "plain_samples_per_s": [round(x[0], 2) for x in plain],
        "trainyard_samples_per_s": [round(x[0], 2) for x in trainyard],
        "ratios": [round(r, 4) for r in ratios],
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_min": round(min(ratios), 4),
        "ratio_max": round(max(ratios), 4),
        "plain_wall_samples_per_s": [round(x[1], 2) for x in plain],
        "trainyard_wall_samples_per_s": [round(x[1], 2) for x in trainyard],
        "wall_ratio_median": round(statistics.median(wall_ratios), 4),
        "pairs": args.pairs, "steps": args.steps, "warmup_steps": args.warmup,
        "model": spec(args)["model"], "global_batch": args.global_batch, "world_size": 2,
        "backend": "gloo", "device": "cpu", "data": "synthetic",
    }))


if __name__ == "__main__":
    main()
