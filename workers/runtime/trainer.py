"""One rank of a training run, in torchtitan's shape: `run` sets up the process (device,
reporter, data, process group); `Trainer.__init__` builds the model, the Strategy for the mesh
(strategy.py), the optimizer, the checkpointer and the gradient sync from the launch config and
hands them plain values; `Trainer.train_step` is one optimizer step and returns its sample;
`Trainer.train` is the loop (report, rebalance, log, preemption). Reporting, checkpointing and
stopping go through the SDK's `Run` (trainyard/sdk/run.py), the same calls a user's script makes:
`run.log` sends the sample `train_step` measured, `run.should_checkpoint` / `run.checkpoint`
save (every_steps, the last step, an agreed stop), `run.should_stop` / `run.finish` end the run
(exit 83 after a preemption). Only the build functions read the launch config.

Per step every rank reports one sample (trainyard/sdk/reporter.py: transport). Timing fields, all
seconds on this rank. The phases are bracketed by marks of the step clock (comm.py): perf_counter
on CPU; on CUDA events recorded on the current stream, resolved after the one synchronisation at
the end of the step, so each phase holds the device time it took, host stalls included where the
device idled through them (the previous step ended synchronised, so a step starts idle):
- data_s: waiting for the next batch from the prefetcher plus starting its host->device copy.
- compute_s: forward + loss + backward wall time (of all micro-steps, see below) minus the
  exposed part of gradient communication (the time backward() only waited for gradient
  averaging after the last bucket launched).
- comm_s: time at least one gradient bucket was being averaged (its all-reduces, and with
  comm.compression its compression arithmetic too), hidden or not. So compute_s + comm_s >=
  forward+backward; the overlap is the comm hidden behind compute. With comm.sync local_sgd or
  hierarchical it also holds the model averaging inside the optimizer step (sync.py), which
  optim_s then leaves out.
- optim_s: optimizer.step() + zero_grad() (on CUDA up to the event after its last kernel).
- step_s: from asking for the batch to the end of the optimizer step, plus the time
  checkpointing blocked this rank in the step: on a checkpoint step, the save call (the
  synchronous part, see trainyard/sdk/checkpoint.py); on the step after an async save, any wait before the
  optimizer step for the save's state copy, which runs alongside that step's forward and
  backward. step_s ~= data_s + compute_s + exposed comm + optim_s + checkpoint blocking (+
  microseconds of bookkeeping). A chaos-slowed rank (chaos.py: slow_s, or the slow factor that
  scales with the rank's work) shows its sleep in compute_s;
  its peers wait for it in their all-reduces, which lands in their comm_s, not their compute_s.
samples_per_s / tokens_per_s are this rank's (per-rank batch / step_s); the job's throughput
is their sum over ranks. With train.balance=auto (trainyard/sdk/balance.py) the per-rank batch is this step's
share of the global batch, and each sample also carries "share" (that share / global_batch).
bytes_sent is what this rank handed to gradient collectives (compressed or not, see comm.py).
mem_bytes: process RSS on CPU; torch.cuda.max_memory_allocated (peak so far) on CUDA, where the
sample's metrics (MetricSample.extra) also carry mem_allocated_bytes, mem_reserved_bytes (the
caching allocator's) and mem_free_bytes (the device's free memory, cudaMemGetInfo) at the
step's end.
With a sharded or pipelined strategy comm_s is measured in the attempt's first steps only
(parallel.MeteredStrategy), each collective waited for; 0 in later steps.

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

import functools
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from trainyard.keys import preempt_key
from trainyard.mesh import Mesh
from trainyard.sdk.checkpoint import trainer_state
from trainyard.sdk.layout import resume_manifest
from trainyard.sdk.reporter import Reporter
from trainyard.sdk.run import DistEnv, Preempted, Run, init_process_group, write_rank_file
from trainyard.sdk.run import say as _say
from trainyard.spec import TrainSpec

from trainyard.sdk.balance import Balance
from .chaos import Chaos, SlowKnob
from trainyard.sdk.comm import CommCounter, CpuClock, CudaClock, GradCompression, RunComm
from .config import ConfigError, RunConfig
from .memcap import cap_memory
from .data import Batch, build_batches, to_device, val_batches
from .model import build_model
from trainyard.sdk.optim import build_optimizer, state_optimizer
from .parallel import optim_bytes
from .strategy import build_strategy
from trainyard.sdk.sync import build_sync

COSINE_FLOOR = 0.1  # cosine decays to 10% of lr (nanoGPT's min_lr = lr/10)
VAL_BATCHES = 4


def lr_at(step: int, train: TrainSpec) -> float:
    """Learning rate for 1-based `step`: linear warmup, then constant or cosine to 10%."""
    if step <= train.warmup_steps:
        return train.lr * step / train.warmup_steps
    if train.lr_schedule == "constant":
        return train.lr
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    return train.lr * (COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


def check_world(cfg: RunConfig, env: DistEnv) -> Mesh:
    """The mesh of this run; ConfigError when torchrun started another number of ranks than the
    spec's resources."""
    expected = cfg.resources.world_size
    if env.world_size != expected:
        raise ConfigError(
            f"torchrun started {env.world_size} ranks but the spec asks for resources "
            f"{cfg.resources.nodes}x{cfg.resources.procs_per_node}={expected}")
    p = cfg.parallel
    try:
        return Mesh.for_world(env.world_size, tp=int(p.tp), pp=int(p.pp), dp=p.dp, fsdp=bool(p.fsdp))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run(cfg: RunConfig, env: DistEnv | None = None) -> dict:
    """Train this rank to completion; returns its summary. Exceptions propagate (exit != 0)."""
    env = env or DistEnv.from_environ()
    write_rank_file(cfg.launch.run_dir, env, cfg.launch.node)
    cuda = cfg.resources.device == "cuda"
    if cuda:
        # CUDA_VISIBLE_DEVICES holds this node's slots, so the local rank indexes them.
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    reporter = Reporter(cfg.launch.redis_url, cfg.launch.stream, rank=env.rank, attempt=cfg.launch.attempt_id,
                        preempt_key=preempt_key(cfg.launch.attempt_id))
    reporter.event("rank_started", pid=os.getpid(), node=cfg.launch.node, world_size=env.world_size)
    try:
        # User errors (bad data path, too little data) surface here, before the rendezvous,
        # so a failing rank does not first wait for its peers.
        mesh = check_world(cfg, env)
        dp_rank = mesh.coords(env.rank)["dp"]
        batch = cfg.per_rank_batch(mesh.dp)
        cfg.micro_batch(mesh.dp)  # global_batch divisible by dp x grad_accum
        # a step consumes one loader batch (its micro-batches are cut from it): a checkpoint at
        # step S has consumed S batches on every rank
        start_batch = resume_manifest(cfg.launch.resume)["step"] if cfg.launch.resume else 0
        batches, val = build_batches(cfg.data, cfg.model, cfg.launch.data_root, rank=dp_rank,
                                     world_size=mesh.dp, batch=batch, seed=cfg.train.seed,
                                     pin_memory=cuda, start_batch=start_batch,
                                     balance=cfg.train.balance == "auto")
        # NCCL on CUDA, gloo on CPU (the SDK's, as for user code); every group under the control
        # plane's collective timeout, so a stuck collective fails this rank before the hang verdict
        init_process_group(env, device, cfg.launch.collective_timeout_s)
        if cfg.launch.memory_limit_gb and not cuda:
            cap_memory(cfg.launch.memory_limit_gb)
        try:
            summary = Trainer(cfg, env, mesh, device, reporter, batches, val, start_batch).train()
        except Preempted:  # every rank agreed to stop and saved: a clean, collective exit
            dist.destroy_process_group()
            raise
        except BaseException as e:
            fail_fast(e, env.rank)
            raise
        dist.destroy_process_group()
        return summary
    finally:
        reporter.close()


def fail_fast(error: BaseException, rank: int) -> None:
    """This rank raised: write its error file first, then abort (never destroy) every process
    group, so it exits at once. destroy_process_group is collective in effect: on NCCL it waits
    for work its peers never finish while they sit in a collective this rank will not join, so a
    rank that destroyed after an error (a CUDA OOM in backward, a save error on rank 0 alone)
    hung with no error file and its job was recorded as a hang and retried. The error file is
    written here, before the abort, so the cause is on disk even if the abort were to stall;
    @record (__main__.py) writes it again, the same, as the exception leaves the process (like
    @record, a SystemExit or KeyboardInterrupt is not written up, but still aborts)."""
    if isinstance(error, Exception):
        get_error_handler().record_exception(error)
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:  # an older torch: leave the groups to the process's exit
        _say(f"rank {rank} failed: exiting without destroying the process group")
        return
    try:
        abort()  # every group, the default one included (NCCL: ncclCommAbort, no waiting)
    except Exception as e:  # noqa: BLE001 - the rank's own error is the one to report
        _say(f"rank {rank} failed and could not abort its process group ({e!r}): exiting without "
             "destroying it")


class Trainer:
    """One rank's model, strategy, optimizer, checkpointer and sync, built on every rank in the
    same order (each creates process groups, which is collective), then trained by `train`."""

    def __init__(self, cfg: RunConfig, env: DistEnv, mesh: Mesh, device: torch.device,
                 reporter: Reporter, batches: Iterator[Batch], val: np.ndarray | None,
                 start_batch: int = 0):
        train, mcfg = cfg.train, cfg.model
        self.env, self.mesh, self.device, self.reporter = env, mesh, device, reporter
        self.batches, self.val = batches, val
        self.steps, self.accum, self.seq_len = train.steps, train.grad_accum, mcfg.seq_len
        self.batch = cfg.per_rank_batch(mesh.dp)
        self.lr_at = functools.partial(lr_at, train=train)
        self.node, self.attempt_id = cfg.launch.node, cfg.launch.attempt_id
        torch.manual_seed(train.seed)  # identical initial weights on every rank
        p = cfg.parallel
        model = build_model(mcfg, recompute=p.recompute == "full").to(device)
        # Reporting, checkpoints and stopping go through the SDK's Run, as in a user's script.
        self.run = Run(env=env, device=device, launch=cfg.launch, spec=cfg.spec,
                       reporter=reporter)
        self._build_comm(cfg)
        self.strategy = build_strategy(mesh, env.rank, model, device, vocab=mcfg.vocab,
                                       heads=mcfg.heads, hidden=mcfg.hidden,
                                       microbatches=p.microbatches, schedule=p.schedule,
                                       hook_state=self.sync.hook_state, hook=self.sync.hook,
                                       counter=self.counter)
        self.model = self.strategy.module  # what the optimizer updates and the checkpoint saves
        # AdamW, or ZeRO-1 over the dp group (optim.py); local SGD: sync.wrap puts a
        # PostLocalSGDOptimizer around it (sync.py)
        self.opt = self.sync.wrap(build_optimizer(self.model, train, shard=p.shard_optimizer,
                                                  dp_group=self.strategy.dp_group))
        self.state_opt = state_optimizer(self.opt)  # what checkpoints save: this rank's state
        self.first = self._resume(cfg.launch.resume.path, start_batch) + 1 if cfg.launch.resume is not None else 1
        self.chaos = Chaos.from_environ(cfg.launch.job_id, env.rank, _say)
        self.slow = SlowKnob(self.chaos, env.rank)  # test aid: compute takes `factor` x as long
        self.balance = None  # train.balance none: equal shares
        if train.balance == "auto":
            self.balance = Balance.start(mesh.dp, env.rank, train.global_batch, train.grad_accum,
                                         batches, reporter, _say)
        self.proc = psutil.Process()

    def _build_comm(self, cfg: RunConfig) -> None:
        """The step clock, the byte counter, gradient compression and the sync (comm.*)."""
        c = cfg.comm
        self.clock = CudaClock(self.device) if self.device.type == "cuda" else CpuClock()
        self.counter = CommCounter(self.clock)
        self.compression = GradCompression(c.compression, self.counter, ratio=c.ratio, rank=c.rank,
                                           start_step=c.start_step, seed=cfg.train.seed)
        self.run_comm = RunComm(c.compression)
        self.sync = build_sync(c.sync, rank=self.env.rank, world=dist.get_world_size(),
                               counter=self.counter, compression=self.compression,
                               auto_ratio=c.ratio == "auto", start_step=c.start_step,
                               period=c.period, periods=(c.periods.node, c.periods.global_),
                               procs_per_node=cfg.resources.procs_per_node,
                               event=self.reporter.event, say=_say)

    def train_step(self, step: int) -> dict:
        """One optimizer step (batch, forward/backward, optimizer, the checkpoint when due);
        returns its telemetry sample (the module docstring defines the fields). Phases are
        bracketed by clock marks (CUDA events on CUDA) and resolved after the step's one
        synchronisation, at its end."""
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(step)
        clock = self.clock
        t0 = time.perf_counter()
        data_start = clock.mark()
        x, y = to_device(next(self.batches), self.device)
        ref = clock.mark()  # compute starts: chaos and the slow knob's sleeps are compute
        if self.chaos is not None:
            self.chaos.before_compute(step)
        n = self.balance.n if self.balance is not None else self.batch  # this step's share
        self.slow.before_compute(n)
        self.sync.begin_step(step)  # compression's step, local SGD's hook and averager counters
        loss = self.strategy.forward_backward(x, y, self.accum,
                                              weight=self.balance.weight if self.balance else 1.0)
        backward_end = clock.mark()
        # An async save copies the weights and optimizer state in the background; that copy
        # must be complete before the optimizer changes them (checkpoint blocking, not optim_s).
        self.run.wait_for_staging()
        optim_start = clock.mark()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        optim_end = clock.mark()
        # every_steps, the last step, or the ranks agreed to stop here (preemption)
        if self.run.should_checkpoint(step):
            self.run.checkpoint(step, trainer_state(self.model, self.state_opt, step))
        clock.sync()  # the step's one synchronisation: every mark above is resolved after it
        loss_v = loss.item()
        comm = self.counter.take()
        self.run_comm.add(comm, self.compression.compressing)
        comm_s, exposed_s = comm.measure(clock, ref, backward_end)
        compute_s = max(0.0, clock.seconds(ref, backward_end) - exposed_s)
        # local SGD: the model averaging in opt.step() (seconds); ratio auto may decide (collective)
        avg_s, sync_fields = self.sync.end_step(step, comm, comm_s, compute_s)
        step_s = time.perf_counter() - t0
        self.slow.measured(compute_s, n)
        # sync.py's fields: compression_ratio (a standard field), local SGD's averaged/checksum
        extra = {k: v for k, v in sync_fields.items() if k != "compression_ratio"}
        standard = {k: v for k, v in sync_fields.items() if k == "compression_ratio"}
        if self.balance is not None:
            standard["share"] = self.balance.share
        return self.run.log(
            step, loss=loss_v, samples=n, tokens_per_s=n * self.seq_len / step_s,
            step_s=step_s, data_s=clock.seconds(data_start, ref), compute_s=compute_s,
            comm_s=comm_s + avg_s, optim_s=max(0.0, clock.seconds(optim_start, optim_end) - avg_s),
            bytes_sent=comm.bytes_sent, extra=extra, **standard, **self._memory())

    def _memory(self) -> dict:
        """mem_bytes (RSS on CPU; the peak allocated so far on CUDA) and on CUDA this step's
        allocated, reserved (the caching allocator's) and device-free bytes (user metrics:
        sample["metrics"], stored in MetricSample.extra)."""
        if self.device.type != "cuda":
            return {"mem_bytes": self.proc.memory_info().rss}
        free, _total = torch.cuda.mem_get_info(self.device)
        return {"mem_bytes": torch.cuda.max_memory_allocated(self.device),
                "mem_allocated_bytes": torch.cuda.memory_allocated(self.device),
                "mem_reserved_bytes": torch.cuda.memory_reserved(self.device),
                "mem_free_bytes": free}

    def train(self) -> dict:
        """Steps first..steps, then the held-out loss; returns this rank's summary."""
        start = time.time()
        loss_v = float("nan")
        log_every = max(1, self.steps // 10)
        for step in range(self.first, self.steps + 1):
            sample = self.train_step(step)  # reported by run.log
            loss_v = sample["loss"]
            if self.balance is not None and step < self.steps:  # collective; may re-split
                self.balance.after_step(step, sample["compute_s"])  # from step+1 (none after the last)
            if step == self.first:  # optimizer state exists now: report what this rank holds
                self._report_plan()
            if step == 1 or step % log_every == 0 or step == self.steps:
                _say(f"rank {self.env.rank} step {step}/{self.steps} loss {loss_v:.4f} "
                     f"lr {self.lr_at(step):.2e} step_ms {sample['step_s'] * 1000:.1f} "
                     f"samples/s {sample['samples_per_s']:.1f}")
            if self.chaos is not None:
                self.chaos.after_step(step)
            if self.run.should_stop():  # saved by train_step already (should_checkpoint)
                break
        # the last save is published (and reported) before this rank finishes; after an agreed
        # stop this raises Preempted (exit 83) once the stop step's checkpoint is published
        self.run.finish()
        return self._finish(loss_v, start)

    def _report_plan(self) -> None:
        plan, rank = self.strategy.info(), self.env.rank
        opt_bytes = optim_bytes(self.state_opt)
        # what this rank really built: checkpointed blocks, a ZeRO-1 partition of the optimizer
        recompute = any(getattr(m, "recompute", False) for m in self.model.modules())
        shard = self.state_opt is not self.opt  # optim.state_optimizer: ZeRO's local AdamW
        if shard:
            plan["role"] += f"; optimizer state: its 1/{self.mesh.dp} share (ZeRO-1)"
        if recompute:
            plan["role"] += "; activations recomputed in backward"
        self.reporter.event("rank_plan", rank=rank, node=self.node, **plan, optim_bytes=opt_bytes,
                            recompute="full" if recompute else "none", shard_optimizer=shard)
        _say(f"rank {rank} plan {plan['strategy']} mesh {plan['mesh']['shape']} coords "
             f"{plan['coords']} param_bytes {plan['param_bytes']} optim_bytes {opt_bytes}")

    def _finish(self, loss_v: float, start: float) -> dict:
        rank = self.env.rank
        val_loss = _val_loss(self.strategy, self.val, self.seq_len, self.batch, self.device)
        wall_s = time.time() - start
        comm_summary = self.run_comm.summary()
        self.reporter.event("rank_finished", steps=self.steps, final_loss=loss_v,
                            grad_accum=self.accum, **comm_summary)
        _say(f"rank {rank} finished steps {self.steps} final_loss {loss_v:.4f} "
             f"val_loss {val_loss if val_loss is None else round(val_loss, 4)} wall_s {wall_s:.1f}")
        _say(f"rank {rank} comm compression {comm_summary['compression']} bytes_sent "
             f"{comm_summary['bytes_sent']} dense_bytes {comm_summary['dense_bytes']} ratio "
             f"{comm_summary['compression_ratio']} (compressed steps: "
             f"{comm_summary['compression_ratio_compressed_steps']})")
        return {"steps": self.steps, "final_loss": loss_v, "val_loss": val_loss, "wall_s": wall_s}

    def _resume(self, path: Path, start_batch: int) -> int:
        """Load the resume checkpoint into model and optimizer (run.restore); returns its step."""
        state = trainer_state(self.model, self.state_opt, -1)
        state["trainer"]["batches_consumed"] = -1
        step = self.run.restore(state)
        consumed = state["trainer"]["batches_consumed"]
        if consumed != start_batch:  # the data iterator was positioned from the manifest
            raise RuntimeError(f"{path}: the trainer state consumed {consumed} batches "
                               f"but its manifest says step {start_batch}")
        return step


@torch.no_grad()
def _val_loss(strategy, val, seq_len: int, batch: int, device: torch.device) -> float | None:
    """Mean loss on fixed held-out windows, the same on every rank (every rank runs this: a
    sharded strategy's forward is collective)."""
    if val is None or len(val) < seq_len + batch * VAL_BATCHES:
        return None
    losses = [strategy.eval_loss(x.to(device), y.to(device))
              for x, y in val_batches(val, seq_len, batch, VAL_BATCHES)]
    return sum(losses) / len(losses)
