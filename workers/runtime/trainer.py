"""One rank of a data-parallel training run: set up, loop, report.

Per step every rank reports one sample (see reporter.py for transport). Timing fields, all
wall-clock seconds on this rank, measured with perf_counter (CUDA: after synchronising, with
CUDA events for the collectives, see comm.py):
- data_s: waiting for the next batch from the prefetcher plus starting its host->device copy.
- compute_s: forward + loss + backward wall time (of all micro-steps, see below) minus the
  exposed part of gradient communication (the time backward() only waited for gradient
  averaging after the last bucket launched).
- comm_s: time at least one gradient bucket was being averaged (its all-reduces, and with
  comm.compression its compression arithmetic too), hidden or not. So compute_s + comm_s >=
  forward+backward; the overlap is the comm hidden behind compute. With comm.sync local_sgd or
  hierarchical it also holds the model averaging inside the optimizer step (sync.py), which
  optim_s then leaves out.
- optim_s: optimizer.step() + zero_grad() + loss.item() (on CUDA the item() waits for the
  optimizer's kernels, so the time lands here rather than in the next step).
- step_s: from asking for the batch to the end of the optimizer step, plus the time
  checkpointing blocked this rank in the step: on a checkpoint step, the save call (the
  synchronous part, see checkpoint.py); on the step after an async save, any wait before the
  optimizer step for the save's state copy, which runs alongside that step's forward and
  backward. step_s ~= data_s + compute_s + exposed comm + optim_s + checkpoint blocking (+
  microseconds of bookkeeping). A chaos-slowed rank (chaos.py: slow_s, or the slow factor that
  scales with the rank's work) shows its sleep in compute_s;
  its peers wait for it in their all-reduces, which lands in their comm_s, not their compute_s.
samples_per_s / tokens_per_s are this rank's (per-rank batch / step_s); the job's throughput
is their sum over ranks. With train.balance=auto (balance.py) the per-rank batch is this step's
share of the global batch, and each sample also carries "share" (that share / global_batch).
bytes_sent is what this rank handed to gradient collectives (compressed or not, see comm.py).
mem_bytes: process RSS on CPU; torch.cuda.max_memory_allocated (peak so far) on CUDA.

Gradient accumulation (train.grad_accum = k): a step takes this rank's whole share of the
global batch (global_batch / world) from the loader, as with k = 1, and runs it as k
micro-batches of global_batch / (world x k) samples. The first k-1 backward passes run under
DDP's no_sync() (gradients accumulate locally), the last one synchronises; each micro-batch
loss is divided by k, so the update is the one a single batch of the same samples would give
(mean loss over equal-sized micro-batches = mean over the batch). The reported loss is the mean
of the micro-batch losses. The loader's batch stays the step's share, so a step consumes one
loader batch whatever k is: checkpoints' batches_consumed == step, and the samples a step sees
(epoch boundaries included) are exactly those of k = 1. One sample per optimizer step; its
data_s and compute_s cover all micro-steps.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.distributed as dist

from .balance import Balance, check_balance
from .chaos import Chaos, SlowKnob
from .checkpoint import Checkpointer, is_due, resume_manifest
from .comm import CommCounter, CpuClock, CudaClock, GradCompression, RunComm
from trainyard.spec import TrainSpec

from .config import ConfigError, RunConfig
from .data import Batch, build_batches, val_batches
from .model import build_model
from .parallel import Mesh, build_strategy, optim_bytes
from .preempt import PREEMPTED_EXIT_CODE, preempt_key
from .reporter import Reporter
from .sync import build_sync

COSINE_FLOOR = 0.1  # cosine decays to 10% of lr (nanoGPT's min_lr = lr/10)
VAL_BATCHES = 4


@dataclass(frozen=True)
class DistEnv:
    """What torchrun tells this process about its place in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> "DistEnv":
        try:
            return cls(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]),
                       int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"]))
        except KeyError as e:
            raise RuntimeError(f"{e.args[0]} is not set: run this module under torchrun") from None


def lr_at(step: int, train: TrainSpec) -> float:
    """Learning rate for 1-based `step`: linear warmup, then constant or cosine to 10%."""
    if step <= train.warmup_steps:
        return train.lr * step / train.warmup_steps
    if train.lr_schedule == "constant":
        return train.lr
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    return train.lr * (COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


def write_rank_file(run_dir: Path, env: DistEnv, node: str) -> Path:
    """<run_dir>/ranks/<local_rank>.json, atomically: the launcher labels logs and pids by it."""
    ranks = Path(run_dir) / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    final = ranks / f"{env.local_rank}.json"
    tmp = ranks / f".{env.local_rank}.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"rank": env.rank, "local_rank": env.local_rank,
                               "pid": os.getpid(), "node": node}))
    os.replace(tmp, final)
    return final


def check_world(cfg: RunConfig, env: DistEnv) -> Mesh:
    expected = cfg.resources.world_size
    if env.world_size != expected:
        raise ConfigError(
            f"torchrun started {env.world_size} ranks but the spec asks for resources "
            f"{cfg.resources.nodes}x{cfg.resources.procs_per_node}={expected}")
    return Mesh.from_config(cfg, env.world_size)


def run(cfg: RunConfig, env: DistEnv | None = None) -> dict:
    """Train this rank to completion; returns its summary. Exceptions propagate (exit != 0)."""
    env = env or DistEnv.from_environ()
    write_rank_file(cfg.run_dir, env, cfg.node)
    cuda = cfg.resources.device == "cuda"
    if cuda:
        # CUDA_VISIBLE_DEVICES holds this node's slots, so the local rank indexes them.
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    reporter = Reporter(cfg.redis_url, cfg.stream, rank=env.rank, attempt=cfg.attempt_id,
                        preempt_key=preempt_key(cfg.attempt_id))
    reporter.event("rank_started", pid=os.getpid(), node=cfg.node, world_size=env.world_size)
    try:
        # User errors (bad data path, too little data) surface here, before the rendezvous,
        # so a failing rank does not first wait for its peers.
        mesh = check_world(cfg, env)
        dp_rank = mesh.coords(env.rank)["dp"]
        batch = cfg.per_rank_batch(mesh.dp)
        cfg.micro_batch(mesh.dp)  # global_batch divisible by dp x grad_accum
        check_balance(cfg, mesh)  # train.balance=auto: plain DDP only
        # a step consumes one loader batch (its micro-batches are cut from it): a checkpoint at
        # step S has consumed S batches on every rank
        start_batch = resume_manifest(cfg.resume)["step"] if cfg.resume else 0
        batches, val = build_batches(cfg.data, cfg.model, cfg.data_root, rank=dp_rank,
                                     world_size=mesh.dp, batch=batch, seed=cfg.train.seed,
                                     pin_memory=cuda, start_batch=start_batch,
                                     balance=cfg.train.balance == "auto")
        if cuda:  # device_id binds the NCCL communicator to this rank's GPU up front
            dist.init_process_group(backend="nccl", device_id=device)
        else:
            dist.init_process_group(backend="gloo")
        try:
            return _train(cfg, env, mesh, device, reporter, batches, val, start_batch)
        finally:
            dist.destroy_process_group()
    finally:
        reporter.close()


def _train(cfg: RunConfig, env: DistEnv, mesh: Mesh, device: torch.device, reporter: Reporter,
           batches: Iterator[Batch], val: np.ndarray | None, start_batch: int = 0) -> dict:
    train, mcfg = cfg.train, cfg.model
    batch = cfg.per_rank_batch(mesh.dp)
    torch.manual_seed(train.seed)  # identical initial weights on every rank
    model = build_model(mcfg).to(device)
    ckpt = Checkpointer(cfg.checkpoint, cfg.checkpoint_dir, job_id=cfg.job_id,
                        attempt_id=cfg.attempt_id, rank=env.rank, world_size=env.world_size,
                        device=device, reporter=reporter)
    clock = CudaClock(device) if device.type == "cuda" else CpuClock()
    counter = CommCounter(clock)
    comm_cfg = cfg.comm
    compression = GradCompression(comm_cfg.compression, counter, ratio=comm_cfg.ratio,
                                  rank=comm_cfg.rank, start_step=comm_cfg.start_step,
                                  seed=train.seed)
    run_comm = RunComm(comm_cfg.compression)
    sync = build_sync(cfg, mesh, env.rank, counter, compression, reporter.event, _say)  # comm.sync
    strategy = build_strategy(cfg, mesh, env.rank, model, device, sync.hook_state, sync.hook,
                              counter=counter)
    ddp = strategy.module  # what the optimizer updates and the checkpoint saves
    accum = train.grad_accum
    opt = sync.wrap(torch.optim.AdamW(ddp.parameters(), lr=train.lr, betas=(0.9, 0.95),
                                      weight_decay=0.01))  # local SGD: PostLocalSGDOptimizer
    first = 1
    if cfg.resume is not None:
        first = _resume(cfg, env, ckpt, ddp, opt, reporter, start_batch) + 1
    # Preemption consensus (preempt.py) on a group of its own: a one-int all_reduce a step
    # (~0.1-0.3 ms on gloo/CPU) so every rank stops after the same step, never inside the
    # gradient all-reduces or a background checkpoint's collectives.
    control = dist.new_group(backend="gloo")
    saved_at = 0
    chaos = Chaos.from_environ(cfg.job_id, env.rank, _say)
    slow = SlowKnob(chaos, env.rank)  # test aid: compute takes `factor` x as long (chaos.py)
    balance = Balance.start(cfg, mesh, env.rank, batches, reporter, _say)  # None: equal shares
    proc = psutil.Process()
    log_every = max(1, train.steps // 10)
    start = time.time()
    loss_v = float("nan")

    for step in range(first, train.steps + 1):
        lr = lr_at(step, train)
        for group in opt.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        t1 = time.perf_counter()
        if chaos is not None:
            chaos.before_compute(step)
        n = balance.n if balance is not None else batch  # balance.py: this step's share
        slow.before_compute(n)
        sync.begin_step(step)  # compression's step, local SGD's hook and averager counters
        ref = clock.mark()
        loss = strategy.forward_backward(x, y, accum, weight=balance.weight if balance else 1.0)
        backward_end = clock.mark()
        clock.sync()
        t2 = time.perf_counter()
        # An async save copies the weights and optimizer state in the background; that copy
        # must be complete before the optimizer changes them (checkpoint blocking, not optim_s).
        staging_wait_s = ckpt.wait_for_staging()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = loss.item()  # CUDA: waits for the optimizer's kernels, so optim_s is honest
        t3 = time.perf_counter()
        ckpt.poll()
        if is_due(step, cfg.checkpoint.every_steps, train.steps):
            ckpt.save(step, ddp, opt)
            saved_at = step
        comm = counter.take()
        run_comm.add(comm, compression.compressing)
        comm_s, exposed_s = comm.measure(clock, ref, backward_end)
        # local SGD: the model averaging in opt.step() (seconds); ratio auto may decide (collective)
        avg_s, sync_fields = sync.end_step(step, comm, comm_s, max(0.0, t2 - t1 - exposed_s))
        step_s = time.perf_counter() - t0
        compute_s = max(0.0, t2 - t1 - exposed_s)
        slow.measured(compute_s, n)
        reporter.metric({
            "rank": env.rank, "step": step, "ts": time.time(), "loss": loss_v,
            "samples_per_s": n / step_s, "tokens_per_s": n * mcfg.seq_len / step_s,
            "step_s": step_s, "data_s": t1 - t0, "compute_s": compute_s,
            "comm_s": comm_s + avg_s, "optim_s": t3 - t2 - staging_wait_s - avg_s,
            "bytes_sent": comm.bytes_sent,
            "mem_bytes": (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                          else proc.memory_info().rss),
            "attempt": cfg.attempt_id, **sync_fields,  # sync.py: compression_ratio, ...
            **({"share": balance.share} if balance is not None else {}),
        })
        if balance is not None and step < train.steps:  # collective, every rank; may re-split
            balance.after_step(step, compute_s)             # from step+1 (none after the last)
        if step == first:  # optimizer state exists now: report what this rank really holds
            plan = strategy.info()
            reporter.event("rank_plan", rank=env.rank, node=cfg.node, **plan,
                           optim_bytes=optim_bytes(opt))
            _say(f"rank {env.rank} plan {plan['strategy']} mesh {plan['mesh']['shape']} coords "
                 f"{plan['coords']} param_bytes {plan['param_bytes']} optim_bytes {optim_bytes(opt)}")
        if step == 1 or step % log_every == 0 or step == train.steps:
            _say(f"rank {env.rank} step {step}/{train.steps} loss {loss_v:.4f} lr {lr:.2e} "
                 f"step_ms {step_s * 1000:.1f} samples/s {n / step_s:.1f}")
        if chaos is not None:
            chaos.after_step(step)
        if step < train.steps and _preempt_agreed(reporter.preempt_requested.is_set(), control):
            _preempt_exit(step, saved_at, ckpt, ddp, opt, reporter, env)

    ckpt.close()  # the last save is published (and reported) before this rank says it finished

    val_loss = _val_loss(strategy, val, mcfg.seq_len, batch, device)
    wall_s = time.time() - start
    comm_summary = run_comm.summary()
    reporter.event("rank_finished", steps=train.steps, final_loss=loss_v, grad_accum=accum,
                   **comm_summary)
    _say(f"rank {env.rank} finished steps {train.steps} final_loss {loss_v:.4f} "
         f"val_loss {val_loss if val_loss is None else round(val_loss, 4)} wall_s {wall_s:.1f}")
    _say(f"rank {env.rank} comm compression {comm_summary['compression']} bytes_sent "
         f"{comm_summary['bytes_sent']} dense_bytes {comm_summary['dense_bytes']} ratio "
         f"{comm_summary['compression_ratio']} (compressed steps: "
         f"{comm_summary['compression_ratio_compressed_steps']})")
    return {"steps": train.steps, "final_loss": loss_v, "val_loss": val_loss, "wall_s": wall_s}


class Preempted(SystemExit):
    """Raised on every rank once they agreed to stop: exits PREEMPTED_EXIT_CODE after the
    `finally` blocks (process group, reporter flush) ran. A SystemExit, so @record does not
    write it up as an error."""

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step


def _preempt_agreed(mine: bool, group) -> bool:
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _preempt_exit(step: int, saved_at: int, ckpt: Checkpointer, model: torch.nn.Module,
                  opt: torch.optim.Optimizer, reporter: Reporter, env: DistEnv) -> None:
    """Save this step (unless it was just saved), wait until the checkpoint is published and
    reported, and leave: the job resumes from exactly here."""
    t0 = time.perf_counter()
    if saved_at != step:
        ckpt.save(step, model, opt)
    ckpt.close()
    if env.rank == 0:
        reporter.event("preempted_exit", step=step, save_s=round(time.perf_counter() - t0, 3))
    _say(f"rank {env.rank} preempted after step {step}: checkpoint saved in "
         f"{time.perf_counter() - t0:.2f} s, exiting with {PREEMPTED_EXIT_CODE}")
    raise Preempted(step)


def _resume(cfg: RunConfig, env: DistEnv, ckpt: Checkpointer, model: torch.nn.Module,
            opt: torch.optim.Optimizer, reporter: Reporter, start_batch: int) -> int:
    """Load the resume checkpoint into model and optimizer; returns its step."""
    path = cfg.resume.path
    r = ckpt.load(path, model, opt, seed=cfg.train.seed)
    if r.batches_consumed != start_batch:  # the data iterator was positioned from the manifest
        raise RuntimeError(f"{path}: the trainer state consumed {r.batches_consumed} batches but "
                           f"its manifest says step {start_batch}")
    if not r.rng_restored:
        _say(f"rank {env.rank}: {path} holds no RNG state for rank {env.rank} (saved with another "
             f"world size); seeded its RNGs deterministically from (seed, step, rank) instead")
    if env.rank == 0:
        reporter.event("resumed", step=r.step, path=str(path), load_s=r.load_s)
    _say(f"rank {env.rank} resumed from step {r.step} ({path}) in {r.load_s:.2f} s")
    return r.step


def _say(line: str) -> None:
    # One write per line: print() writes the text and the newline separately, which under
    # PYTHONUNBUFFERED interleaves ranks that share a pipe ("...930.1rank 1 step 4...").
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@torch.no_grad()
def _val_loss(strategy, val, seq_len: int, batch: int, device: torch.device) -> float | None:
    """Mean loss on fixed held-out windows, the same on every rank (every rank runs this: a
    sharded strategy's forward is collective)."""
    if val is None or len(val) < seq_len + batch * VAL_BATCHES:
        return None
    losses = [strategy.eval_loss(x.to(device), y.to(device))
              for x, y in val_batches(val, seq_len, batch, VAL_BATCHES)]
    return sum(losses) / len(losses)
