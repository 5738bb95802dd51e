"""Checkpoints: asynchronous, atomic saves through torch.distributed.checkpoint (DCP), and the
exact resume from one.

On-disk layout under <checkpoint_dir> (= <root>/job-<id>); the control plane registers a
checkpoint from the `checkpoint` event and reconciles from the manifests, so this is a contract:

    step-<S:08d>-a<attempt>/            a complete checkpoint, and only with trainyard.json in it
        .metadata, __<r>_0.distcp       DCP: model, optimizer (get_state_dict) and the trainer dict
        rank-<r>.pt                     rank r's RNG states (python, numpy, torch CPU, CUDA)
        trainyard.json                  the manifest, written last by rank 0 (MANIFEST_KEYS)
    .partial-step-<S:08d>-a<attempt>/   a save in progress, or one a crash cut short: never a
                                        checkpoint; rank 0 of a later attempt deletes it at start

A save (every `every_steps` steps and at the last step), on every rank:
1. waits for the previous save if it is still in flight (one at a time bounds the staging
   memory to one copy of the state and keeps DCP's collectives on the checkpoint group in order);
2. writes rank-<r>.pt synchronously with fsync (a few KB: well under a millisecond), so it is
   complete before this rank enters the save's collectives;
3. async: dcp.async_save stages a CPU copy of the state (the only part the training thread
   waits for) and writes it on a background thread; sync: dcp.save. One stager serves the whole
   run (`make_stager`) and keeps its copy between saves, so after the first save staging copies
   into warm memory instead of faulting in fresh pages: 500 MB took 0.23 s instead of 0.6-2.0 s
   on the 2-core dev VM (bench/checkpoint.py). Reusing it is safe because the previous save,
   which reads that copy, has finished (step 1). The price is one CPU copy of the state held
   for the run (pinned host memory on CUDA) rather than only during a save.
DCP's save ends with an all_reduce on the checkpoint group: rank 0 gathers every rank's write
results (each rank sends them after its writes finished, and after its step 2), runs the
storage writer's finish (.metadata, fsynced), then broadcasts. So once rank 0's future is done,
every rank's files are complete. Rank 0 then writes trainyard.json (fsync), renames the directory
to its final name, fsyncs the parent and reports the `checkpoint` event. It does so in the
future's done-callback, on DCP's thread: exactly once, without the training loop polling, and
even when the training thread is stuck in a later collective (a hang after a save still leaves
that save usable). The training thread only collects the outcome (`poll`) and re-raises a
failed save there.

All checkpoint collectives run on a gloo group of their own (`dist.new_group`), so a save in
flight never interleaves with DDP's gradient all-reduces on the default group.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from .config import CheckpointConfig, ConfigError, ResumeConfig

FORMAT = 1
MANIFEST = "trainyard.json"
PARTIAL = ".partial-"
MANIFEST_KEYS = ("format", "job_id", "attempt_id", "step", "world_size", "created_unixtime",
                 "size_bytes", "blocking_s", "save_s")


def final_name(step: int, attempt_id: int) -> str:
    return f"step-{step:08d}-a{attempt_id}"


def partial_name(step: int, attempt_id: int) -> str:
    return PARTIAL + final_name(step, attempt_id)


def is_due(step: int, every_steps: int, last_step: int) -> bool:
    return step % every_steps == 0 or step == last_step


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def publish(partial: Path, manifest: dict) -> Path:
    """Make a complete .partial-* directory a checkpoint: manifest (fsync), rename, fsync parent.

    A crash before the rename leaves a .partial-* directory (never a checkpoint); after it, a
    step-* directory with its manifest. There is no state in between.
    """
    partial = Path(partial)
    if not partial.name.startswith(PARTIAL):
        raise ValueError(f"{partial} is not a {PARTIAL}* directory")
    with open(partial / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    final = partial.with_name(partial.name[len(PARTIAL):])
    os.rename(partial, final)
    fsync_dir(final.parent)
    return final


def read_manifest(path: Path) -> dict:
    """The manifest of the complete checkpoint at `path`; ConfigError naming the path otherwise."""
    path = Path(path)
    if path.name.startswith(PARTIAL):
        raise ConfigError(f"resume.path {path} is an unfinished save ({PARTIAL}*), not a checkpoint")
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        what = "has no" if path.is_dir() else "does not exist, so no"
        raise ConfigError(f"resume.path {path} {what} {MANIFEST}: not a complete checkpoint") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"resume.path {path}: unreadable {MANIFEST}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"resume.path {path}: {MANIFEST} is not format {FORMAT}: {manifest!r}")
    return manifest


def resume_manifest(resume: ResumeConfig) -> dict:
    """Check the resume point before the rendezvous, so a bad path fails fast and clearly."""
    manifest = read_manifest(resume.path)
    if manifest.get("step") != resume.step:
        raise ConfigError(f"resume.step={resume.step} but {resume.path / MANIFEST} says step "
                          f"{manifest.get('step')}")
    return manifest


def remove_stale_partials(checkpoint_dir: Path, attempt_id: int) -> list[Path]:
    """Delete .partial-* directories other attempts left behind (their saves can never finish)."""
    own = f"-a{attempt_id}"
    stale = [p for p in Path(checkpoint_dir).glob(PARTIAL + "*")
             if p.is_dir() and not p.name.endswith(own)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_rng(seed: int, step: int, rank: int, device: torch.device) -> None:
    """Deterministic RNG states when a checkpoint holds none for this rank (world size changed)."""
    derived = (seed * 1_000_003 + step * 1_009 + rank) % 2**32
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)  # seeds CUDA generators too


def make_stager(device: torch.device) -> DefaultStager:
    """The async_save stager the runtime reuses across saves: synchronous staging (the copy is
    complete when async_save returns, so training may update the weights at once), into pinned
    host memory with non-blocking copies on CUDA."""
    cuda = device.type == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=cuda))


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


@dataclass
class _Save:
    """One save in flight; `done` is set once its outcome (published or failed) is known."""

    step: int
    partial: Path
    started: float  # perf_counter when this save began (after any wait for the previous one)
    blocking_s: float = 0.0
    save_s: float = 0.0
    path: Path | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Resumed:
    step: int
    batches_consumed: int
    load_s: float
    rng_restored: bool


class Checkpointer:
    """Saves this rank's share of the state; rank 0 publishes and reports each checkpoint.

    Construct on every rank at the same point (it creates the checkpoint process group).
    """

    def __init__(self, cfg: CheckpointConfig, directory: Path, *, job_id: int, attempt_id: int,
                 rank: int, world_size: int, device: torch.device, reporter: Any):
        self.cfg = cfg
        self.dir = Path(directory)
        self.job_id, self.attempt_id = job_id, attempt_id
        self.rank, self.world_size, self.device = rank, world_size, device
        self.reporter = reporter
        self.group = dist.new_group(backend="gloo")
        self._stager = make_stager(device) if cfg.async_ else None
        self._pending: _Save | None = None
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(self.dir, attempt_id)

    # ---- saving --------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        """Start (async) or do (sync) the save of `step`; returns seconds the caller was blocked."""
        t0 = time.perf_counter()
        self.wait()
        record = _Save(step, self.dir / partial_name(step, self.attempt_id), time.perf_counter())
        record.partial.mkdir(parents=True, exist_ok=True)
        _save_file(rng_state(self.device), record.partial / f"rank-{self.rank}.pt")
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd,
                 # grad_accum is 1, so batches consumed == steps; the lr is lr_at(step)
                 "trainer": {"step": step, "batches_consumed": step}}
        if self.cfg.async_:
            future = dcp.async_save(state, checkpoint_id=record.partial, process_group=self.group,
                                    async_stager=self._stager)
            record.blocking_s = time.perf_counter() - t0
            self._pending = record
            future.add_done_callback(lambda f: self._complete(record, f))
        else:
            try:
                dcp.save(state, checkpoint_id=record.partial, process_group=self.group)
            except BaseException as e:  # recorded and re-raised by wait(), like an async failure
                record.error = e
            record.blocking_s = time.perf_counter() - t0
            self._pending = record
            self._complete(record, None)
            self.wait()
        return record.blocking_s

    def _complete(self, record: _Save, future: Any) -> None:
        """Runs once per save: on DCP's thread (async) or the training thread (sync)."""
        record.save_s = time.perf_counter() - record.started
        try:
            if future is not None:
                future.result()
            if record.error is None and self.rank == 0:
                manifest = {"format": FORMAT, "job_id": self.job_id, "attempt_id": self.attempt_id,
                            "step": record.step, "world_size": self.world_size,
                            "created_unixtime": time.time(), "size_bytes": dir_size(record.partial),
                            "blocking_s": record.blocking_s, "save_s": record.save_s}
                record.path = publish(record.partial, manifest)
                self.reporter.event("checkpoint", step=record.step, path=str(record.path),
                                    size_bytes=manifest["size_bytes"],
                                    blocking_s=record.blocking_s, save_s=record.save_s)
        except BaseException as e:  # surfaced on the training thread by poll()/wait()
            record.error = e
        finally:
            record.done.set()

    def poll(self) -> None:
        """Collect a finished save without blocking; re-raises its error on the training thread."""
        if self._pending is not None and self._pending.done.is_set():
            self._collect()

    def wait(self) -> None:
        """Block until the save in flight (if any) is published or failed."""
        if self._pending is not None:
            self._pending.done.wait()
            self._collect()

    def close(self) -> None:
        """Wait for the save in flight, then free the staging copy. Call once, after the last save."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _collect(self) -> None:
        record, self._pending = self._pending, None
        if record.error is not None:
            raise RuntimeError(f"checkpoint save of step {record.step} into {record.partial} "
                               f"failed: {record.error!r}") from record.error

    # ---- resuming ------------------------------------------------------------------------
    def load(self, path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
             *, seed: int) -> Resumed:
        """Load model, optimizer, trainer dict and this rank's RNG states from checkpoint `path`."""
        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, opt)  # the shapes DCP loads into, in place
        state = {"model": model_sd, "optim": optim_sd,
                 "trainer": {"step": -1, "batches_consumed": -1}}
        dcp.load(state, checkpoint_id=path, process_group=self.group)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["trainer"]["step"])
        rng_file = Path(path) / f"rank-{self.rank}.pt"
        if rng_file.is_file():  # our own file: weights_only=False for numpy's RNG tuple
            set_rng_state(torch.load(rng_file, weights_only=False), self.device)
        else:
            seed_rng(seed, step, self.rank, self.device)
        return Resumed(step, int(state["trainer"]["batches_consumed"]), time.perf_counter() - t0,
                       rng_file.is_file())
