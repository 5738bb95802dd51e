"""`Run`: one rank of a training run as the SDK sees it, and `init()`, which builds it.

A Run reports one telemetry sample per step to the job's Redis Stream (reporter.py), saves and
restores checkpoints (checkpoint.py: async DCP, manifest, atomic publish, the `checkpoint`
event the control plane registers), and tells the script when to stop (preempt.py: the ranks
agree on the step). The built-in trainer (workers/runtime/trainer.py) is one user of it: the
same calls, the same samples, the same checkpoints.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainyard.keys import preempt_key
from trainyard.spec import CheckpointSpec, JobSpec

from . import groups, procexit
from .checkpoint import Checkpointer
from .config import RUN_CONFIG_ENV, ConfigError, LaunchConfig, load_launch_config, resume_inside
from .layout import latest_checkpoint, resume_manifest
from .metainit import init_context
from .preempt import PREEMPTED_EXIT_CODE
from .reporter import Reporter
from .stacks import install_stack_dump
from .stopvote import StopVote

PHASES = ("data", "compute", "comm", "optim")
# Sample fields the control plane stores in columns of their own (jobs.models.MetricSample):
# `run.log` puts these at the sample's top level and any other metric under sample["metrics"].
STANDARD_FIELDS = frozenset({"loss", "samples_per_s", "tokens_per_s", "step_s", "data_s", "compute_s",
                             "comm_s", "optim_s", "bytes_sent", "mem_bytes", "compression_ratio", "share"})
STANDALONE_CHECKPOINTS = "checkpoints"  # under the working directory, without a launch config


def say(line: str) -> None:
    """Print one line to stdout in one write (ranks sharing a pipe do not interleave mid-line)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class DistEnv:
    """What torchrun tells this process about its place in the job (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE); `standalone()` is rank 0 of 1."""

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

    @classmethod
    def standalone(cls) -> "DistEnv":
        return cls(0, 0, 1, 1)


def write_rank_file(run_dir: Path, env: DistEnv, node: str) -> Path:
    """<run_dir>/ranks/<local_rank>.json, atomically: the launcher labels logs and pids by it."""
    import json

    ranks = Path(run_dir) / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    final = ranks / f"{env.local_rank}.json"
    tmp = ranks / f".{env.local_rank}.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"rank": env.rank, "local_rank": env.local_rank,
                               "pid": os.getpid(), "node": node}))
    os.replace(tmp, final)
    return final


class Preempted(SystemExit):
    """Raised by `Run.finish()` on every rank once they agreed to stop: the process exits with
    PREEMPTED_EXIT_CODE (83), which the control plane reads as "checkpointed, resume me". A
    SystemExit, so torchrun's @record does not write it up as an error."""

    def __init__(self, step: int | None):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step


class Offline:
    """The reporter of a run without a launch config: telemetry goes nowhere, nothing preempts."""

    def __init__(self) -> None:
        self.preempt_requested = threading.Event()

    def metric(self, sample: dict) -> None:
        pass

    def event(self, kind: str, **fields: Any) -> None:
        pass

    def close(self, timeout_s: float = 10.0) -> bool:
        return True


class _Phase:
    __slots__ = ("run", "name", "t0")

    def __init__(self, run: "Run", name: str):
        self.run, self.name = run, name

    def __enter__(self) -> "_Phase":
        self.t0 = time.perf_counter()
        if self.run._first_phase is None:
            self.run._first_phase = self.t0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.run._phase_s[self.name] += time.perf_counter() - self.t0


class Run:
    """One rank of a job: its place (`rank`, `local_rank`, `world_size`, `device`), the job's
    `config`, `job_id` and `attempt_id` (None without a launch config), and the calls a training
    loop makes (restore, phase, log, should_checkpoint, checkpoint, should_stop, finish).
    Build it with `trainyard.init()`; the process group must exist (init creates it)."""

    def __init__(self, *, env: DistEnv, device: torch.device, launch: LaunchConfig | None = None,
                 spec: JobSpec | None = None, reporter: Reporter | Offline | None = None,
                 checkpoint_dir: Path | None = None, owns_reporter: bool = False,
                 owns_process_group: bool = False):
        self.rank, self.local_rank, self.world_size = env.rank, env.local_rank, env.world_size
        self.device = device
        self.launch = launch
        self.config: dict = dict(launch.spec.get("config") or {}) if launch else {}
        self.job_id = launch.job_id if launch else None
        self.attempt_id = launch.attempt_id if launch else None
        self.steps = spec.train.steps if spec else None  # the last step (train.steps), if known
        self.spec = spec
        self.seed = self._seed = spec.train.seed if spec else 0
        self.grad_accum = spec.train.grad_accum if spec else 1  # micro-batches per step (run.micro_batches)
        self.node = launch.node if launch else "local"
        self._prepared: Any = None  # prepare.Prepared, once run.prepare built it
        self._loaders: list[Any] = []
        self._restored = 0
        self._reporter = reporter or Offline()
        self._owns_reporter, self._owns_pg = owns_reporter, owns_process_group
        directory = checkpoint_dir or (launch.checkpoint_dir if launch else Path(STANDALONE_CHECKPOINTS).absolute())
        cfg = spec.checkpoint if spec else CheckpointSpec()
        self.every_steps = cfg.every_steps
        self._ckpt = Checkpointer(cfg, directory, job_id=self.job_id, attempt_id=self.attempt_id or 0,
                                  rank=self.rank, world_size=self.world_size, device=device,
                                  reporter=self._reporter, proof_key=launch.proof_key if launch else None)
        self._vote = StopVote(self.world_size)
        self._hooked: set[int] = set()  # optimizers whose step waits for a save's state copy
        self._phase_s = dict.fromkeys(PHASES, 0.0)
        self._phases = {name: _Phase(self, name) for name in PHASES}
        self._first_phase: float | None = None
        self._t_last = time.perf_counter()
        self._logged = False
        self._step: int | None = None
        self._voted: Any = object()  # the step of the last vote
        self.stop_step: int | None = None  # the step the ranks agreed to stop after
        self._stop_t = 0.0
        self._finished = False
        self._rss = _rss_reader()

    # ---- restore ---------------------------------------------------------------------------
    def restore(self, state: dict) -> int:
        """Load the job's resume checkpoint (the latest, or the rollback target the control plane
        chose; standalone: the newest complete one under ./checkpoints) into `state`'s objects,
        in place: modules, optimizers, objects with state_dict/load_state_dict, plain values
        (replaced in `state`). Restores this rank's RNG states too. Returns the checkpoint's
        step, the last completed one; 0 when there is nothing to resume (nothing is loaded)."""
        if self.launch is not None:
            if self.launch.resume is None:
                return 0
            path = resume_inside(self.launch.resume.path, self._ckpt.dir)  # never another job's files
            resume_manifest(self.launch.resume)  # the manifest agrees with the control plane's step
        else:
            path = latest_checkpoint(self._ckpt.dir)
            if path is None:
                return 0
        r = self._ckpt.load_state(path, state, seed=self._seed)
        self._restored = r.step
        if not r.rng_restored:
            say(f"rank {self.rank}: {path} holds no RNG state for rank {self.rank} (saved with another "
                f"world size); seeded its RNGs deterministically from (seed, step, rank) instead")
        if self.rank == 0:
            self._reporter.event("resumed", step=r.step, path=str(path), load_s=r.load_s)
        say(f"rank {self.rank} resumed from step {r.step} ({path}) in {r.load_s:.2f} s")
        self._t_last = time.perf_counter()
        return r.step

    # ---- the job's plan applied to the script's model (prepare.py, loader.py) ----------------
    def init_device(self) -> Any:
        """A context to build the model in: meta parameters under fsdp or tp (metainit.py), else the device."""
        return init_context(self.spec, self.device)

    def prepare(self, model: torch.nn.Module, make_optimizer: Any, *, blocks: str | None = None,
                tp_plan: dict | None = None, seq_len: int | None = None) -> tuple:
        """The job's plan applied to `model` (trainyard/sdk/prepare.py): returns (module, optimizer)
        to train and checkpoint. `make_optimizer(params)` builds the optimizer over the parameters
        it is given; `blocks`: the name of the ModuleList of the model's blocks (found by itself
        otherwise); `tp_plan`: {module-name pattern: "colwise" | "rowwise"} under parallel.tp, in
        place of the default plan (tensorpar.py); `seq_len`: tokens per sample, for parallel auto
        (autoplan.py). Call it once, on every rank, after init and before loader and restore."""
        from .prepare import Prepared

        if self._prepared is not None:
            raise RuntimeError("run.prepare was called already: a run prepares one model")
        self._prepared = Prepared(self, model, make_optimizer, blocks=blocks, tp_plan=tp_plan, seq_len=seq_len)
        return self._prepared.module, self._prepared.opt

    def micro_batches(self, source: Any) -> Any:
        """The next step's batch (`next(source)` for a loader or iterator, else `source`) as
        train.grad_accum micro-batches, gradients averaged only after the last (prepare.py)."""
        if self._prepared is not None:
            return self._prepared.micro_batches(source)
        if self.grad_accum > 1:
            raise ConfigError(f"run.micro_batches: train.grad_accum {self.grad_accum} needs run.prepare(model, ...) "
                              f"first (it holds the gradient averaging back until the last micro-batch)")
        from collections.abc import Iterator

        return iter([next(source) if isinstance(source, Iterator) else source])

    def loader(self, dataset: Any, batch_size: int | None = None, *, shuffle: bool = True,
               collate: Any = None, prefetch: int = 2) -> Any:
        """This data-parallel rank's share of each global batch of `dataset` (loader.py): by default
        train.global_batch / dp samples a step (one tp group's ranks take the same), or `batch_size`.
        Checkpoint it with the model (`run.restore({"data": loader, ...})`) to resume mid-epoch."""
        from .loader import for_run

        loader = for_run(self, dataset, batch_size, shuffle=shuffle, collate=collate, prefetch=prefetch)
        self._loaders.append(loader)
        return loader

    def event(self, kind: str, **fields: Any) -> None:
        """Report an event of this rank (the job's timeline; rank_plan and the like)."""
        self._reporter.event(kind, **fields)

    def next_step(self) -> int:
        """The step the next forward belongs to: after the last logged (or restored) one."""
        return (self._step if self._step is not None else self._restored) + 1

    # ---- telemetry -------------------------------------------------------------------------
    def phase(self, name: str) -> _Phase:
        """A context manager timing one phase of the step: "data", "compute", "comm" or "optim".
        The time spent in each since the last `log` becomes the sample's data_s, compute_s,
        comm_s, optim_s (host wall time: on CUDA, synchronise inside the phase to include the
        device's work). Phases are optional; straggler detection needs compute_s."""
        try:
            return self._phases[name]
        except KeyError:
            raise ValueError(f"run.phase: {name!r} is not one of {', '.join(PHASES)}") from None

    def log(self, step: int, loss: float | None = None, samples: int | None = None, *,
            extra: dict | None = None, **metrics: float) -> dict:
        """Report this rank's sample of `step` (one per rank per step) and return it.

        step_s is the time since the previous `log` (the first: since the first phase, else since
        restore or init); samples_per_s = samples / step_s; data_s..optim_s come from `phase`;
        mem_bytes is measured. A metric named like a standard field (STANDARD_FIELDS: tokens_per_s,
        bytes_sent, step_s, ...) replaces it at the sample's top level; any other goes into
        sample["metrics"] as a float. `extra`: fields put at the top level as they are (the
        built-in trainer's sync fields)."""
        now = time.perf_counter()
        plan = self._plan_fields(step)
        groups.apply_collective_timeout()  # a step is done: start-up is over (no-op after the first)
        start = self._t_last if self._logged or self._first_phase is None else self._first_phase
        sample: dict[str, Any] = {"rank": self.rank, "step": step, "ts": time.time(),
                                  "attempt": self.attempt_id}
        if loss is not None:
            sample["loss"] = float(loss)
        if self._first_phase is not None:
            for name, secs in self._phase_s.items():
                sample[name + "_s"] = secs
        sample["step_s"] = now - start
        for name, value in plan.items():  # what prepare measured, unless the script timed it itself
            if name in ("averaged", "params_checksum"):
                sample[name] = value
            elif name not in metrics and not sample.get(name):
                sample[name] = value
        user = {}
        for name, value in metrics.items():
            if name in STANDARD_FIELDS:
                sample[name] = value
            else:
                try:
                    user[name] = float(value)
                except (TypeError, ValueError):
                    raise TypeError(f"run.log: metric {name!r} must be a number, got {value!r}") from None
        if samples is not None and "samples_per_s" not in metrics:
            sample["samples_per_s"] = samples / sample["step_s"] if sample["step_s"] > 0 else None
        seq_len = ((self._prepared.description or {}).get("seq_len") if self._prepared is not None else None)
        if samples is not None and seq_len and "tokens_per_s" not in metrics and sample["step_s"] > 0:
            sample["tokens_per_s"] = samples * seq_len / sample["step_s"]  # prepare saw the sequence length
        if "mem_bytes" not in sample:
            sample["mem_bytes"] = (torch.cuda.max_memory_allocated(self.device)
                                   if self.device.type == "cuda" else self._rss())
        if user:
            sample["metrics"] = user
        if extra:
            sample.update(extra)
        self._reporter.metric(sample)
        self._step, self._logged, self._first_phase = step, True, None
        self._phase_s = dict.fromkeys(PHASES, 0.0)
        self._t_last = time.perf_counter()
        return sample

    def _plan_fields(self, step: int) -> dict:
        if self._prepared is not None:
            return self._prepared.end_step(step)
        if not self._logged and self.spec is not None and self.spec.user_code:  # the trainer applies its own
            from .prepare import needs_prepare

            wanted = needs_prepare(self.spec)
            if wanted:
                raise ConfigError(f"this job's spec asks for {', '.join(wanted)}, which run.prepare(model, "
                                  f"make_optimizer) applies to the model, but the script logged step {step} "
                                  f"without calling it: call run.prepare after trainyard.init() (see the "
                                  f"README), or remove those settings from the spec")
        return {}

    # ---- checkpoints and stopping ------------------------------------------------------------
    def should_checkpoint(self, step: int) -> bool:
        """Whether to save `step`: every checkpoint.every_steps steps, at the last step
        (train.steps), and when the ranks agreed to stop here (preemption); never twice. Also
        collects a finished background save (raising its error, if it failed). Call it at the
        same point on every rank: it takes part in the stop vote."""
        self._step = step
        self._ckpt.poll()
        stopping = self._stop_agreed(step)
        if self._ckpt.saved_step == step:
            return False
        return stopping or step % self.every_steps == 0 or step == self.steps

    def checkpoint(self, step: int, state: dict) -> float:
        """Save `state` (as for `restore`) as checkpoint `step` on every rank: async DCP save
        (or sync with checkpoint.async false), then rank 0 writes the manifest, publishes the
        directory atomically and reports the `checkpoint` event (the control plane registers it
        and applies retention). Returns the seconds this call held the training thread. The save
        copies the tensors in the background; an optimizer's next step() waits for that copy."""
        self._ckpt.poll()
        blocked = self._ckpt.save_state(step, state)
        covered = set()  # parameters only a hooked optimizer step changes
        for opt in (o for o in state.values() if isinstance(o, torch.optim.Optimizer)):
            # a wrapper (PostLocalSGDOptimizer) steps the optimizer it holds in .optim
            target = opt if hasattr(opt, "_optimizer_step_pre_hooks") else getattr(opt, "optim", None)
            if not hasattr(target, "_optimizer_step_pre_hooks"):
                continue
            if id(target) not in self._hooked:
                target.register_step_pre_hook(self._before_optimizer_step)
                self._hooked.add(id(target))
            covered |= {id(p) for g in opt.param_groups for p in g["params"]}
        if any(id(p) not in covered for m in state.values() if isinstance(m, torch.nn.Module)
               for p in m.parameters()):
            blocked += self._ckpt.wait_for_staging()  # no optimizer step to wait in: wait now
        return blocked

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._ckpt.wait_for_staging()

    def wait_for_staging(self) -> float:
        """Block until the save in flight holds its own copy of the state (the optimizer's step
        does this by itself); returns the seconds waited."""
        return self._ckpt.wait_for_staging()

    def should_stop(self) -> bool:
        """Whether the control plane asked this attempt to stop and save (preemption, drain with
        mode preempt) and every rank agreed: all ranks return True after the same step. Save that step
        (`should_checkpoint` says so), leave the loop and call `finish`, which exits 83."""
        return self._stop_agreed(self._step)

    def _stop_agreed(self, step: int | None) -> bool:
        if step == self._voted or self.stop_step is not None:
            return self.stop_step is not None
        self._voted = step
        if step is not None and step == self.steps:  # the last step: the run ends here anyway
            return False
        if self._vote.vote(self._reporter.preempt_requested.is_set()):
            self.stop_step, self._stop_t = step, time.perf_counter()
        return self.stop_step is not None

    def finish(self) -> None:
        """Wait for the last save to be published, flush the telemetry, destroy the process
        group if `init` created it. After an agreed stop, exits with 83 (raises Preempted)."""
        if self._finished:
            return
        self._finished = True
        try:
            for loader in self._loaders:
                loader.close()
            self._ckpt.close()
            self._vote.close()
            if self.stop_step is not None:
                save_s = time.perf_counter() - self._stop_t
                if self.rank == 0:
                    self._reporter.event("preempted_exit", step=self.stop_step, save_s=round(save_s, 3))
                say(f"rank {self.rank} preempted after step {self.stop_step}: checkpoint saved in "
                    f"{save_s:.2f} s, exiting with {PREEMPTED_EXIT_CODE}")
        finally:
            if self._owns_reporter:
                self._reporter.close()
            if self._owns_pg and dist.is_initialized():
                dist.destroy_process_group()
        if self.stop_step is not None:
            raise Preempted(self.stop_step)


def _rss_reader():
    """This process's resident set size in bytes, cheaply (/proc on Linux; peak RSS elsewhere)."""
    global _STATM_FD
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    if os.path.exists("/proc/self/statm"):
        if _STATM_FD is None:  # kept open for the process: a pread is ~2 us, an open ~10 us
            _STATM_FD = os.open("/proc/self/statm", os.O_RDONLY)
        fd = _STATM_FD
        return lambda: int(os.pread(fd, 128, 0).split()[1]) * page
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


_STATM_FD: int | None = None


def _device(spec: JobSpec | None, env: DistEnv) -> torch.device:
    cuda = spec.resources.device == "cuda" if spec else torch.cuda.is_available()
    if not cuda:
        return torch.device("cpu")
    device = torch.device("cuda", env.local_rank)  # CUDA_VISIBLE_DEVICES holds the node's slots
    torch.cuda.set_device(device)
    return device


def init_process_group(env: DistEnv, device: torch.device, timeout_s: float | None = None) -> bool:
    """Initialise torch.distributed unless it is already (NCCL on CUDA, gloo on CPU; one
    in-process rank when torchrun did not start this process). True if it created the group.
    timeout_s: the collective timeout of every group of the run from its first step
    (trainyard.sdk.groups); None: torch's defaults throughout."""
    if dist.is_initialized():
        return False
    groups.configure(timeout_s)
    if device.type == "cuda":  # device_id binds the NCCL communicator to this rank's GPU up front
        dist.init_process_group(backend="nccl", device_id=device)
    elif "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend="gloo")
    else:
        dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    if device.type != "cuda":  # a user's script ending normally must not abort in finalization
        procexit.settle_at_exit()
    groups.track_group(dist.group.WORLD)
    return True


def init(config_path: str | Path | None = None) -> Run:
    """This rank's Run. Reads the launch config named by $TRAINYARD_RUN_CONFIG (or
    `config_path`): telemetry to the job's stream, checkpoints in the job's directory, the
    resume point, preemption. Without one (a plain `python train.py`) it runs standalone: no
    telemetry, checkpoints under ./checkpoints, rank 0 of 1 unless torchrun started it.
    Initialises torch.distributed unless already done (NCCL on CUDA, gloo on CPU)."""
    install_stack_dump()  # the agent asks a hung rank for its stacks before stopping it
    path = config_path or os.environ.get(RUN_CONFIG_ENV)
    launch = load_launch_config(path) if path else None
    spec = launch.job_spec() if launch else None
    env = DistEnv.from_environ() if "RANK" in os.environ else DistEnv.standalone()
    device = _device(spec, env)
    reporter = None
    if launch is not None:
        write_rank_file(launch.run_dir, env, launch.node)
        reporter = Reporter(launch.redis_url, launch.stream, rank=env.rank, attempt=launch.attempt_id,
                            preempt_key=preempt_key(launch.attempt_id))
        reporter.event("rank_started", pid=os.getpid(), node=launch.node, world_size=env.world_size)
    try:
        owns = init_process_group(env, device, launch.collective_timeout_s if launch else None)
        return Run(env=env, device=device, launch=launch, spec=spec, reporter=reporter,
                   owns_reporter=True, owns_process_group=owns)
    except BaseException:
        if reporter is not None:
            reporter.close()
        raise
