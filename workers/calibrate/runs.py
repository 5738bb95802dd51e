"""A grid of short real runs of the built-in GPT under torchrun, through the runtime's own
building blocks (workers/runtime: build_model, build_strategy, the trainer's AdamW), so what is
timed is what a job runs: forward/backward of the strategy, optimizer step, zero_grad.

Every rank calls `sweep`; each grid point builds a fresh model (seed 0) and strategy, trains
`steps` steps on seeded random tokens (the ranks of one dp coordinate see the same batch), and
reports the median over the warm steps (the first WARMUP dropped) of the slowest rank's step
time, and the largest per-rank memory figures (memory.py). The default sweep goes over the
grid twice and keeps the faster pass's median (`sweep`).

Plans map to the runtime as the planner's do (issue13 design, C): pp > 1 -> the pipeline's
microbatches = per-replica batch / micro_batch; pp == 1 -> grad_accum = per-replica batch /
micro_batch.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist

from trainyard.mesh import Mesh
from trainyard.spec import ModelSpec
from workers.runtime.model import build_model, lm_loss
from workers.runtime.parallel import optim_bytes
from workers.runtime.strategy import build_strategy

from .memory import SavedTensors, grad_bytes

WARMUP = 3
PASSES = {True: 1, False: 2}  # quick, default
GLOBAL_BATCH = 16
CPU_MODELS = {  # small, medium, large: CPU step times from ~20 ms to ~1 s on one thread
    "s": dict(layers=2, hidden=64, heads=4, seq_len=64, vocab=256),
    "m": dict(layers=4, hidden=128, heads=4, seq_len=128, vocab=256),
    "l": dict(layers=4, hidden=256, heads=8, seq_len=128, vocab=512),
}
CUDA_MODELS = {
    "s": dict(layers=4, hidden=512, heads=8, seq_len=512, vocab=8192),
    "m": dict(layers=8, hidden=1024, heads=16, seq_len=1024, vocab=32768),
    "l": dict(layers=8, hidden=2048, heads=16, seq_len=1024, vocab=32768),
}


def _plan(dp=1, tp=1, pp=1, micro_batch=8, fsdp=False, schedule="1f1b") -> dict:
    return {"dp": dp, "tp": tp, "pp": pp, "micro_batch": micro_batch, "fsdp": fsdp,
            "shard_optimizer": False, "recompute": "none", "schedule": schedule}


def grid(world: int, cuda: bool, quick: bool) -> list[dict]:
    """The grid points {"model", "global_batch", "plan"} for `world` ranks: every strategy the
    runtime has (DDP, FSDP2, TP, pipeline GPipe and 1F1B) over the whole world, at each model
    size and micro-batch size (quick: two sizes, one micro-batch size)."""
    models = CUDA_MODELS if cuda else CPU_MODELS
    names = ["s", "m"] if quick else ["s", "m", "l"]
    micro = [8] if quick else [8, 4]
    points = []
    for name in names:
        model = models[name]
        for mb in micro:
            dp_mb = min(mb, GLOBAL_BATCH // world)  # a replica's batch holds at least one micro-batch
            plans = [_plan(dp=world, micro_batch=dp_mb)]
            if world > 1:
                plans.append(_plan(dp=world, micro_batch=dp_mb, fsdp=True))
                if model["heads"] % world == 0:
                    plans.append(_plan(tp=world, micro_batch=mb))
                if model["layers"] >= world:
                    # 1F1B needs at least as many micro-batches as stages
                    plans += [_plan(pp=world, micro_batch=mb, schedule=s) for s in ("gpipe", "1f1b")
                              if s == "gpipe" or GLOBAL_BATCH // mb >= world]
            points += [{"model": model, "global_batch": GLOBAL_BATCH, "plan": p} for p in plans
                       if {"model": model, "global_batch": GLOBAL_BATCH, "plan": p} not in points]
    return points


def _batch(dp_index: int, rows: int, model: dict, device: torch.device):
    g = torch.Generator().manual_seed(1000 + dp_index)
    tokens = torch.randint(0, model["vocab"], (rows, model["seq_len"] + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _activation_bytes(strategy, plan: dict, model: dict, x, y, device: torch.device) -> int:
    """Saved tensors of one micro-batch's forward (and loss, on the stage that computes it)."""
    mb = plan["micro_batch"]
    xm, ym = x[:mb], y[:mb]
    inner = getattr(strategy, "inner", None)  # DDP: the plain model (a forward without reducer)
    module = inner if isinstance(inner, torch.nn.Module) else strategy.module
    with torch.enable_grad(), SavedTensors() as saved:
        if plan["pp"] > 1:
            inp = xm if strategy.first else torch.randn(mb, model["seq_len"], model["hidden"],
                                                        device=device, requires_grad=True)
            out = module(inp)
            if strategy.last:
                out = lm_loss(out, ym)
        else:
            out = lm_loss(module(xm), ym)
    del out
    if hasattr(strategy, "_reshard"):
        strategy._reshard()
    return saved.bytes


def run_point(point: dict, device: torch.device, steps: int) -> dict:
    """One grid point on every rank; the figures are the same on every rank (all-reduced)."""
    model, plan = point["model"], point["plan"]
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh.for_world(world, tp=plan["tp"], pp=plan["pp"], dp=plan["dp"], fsdp=plan["fsdp"])
    per_replica = point["global_batch"] // plan["dp"]
    split = per_replica // plan["micro_batch"]
    torch.manual_seed(0)
    net = build_model(ModelSpec(kind="gpt", **model)).to(device)
    strategy = build_strategy(mesh, rank, net, device, vocab=model["vocab"], heads=model["heads"],
                              hidden=model["hidden"], microbatches=split if plan["pp"] > 1 else 1,
                              schedule=plan["schedule"])
    accum = 1 if plan["pp"] > 1 else split
    opt = torch.optim.AdamW(strategy.module.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    x, y = _batch(mesh.coords(rank)["dp"], per_replica, model, device)
    times, grads = [], 0
    for step in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = strategy.forward_backward(x, y, accum)
        if step == 0:
            grads = grad_bytes(strategy.module)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    params = strategy.info()["param_bytes"]
    acts = _activation_bytes(strategy, plan, model, x, y, device)
    mem = torch.tensor([params, grads, optim_bytes(opt), acts], dtype=torch.int64, device=device)
    step_times = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    dist.all_reduce(step_times, op=dist.ReduceOp.MAX)
    del strategy, opt, net, loss
    gc.collect()
    dist.barrier()
    p, g, o, a = (int(v) for v in mem.tolist())
    return {**point, "procs": world, "steps": steps,
            "step_time_s": statistics.median(step_times.tolist()[WARMUP:]),
            "memory": {"params_bytes": p, "grads_bytes": g, "optimizer_bytes": o, "activation_bytes": a}}


def sweep(device: torch.device, quick: bool, log=print) -> list[dict]:
    """Every grid point, in PASSES[quick] passes over the whole grid; a point's step time is the
    smallest of its passes' medians (another process on the node only ever adds time, and a
    burst of it rarely covers the same point in two passes a minute or more apart)."""
    steps = WARMUP + (4 if quick else 9)
    points = grid(dist.get_world_size(), device.type == "cuda", quick)
    out: list[dict] = []
    for p in range(PASSES[quick]):
        for i, point in enumerate(points):
            t0 = time.perf_counter()
            r = run_point(point, device, steps)
            if p == 0:
                out.append({**r, "passes": 1})
            else:
                out[i]["step_time_s"] = min(out[i]["step_time_s"], r["step_time_s"])
                out[i]["passes"] += 1
            log(f"run {i + 1} pass {p + 1}: {point['model']} {point['plan']} step_time_s "
                f"{r['step_time_s']:.4f} ({time.perf_counter() - t0:.1f} s)")
    return out
