"""Checkpoints: asynchronous, atomic saves through torch.distributed.checkpoint (DCP), and the
exact resume from one.

On-disk layout under <checkpoint_dir> (= <root>/job-<id>); the control plane registers a
checkpoint from the `checkpoint` event and reconciles from the manifests, so this is a contract:

    step-<S:08d>-a<attempt>/            a complete checkpoint, and only with trainyard.json in it
        .metadata, __<r>_0.distcp       DCP: the caller's state (`saveable`: modules and optimizers
                                        via get_state_dict; the built-in trainer's: model, optim
                                        and its trainer dict)
        rank-<r>.pt                     rank r's RNG states (python, numpy, torch CPU, CUDA)
        trainyard.json                  the manifest, written last by rank 0 (MANIFEST_KEYS)
    .partial-step-<S:08d>-a<attempt>/   a save in progress, or one a crash cut short: never a
                                        checkpoint; rank 0 of a later attempt deletes it at start

When: the SDK's `Run.should_checkpoint` (run.py), asked after every step by a user's script and
by the built-in trainer alike, says every `every_steps` steps, at the last step, and when the
ranks agreed to stop (preemption), never twice for one step; `Run.checkpoint` calls
`save_state`. A save, on every rank:
1. waits for the previous save if it is still in flight (one at a time bounds the staging
   memory to one copy of the state and keeps DCP's collectives on the checkpoint group in order);
2. captures what the training loop could change before the next optimizer step: this rank's
   RNG states, and the state's structure (`_capture`: get_state_dict's dicts and lists rebuilt,
   non-tensor values such as param_groups' lr copied, tensors other than parameters and
   optimizer state, i.e. buffers, cloned). An async save() returns here;
3. on the Checkpointer's save thread (async; bound to the rank's device) or in save() (sync):
   writes rank-<r>.pt with fsync (a few KB, so it is complete before this rank enters the
   save's collectives); async: agrees with the other ranks which entries each writes
   (staging.py: DCP's own dedup, run first), copies only this rank's share of the parameter
   and optimizer tensors to host memory (`make_stager`; on the CPU a memcpy that releases the
   GIL), then runs dcp.save on that copy with a planner that writes only the share.
Only the optimizer step changes the tensors the save thread copies (forward and backward read
the parameters and write gradients, which are not saved; a forward that updates buffers, as
BatchNorm's running statistics, updates tensors cloned in step 2). So the copy only has to be
complete before the next optimizer step: `Run.checkpoint` registers an optimizer step
pre-hook that calls `wait_for_staging()` (the built-in trainer also calls it itself right before
`opt.step()`, to account the wait), and the copy runs alongside the next step's forward and
backward. A state with a module that no optimizer in it updates is copied before
`Run.checkpoint` returns. A save's
`blocking_s` is the time the training thread was held for it: save() itself (including any
wait for the previous save) plus any wait in `wait_for_staging()`.
One stager serves the whole run and keeps its copy of the share between saves, so after the
first save staging copies into warm memory instead of faulting in fresh pages: 500 MB took
0.23 s instead of 0.6-2.0 s on the 2-core dev VM (bench/checkpoint.py). Reusing it is safe
because the previous save, which reads that copy, has finished (step 1). The price is a host
copy of this rank's share held for the run: under DDP 1/world of the state, not all of it (each
rank used to copy and pin everything: about 190 GB page-locked per 8-GPU node at 1.5 B
parameters). On CUDA it is pinned up to `CheckpointSpec.pinned_host_fraction` of the host's RAM
split between the node's ranks, pageable beyond.
DCP's save ends with an all_reduce on the checkpoint group: rank 0 gathers every rank's write
results (each rank sends them after its writes finished, and after its rank file), runs the
storage writer's finish (.metadata, fsynced), then broadcasts. So once rank 0's dcp.save returns,
every rank's files are complete. Rank 0 then writes trainyard.json (fsync), renames the directory
to its final name, fsyncs the parent and reports the `checkpoint` event. It does so on the save
thread (async), right after dcp.save: exactly once, without the training loop polling, and
even when the training thread is stuck in a later collective (a hang after a save still leaves
that save usable). The training thread only collects the outcome (`poll`) and re-raises a
failed save there.

All checkpoint collectives run on a gloo group of their own (`dist.new_group`), so a save in
flight never interleaves with DDP's gradient all-reduces on the default group.
"""
from __future__ import annotations

import copy
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

from trainyard import attemptauth
from trainyard.keys import MANIFEST  # noqa: F401  (the manifest name, shared with the control plane)
from trainyard.spec import CheckpointSpec

from .optim import state_optimizer
from .safeload import SafeFileSystemReader, SafeLoadPlanner
from .staging import ShareSavePlanner, ShareStager, bind_device, pin_limit_bytes, plan_share
from .layout import (FORMAT, MANIFEST_KEYS, PARTIAL, dir_size, final_name, fsync_dir, is_due,  # noqa: F401
                     latest_checkpoint, partial_name, publish, read_manifest, remove_stale_partials,
                     resume_manifest)

# The optimizer's state *and hyperparameters* flattened to one key per parameter FQN
# ("state.blocks.1.q.weight.exp_avg", "param_groups.blocks.1.q.weight.lr"). Unflattened, the
# param_groups are one list object that DCP saves from a single rank: under pipeline parallelism
# each stage's list names only its own parameters, so a stage resuming under another plan found
# no group for its parameters (KeyError 'betas' at the first step of dp x pp resumed from pp).
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

try:  # numpy is optional for the SDK: its RNG state is saved when it is installed
    import numpy as np
except ImportError:  # pragma: no cover - the built-in trainer depends on numpy
    np = None


# ---- what a checkpoint holds ----------------------------------------------------------------
# The caller's state is a mapping of names to modules, optimizers, Stateful objects (state_dict /
# load_state_dict) and plain values (tensors, numbers, dicts). DCP saves the flat form: a module
# as get_model_state_dict, an optimizer as get_optimizer_state_dict over the module whose
# parameters it updates (so both reshard when the world size or the plan changes), a Stateful
# object as its state_dict(), a plain value as it is.

def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _owner(state: dict, name: str, optim: torch.optim.Optimizer) -> torch.nn.Module:
    """The module in `state` whose parameters `optim` updates."""
    modules = [m for m in state.values() if isinstance(m, torch.nn.Module)]
    if len(modules) == 1:
        return modules[0]
    wanted = {id(p) for g in optim.param_groups for p in g["params"]}
    owners = [m for m in modules if wanted <= {id(p) for p in m.parameters()}]
    if len(owners) != 1:
        raise ValueError(f"checkpoint state: optimizer {name!r} needs exactly one module in the same "
                         f"mapping holding all its parameters, found {len(owners)}")
    return owners[0]


def saveable(state: dict) -> dict:
    """The flat state DCP saves (and loads into, in place) for the caller's mapping."""
    out = {}
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            out[name] = get_model_state_dict(obj, options=STATE_DICT_OPTIONS)
        elif isinstance(obj, torch.optim.Optimizer):
            obj = state_optimizer(obj)  # ZeRO-1: the optimizer holding this rank's share
            out[name] = get_optimizer_state_dict(_owner(state, name, obj), obj, options=STATE_DICT_OPTIONS)
        elif _is_stateful(obj):
            out[name] = obj.state_dict()
        else:
            out[name] = obj
    return out


def load_into(state: dict, loaded: dict) -> None:
    """Put what DCP loaded (`saveable(state)`, filled in) back into the caller's objects; plain
    values replace the mapping's entries."""
    for name, obj in list(state.items()):
        if isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, loaded[name], options=STATE_DICT_OPTIONS)
        elif isinstance(obj, torch.optim.Optimizer):
            obj = state_optimizer(obj)
            set_optimizer_state_dict(_owner(state, name, obj), obj, loaded[name], options=STATE_DICT_OPTIONS)
        elif _is_stateful(obj):
            obj.load_state_dict(loaded[name])
        else:
            state[name] = loaded[name]


def trainer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    """The built-in trainer's state: a step consumes one loader batch (grad_accum cuts its
    micro-batches from it), so batches consumed == steps; the lr is lr_at(step)."""
    return {"model": model, "optim": opt, "trainer": {"step": step, "batches_consumed": step}}


def rng_state(device: torch.device) -> dict:
    """This rank's RNG states in types `torch.load(weights_only=True)` reads back (no pickled
    objects in a checkpoint): numpy's key array travels as an int64 tensor."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        name, key, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    if np is not None and "numpy" in state:
        name, key, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_rng(seed: int, step: int, rank: int, device: torch.device) -> None:
    """Deterministic RNG states when a checkpoint holds none for this rank (world size changed)."""
    derived = (seed * 1_000_003 + step * 1_009 + rank) % 2**32
    random.seed(derived)
    if np is not None:
        np.random.seed(derived)
    torch.manual_seed(derived)  # seeds CUDA generators too


def make_stager(device: torch.device, pin_limit: int) -> ShareStager:
    """The stager the runtime reuses across saves, called on the Checkpointer's save thread: it
    copies this rank's share (a flat dict of tensors) to host memory, pinned on CUDA up to
    `pin_limit` bytes (non-blocking copies on a stream of its own, so the copy does not queue
    behind the training's kernels), pageable beyond; on the CPU a plain copy."""
    return ShareStager(pin_memory=device.type == "cuda", pin_limit_bytes=pin_limit)


def _live_storages(state: dict) -> set[int]:
    """data_ptrs of the storages only an optimizer step writes: parameters, optimizer state."""
    tensors = [p for m in state.values() if isinstance(m, torch.nn.Module) for p in m.parameters()]
    tensors += [v for o in state.values() if isinstance(o, torch.optim.Optimizer)
                for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {_storage_ptr(t) for t in tensors if t.numel()}


def _storage_ptr(t: torch.Tensor) -> int:
    # a DTensor (TP, FSDP2) has no storage of its own: its local shard's is what the step writes
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr()


def _capture(obj: Any, deferred: set[int]) -> Any:
    """A copy of the state that the training loop cannot change until the next optimizer step:
    containers rebuilt, non-tensor values deep-copied, tensors on `deferred` storages kept as
    they are (the stager copies them later), other tensors (buffers: a forward may update them)
    cloned now."""
    if isinstance(obj, torch.Tensor):
        if obj.numel() and _storage_ptr(obj) in deferred:
            return obj
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _capture(v, deferred) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_capture(v, deferred) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_capture(v, deferred) for v in obj)
    return copy.deepcopy(obj)


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
    sync_s: float = 0.0  # the training thread in save(), the wait for the previous save included
    staging_wait_s: float = 0.0  # the training thread in wait_for_staging() for this save
    blocking_s: float = 0.0  # sync_s + staging_wait_s; final when the manifest is written
    save_s: float = 0.0
    path: Path | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    # async: set once the save thread's copy of the state is complete (or failed)
    staged: threading.Event | None = None
    # wait_for_staging() <-> _complete(): which of the two fixes staging_wait_s
    lock: threading.Lock = field(default_factory=threading.Lock)
    waiting: bool = False  # the training thread entered wait_for_staging()
    settled: bool = False  # _complete() ran first: any later wait_for_staging() adds nothing
    waited: threading.Event = field(default_factory=threading.Event)


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

    def __init__(self, cfg: CheckpointSpec, directory: Path, *, job_id: int, attempt_id: int,
                 rank: int, world_size: int, device: torch.device, reporter: Any, proof_key: str | None = None):
        self.cfg = cfg
        # The attempt's manifest key (trainyard.attemptauth, from the launch config): the control
        # plane registers and resumes from a checkpoint only with its proof. None: a standalone run.
        self.proof_key = proof_key
        self.dir = Path(directory)
        self.job_id, self.attempt_id = job_id, attempt_id
        self.rank, self.world_size, self.device = rank, world_size, device
        self.reporter = reporter
        self.group = dist.new_group(backend="gloo")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self._stager = (make_stager(device, pin_limit_bytes(cfg.pinned_host_fraction, local_world))
                        if cfg.async_ else None)
        # async saves run here, one at a time: rank file, share, staging copy, dcp.save, publish
        self._thread = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainyard-ckpt",
                                           initializer=bind_device, initargs=(device,))
                        if cfg.async_ else None)
        self._pending: _Save | None = None
        self.saved_step: int | None = None  # the step of the last save started (one per step)
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(self.dir, attempt_id)

    # ---- saving --------------------------------------------------------------------------
    def due(self, step: int, last_step: int) -> bool:
        """Whether `step` is a scheduled save: every `every_steps` steps and the last step."""
        return is_due(step, self.cfg.every_steps, last_step)

    def save_if_due(self, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, *,
                    last_step: int, force: bool = False) -> float:
        """Save the built-in trainer's state at `step` if it is due or `force`d (preemption) and
        not saved already; returns the seconds this call blocked (0 when it did not save)."""
        if self.saved_step == step or not (force or self.due(step, last_step)):
            return 0.0
        return self.save(step, model, opt)

    def save(self, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        """`save_state` of the built-in trainer's state (`trainer_state`)."""
        return self.save_state(step, trainer_state(model, opt, step))

    def save_state(self, step: int, state: dict) -> float:
        """Start (async) or do (sync) the save of `state` (names to modules, optimizers, Stateful
        objects and plain values) as checkpoint `step`; returns the seconds this call blocked.

        Async: the state's tensors are copied on the save thread after this returns; call
        `wait_for_staging()` before anything changes them (the next optimizer step).
        """
        t0 = time.perf_counter()
        live, state = state, saveable(state)  # a state it cannot save fails here, before any side effect
        self.wait()
        self.saved_step = step
        record = _Save(step, self.dir / partial_name(step, self.attempt_id), time.perf_counter())
        record.partial.mkdir(parents=True, exist_ok=True)
        rng = rng_state(self.device)
        if self.cfg.async_:
            state = _capture(state, _live_storages(live))
            if self.device.type == "cuda":  # the stager's stream must see the clones (and opt.step)
                torch.cuda.current_stream(self.device).synchronize()
            record.staged = threading.Event()
            record.sync_s = time.perf_counter() - t0  # final before the save thread may read it
            self._thread.submit(self._save_async, record, state, rng)
            self._pending = record
        else:
            try:
                _save_file(rng, record.partial / f"rank-{self.rank}.pt")
                dcp.save(state, checkpoint_id=record.partial, process_group=self.group)
            except BaseException as e:  # recorded and re-raised by wait(), like an async failure
                record.error = e
            record.sync_s = time.perf_counter() - t0
            self._pending = record
            self._complete(record)
            self.wait()
        return record.sync_s

    def _save_async(self, record: _Save, state: dict, rng: dict) -> None:
        """The save thread's part of an async save: step 3 of the module docstring, publish."""
        staged = share = None
        try:
            _save_file(rng, record.partial / f"rank-{self.rank}.pt")
            flat, mappings, share = plan_share(state, self.group, self.rank)
            fqns = {index.fqn for index in share}
            copy_ = self._stager.stage({k: v for k, v in flat.items()
                                        if k in fqns and isinstance(v, torch.Tensor)})
            if isinstance(copy_, Future):  # a stager that copies on a thread of its own
                copy_ = copy_.result()
            # entries outside the share stay as they are: the planner never reads them
            staged = unflatten_state_dict({**flat, **copy_}, mappings)
        except BaseException as e:
            record.error = e
        finally:
            record.staged.set()  # from here on only the copy is read
        if record.error is None:
            try:
                dcp.save(staged, checkpoint_id=record.partial, process_group=self.group,
                         planner=ShareSavePlanner(share))
            except BaseException as e:
                record.error = e
        self._complete(record)

    def wait_for_staging(self) -> float:
        """Call before anything changes the model's or optimizer's state (the optimizer step):
        blocks until the save in flight holds its own copy of that state. Returns the seconds
        waited; they count in that save's blocking_s. Cheap when nothing is being staged."""
        record = self._pending
        if record is None or record.staged is None:
            return 0.0
        with record.lock:
            if record.settled or record.waiting:  # finished already, or waited for already
                return 0.0
            record.waiting = True
        t0 = time.perf_counter()
        record.staged.wait()  # a failed copy fails the save: raised by poll()/wait()
        record.staging_wait_s = time.perf_counter() - t0
        record.waited.set()
        return record.staging_wait_s

    def _complete(self, record: _Save) -> None:
        """Runs once per save, last: on the save thread (async) or the training thread (sync)."""
        record.save_s = time.perf_counter() - record.started
        with record.lock:
            record.settled = True
            waiting = record.waiting
        if waiting:
            # The training thread is in wait_for_staging() and returns at once: `staged` was
            # set before the save thread got here.
            record.waited.wait()
        record.blocking_s = record.sync_s + record.staging_wait_s
        try:
            if record.error is None and self.rank == 0:
                manifest = {"format": FORMAT, "job_id": self.job_id, "attempt_id": self.attempt_id,
                            "step": record.step, "world_size": self.world_size,
                            "created_unixtime": time.time(), "size_bytes": dir_size(record.partial),
                            "blocking_s": record.blocking_s, "save_s": record.save_s,
                            # what the control plane checks before it registers the checkpoint
                            "files": {p.name: p.stat().st_size for p in record.partial.iterdir() if p.is_file()}}
                if self.proof_key:
                    manifest[attemptauth.PROOF_FIELD] = attemptauth.manifest_proof(self.proof_key, manifest)
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
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
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
        """Load the built-in trainer's state (model, optimizer, trainer dict) and this rank's RNG
        states from checkpoint `path`."""
        state = trainer_state(model, opt, -1)
        state["trainer"]["batches_consumed"] = -1
        loaded = self.load_state(path, state, seed=seed)
        trainer = state["trainer"]
        return Resumed(int(trainer["step"]), int(trainer["batches_consumed"]), loaded.load_s,
                       loaded.rng_restored)

    def load_state(self, path: Path, state: dict, *, seed: int) -> Resumed:
        """Load checkpoint `path` into `state`'s objects in place (plain values: into the
        mapping) and restore this rank's RNG states (or seed them from (seed, step, rank) when
        the checkpoint holds none for this rank). The step is the manifest's."""
        t0 = time.perf_counter()
        self.wait()  # loading overwrites the state a save in flight may still be copying
        step = int(read_manifest(path)["step"])
        loaded = saveable(state)  # the shapes DCP loads into, in place
        # nothing in a checkpoint is unpickled as code: trainyard/sdk/safeload.py
        dcp.load(loaded, storage_reader=SafeFileSystemReader(path), process_group=self.group,
                 planner=SafeLoadPlanner())
        load_into(state, loaded)
        rng_file = Path(path) / f"rank-{self.rank}.pt"
        restored = rng_file.is_file()
        if restored:  # tensors, ints, floats and strings only: nothing in a checkpoint is unpickled as code
            set_rng_state(torch.load(rng_file, weights_only=True), self.device)
        else:
            seed_rng(seed, step, self.rank, self.device)
        return Resumed(step, step, time.perf_counter() - t0, restored)
