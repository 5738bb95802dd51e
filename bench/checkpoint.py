"""Checkpoint benchmarks, side by side in one run. Prints one JSON object on stdout; progress
goes to stderr.

Sections (`--sections a,b`, default: all):
- save_blocking: what a save costs the training loop. For each `--sizes` (MB of state: fp32
  weights plus AdamW's two moment tensors per weight, 1/3 each; a real torch.optim.AdamW), in a
  one-rank gloo group (FileStore; a group of its own, as the runtime's checkpoints use), every
  variant once per repeat, in rotating order:
    alone        two simulated training steps without a save: `compute_s` (forward + backward),
                 `step_s` (that plus AdamW's step). The forward + backward is a matmul workload
                 on the model's own weights: per weight W (rows x 2048) Y = X W^T, dX = dY W and
                 dW = dY^T X into W.grad, i.e. 6 * params * tokens FLOPs (the usual count for a
                 transformer's weights; attention would add more), reading the weights and
                 writing the gradients as a real step does. `--tokens` per step, default 256:
                 a small batch (the demo job, jobs/runs/forms.py, runs 16 x 128 = 2048 tokens per
                 rank per step), so the compute the copy hides behind is not flattered.
                 `compute_gflop_per_s` is what this CPU achieved;
    sync         dcp.save, then os.fsync of every written file and the directory (the writer
                 already fsyncs its files; the extra pass makes "on disk" explicit): what a
                 synchronous save blocks training for;
    runtime      the runtime's path: trainyard/sdk/checkpoint.Checkpointer.save (async: its
                 save thread copies the state, then writes it), then simulated steps as the
                 trainer runs them (forward + backward, Checkpointer.wait_for_staging(), AdamW
                 step) until the save is published. `async_blocking_s`: what the training
                 thread was blocked for, the save call (`async_sync_part_s`) plus the wait for
                 the state copy before the first optimizer step (`async_staging_wait_s`); it is
                 the manifest's blocking_s. `compute_overlapped_s`: that first forward + backward,
                 slowed by the copy (and DCP's writes) competing for the cores and memory
                 bandwidth. `async_slowdown_s`: all the save cost the loop, blocking and slower
                 steps: sync part + the steps run until it was published - as many steps' step_s
                 (`async_steps_during_save` of them); `async_save_s`: the manifest's save_s.
                 Measured after one unmeasured first save (`async_first_blocking_s`: it stages
                 into fresh pages);
    call         the previous runtime path, for comparison: dcp.async_save with a reused
                 DefaultStager that stages synchronously (no overlap): `async_call_blocking_s`
                 is the call itself, `async_call_total_s` until its future is done; after one
                 unmeasured first save (`async_call_first_blocking_s`);
    async_fresh  plain dcp.async_save (a new stager per call): `async_fresh_blocking_s`.
  Per size, medians over `--repeats`; "ratio_blocking_to_sync" = async_blocking_s / sync_s, and
  "target_met": that ratio <= 0.10 at every size >= 100 MB. The ratio of async_slowdown_s and
  of the call-only blocking to sync_s are reported beside it.
- recovery: bench/recovery.py: SIGKILL one rank of the demo job on a real Trainyard (Redis,
  daphne, Celery, relay, two agents), time to its first new step with the breakdown (detection,
  scheduling, process start, checkpoint load), beside the same job's cold start.
Everything is written under a temporary directory in /tmp, removed at the end.

Usage: python bench/checkpoint.py [--sizes 10,100,500] [--repeats 3] [--tokens 256]
                                  [--sections save_blocking,recovery]
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
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainyard.sdk.checkpoint import Checkpointer  # noqa: E402  (the runtime's saves)
from trainyard.spec import CheckpointSpec  # noqa: E402

TENSOR_MB = 16  # a 2048 x 2048 fp32 matrix: about one transformer layer's weight at hidden 2048
TARGET_RATIO, TARGET_MIN_MB = 0.10, 100


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Weights(torch.nn.Module):
    def __init__(self, n: int, rows: int):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(rows, 2048))
                                        for _ in range(n))


def make_model(mb: int) -> tuple[Weights, torch.optim.AdamW]:
    """~`mb` MB of state: fp32 weights and AdamW's exp_avg/exp_avg_sq of the same shapes."""
    n = max(1, round(mb / 3 / TENSOR_MB))
    rows = max(1, round(mb * 2**20 / 3 / n / 4 / 2048))
    model = Weights(n, rows)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)  # gradients: written by backward, not saved
    opt.step()  # creates the moments
    return model, opt


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    """What the runtime saves (Checkpointer.save's state)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd,
            "trainer": {"step": step, "batches_consumed": step}}


class ForwardBackward:
    """A forward + backward of `tokens` tokens through the model's weights (see the module
    docstring): 6 * params * tokens FLOPs, reading the weights, writing their gradients."""

    def __init__(self, model: Weights, tokens: int):
        self.params = list(model.parameters())
        self.x = torch.randn(tokens, 2048)
        self.dy = {p.shape[0]: torch.randn(tokens, p.shape[0]) for p in self.params}
        self.flops = 6 * sum(p.numel() for p in self.params) * tokens

    @torch.no_grad()
    def __call__(self) -> float:
        t0 = time.perf_counter()
        for p in self.params:
            dy = self.dy[p.shape[0]]
            torch.mm(self.x, p.t())  # forward
            torch.mm(dy, p)  # backward: the input's gradient
            torch.mm(dy.t(), self.x, out=p.grad)  # backward: the weight's gradient
        return time.perf_counter() - t0


class Events:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def event(self, kind: str, **fields) -> None:
        self.events.append((kind, fields))


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
    return {"sizes": sizes, "repeats": args.repeats, "tokens": args.tokens, "world_size": 1,
            "backend": "gloo", "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "target": f"ratio_blocking_to_sync <= {TARGET_RATIO} at >= {TARGET_MIN_MB} MB",
            "target_met": bool(big) and all(s["ratio_blocking_to_sync"] <= TARGET_RATIO for s in big)}


# save_blocking's figures per size: one list per key, a value per repeat (medians reported).
TIMES = ("compute_s", "step_s", "sync_s", "async_blocking_s", "async_sync_part_s",
         "async_staging_wait_s", "compute_overlapped_s", "async_save_s", "async_steps_during_save",
         "async_call_blocking_s", "async_call_total_s", "async_fresh_blocking_s")


def _save_blocking_size(args, work: Path, group, mb: int) -> dict:
    run = SizeRun(args, work, group, mb)
    first_s, call_first_s = run.first_saves()
    run.repeat(args.repeats)
    run.close()
    return run.summary(first_s, call_first_s)


class SizeRun:
    """save_blocking at one size: the model and AdamW, the runtime's Checkpointer, the previous
    runtime path's stager, and the variants (alone, sync, runtime, call, async_fresh: see the
    module docstring), each appending its figures to `times`."""

    def __init__(self, args, work: Path, group, mb: int):
        self.work, self.group, self.mb, self.tokens = work, group, mb, args.tokens
        self.model, self.opt = make_model(mb)
        self.fwd_bwd = ForwardBackward(self.model, args.tokens)
        self.events = Events()
        self.ckpt = Checkpointer(CheckpointSpec.model_validate({"every_steps": 1, "async": True}),
                                 work / f"ckpt-{mb}", job_id=1, attempt_id=1, rank=0, world_size=1,
                                 device=torch.device("cpu"), reporter=self.events)
        # the previous runtime path: one stager for the run, staging synchronously in the call
        self.call_stager = DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=False))
        self.times: dict[str, list[float]] = {k: [] for k in TIMES}
        self.runs: list[tuple[float, int]] = []  # runtime: (sync part + the steps' time, steps)
        self.step = 0

    def first_saves(self) -> tuple[float, float]:
        """Warm up the matmuls, then each path's unmeasured first save (fresh pages): the
        runtime's and the previous path's blocking seconds."""
        self.fwd_bwd()  # warm up the matmuls
        first_s = self.runtime(self.work / "unused", record=False)  # the runtime's first save: fresh pages
        first = self.work / f"first-{self.mb}"
        call_first_s = self.call(first, key="")
        shutil.rmtree(first)
        return first_s, call_first_s

    def repeat(self, repeats: int) -> None:
        variants = [self.alone, self.sync, self.runtime, self.call, self.async_fresh]
        for rep in range(repeats):
            # rotate the order, so writeback left by the one before hits every variant alike
            k = rep % len(variants)
            for fn in variants[k:] + variants[:k]:
                path = self.work / f"{fn.__name__}-{self.mb}-{rep}"
                fn(path)
                shutil.rmtree(path, ignore_errors=True)
            log(f"save_blocking {self.mb} MB #{rep + 1}: "
                + ", ".join(f"{k} {v[-1]:.3f}" for k, v in self.times.items()))

    def close(self) -> None:
        self.ckpt.close()
        self.call_stager.close()

    def train_step(self) -> tuple[float, float, float]:
        """(forward + backward, wait for the save's state copy, the whole step) in seconds"""
        t0 = time.perf_counter()
        compute = self.fwd_bwd()
        waited = self.ckpt.wait_for_staging()
        self.opt.step()
        return compute, waited, time.perf_counter() - t0

    def alone(self, path: Path) -> None:
        for _ in range(2):
            compute, _, total = self.train_step()
            self.times["compute_s"].append(compute)
            self.times["step_s"].append(total)

    def sync(self, path: Path) -> None:
        t0 = time.perf_counter()
        dcp.save(state_of(self.model, self.opt, self.step), checkpoint_id=path, process_group=self.group)
        fsync_tree(path)
        self.times["sync_s"].append(time.perf_counter() - t0)

    def runtime(self, path: Path, record: bool = True) -> float:
        self.step += 1
        events = self.events.events
        published = len(events)
        sync_part = self.ckpt.save(self.step, self.model, self.opt)
        steps = []
        while len(events) == published and len(steps) < 1000:
            steps.append(self.train_step())
        self.ckpt.wait()  # collects the save (raises if it failed)
        [(kind, ev)] = events[published:]
        shutil.rmtree(ev["path"])
        blocking = sync_part + steps[0][1]
        assert kind == "checkpoint" and ev["blocking_s"] == blocking, (ev, sync_part, steps)
        if record:
            for key, v in [("async_blocking_s", blocking), ("async_sync_part_s", sync_part),
                           ("async_staging_wait_s", steps[0][1]),
                           ("compute_overlapped_s", steps[0][0]), ("async_save_s", ev["save_s"]),
                           ("async_steps_during_save", len(steps))]:
                self.times[key].append(v)
            self.runs.append((sync_part + sum(s[2] for s in steps), len(steps)))
        return blocking

    def call(self, path: Path, fresh: bool = False, key: str = "async_call_blocking_s") -> float:
        """dcp.async_save with the reused stager (fresh: a new one, plain async_save's default)."""
        stager = None if fresh else self.call_stager
        t0 = time.perf_counter()
        future = dcp.async_save(state_of(self.model, self.opt, self.step), checkpoint_id=path,
                                process_group=self.group, async_stager=stager)
        blocking = time.perf_counter() - t0
        future.result()
        if key:
            self.times[key].append(blocking)
            if not fresh:
                self.times["async_call_total_s"].append(time.perf_counter() - t0)
        return blocking

    def async_fresh(self, path: Path) -> None:  # plain async_save: a new stager, fresh pages, each call
        self.call(path, fresh=True, key="async_fresh_blocking_s")

    def summary(self, first_s: float, call_first_s: float) -> dict:
        med = {k: statistics.median(v) for k, v in self.times.items()}
        slowdown = statistics.median(total - n * med["step_s"] for total, n in self.runs)
        return {"mb": round(state_mb(state_of(self.model, self.opt, self.step)), 1), "tokens": self.tokens,
                **{k: round(v, 4) for k, v in med.items()},
                "compute_gflop_per_s": round(self.fwd_bwd.flops / med["compute_s"] / 1e9, 1),
                "async_slowdown_s": round(slowdown, 4),
                "async_first_blocking_s": round(first_s, 4),
                "async_call_first_blocking_s": round(call_first_s, 4),
                "ratio_blocking_to_sync": round(med["async_blocking_s"] / med["sync_s"], 4),
                "ratio_slowdown_to_sync": round(slowdown / med["sync_s"], 4),
                "ratio_call_blocking_to_sync": round(med["async_call_blocking_s"] / med["sync_s"], 4),
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
    parser.add_argument("--tokens", type=int, default=256,
                        help="tokens per simulated training step in save_blocking")
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
