"""How replicas stay in sync (`comm.sync`): the DDP comm hook, the optimizer wrapper, and what
each step adds to its telemetry sample.

- allreduce: every step all-reduces gradients through comm.py's compression hook (with
  `comm.ratio: auto`, autoratio.py picks top-k's ratio from measured bandwidth and backward time).
  With a compression other than none every sample carries `compression_ratio`: the step's
  dense bytes / bytes sent (None when nothing was sent).
- local_sgd (post-local SGD, Lin et al. 2018): torch's post_localSGD_hook all-reduces gradients
  in steps 1..start_step, then leaves them local (post_local_gradient_allreduce=False); torch's
  PostLocalSGDOptimizer runs AdamW every step and then PeriodicModelAverager(period,
  warmup_steps=start_step), which all-reduces the parameters (averages the models) at the steps
  s with s-1 >= start_step and (s-1-start_step) % period == 0 (torch counts from 0): with
  start_step 3 and period 2 the models are averaged after steps 4, 6, 8, ... and differ after 5, 7.
- hierarchical: the same hook, and torch's HierarchicalModelAverager with {periods.node:
  procs_per_node, periods.global: world}: after start_step, at the steps s with s-1 divisible by
  periods.global all ranks average, at the others divisible by periods.node the ranks of one
  node do (node groups are consecutive ranks, torchrun's numbering of a node's processes).

Both are plain DDP only (no tp/pp/fsdp, no gradient compression): the JobSpec refuses the rest at
submit (trainyard/spec.py `unsupported_options`), as it checks comm.periods.
Accounting: the hook's gradient all-reduces are counted as in comm.py (its copy of torch's hook
sees a counting `dist`), and so is the averager's parameter all-reduce (a copy of torch's
average_parameters with a counting `dist`): a local step reports bytes_sent 0, an averaging step
the parameter bytes. The averaging runs inside the optimizer step; its time is reported in
comm_s (not optim_s). Samples of these runs also carry `averaged` (None, "node" or "global")
and `params_checksum` (float64 sum of this rank's parameters: equal across ranks right after a
global averaging, different in between).

Checkpoints: the trainer saves and loads the wrapper like any optimizer (get_state_dict). The
averager's and hook's step counters are not restored from it: `begin_step` sets both from the
trainer's step, so a resumed attempt averages at the same steps as an uninterrupted one. DCP
stores one copy of every replicated tensor (each from one rank, its pick), and every rank loads
that copy: after a global averaging step the saved model is the averaged one, exactly; the AdamW
moments (per replica after start_step) come back as one rank's per tensor, so a resume is not a
bitwise replay (tests/workers/runtime/test_sync.py: same schedule and bytes, same first losses). A save
at a step without global averaging stores a per-tensor mix of the diverged replicas: best
place checkpoints on global averaging steps (start_step + 1 + k x period for local_sgd).
"""
# No `from __future__ import annotations`: DDP inspects the hook's annotations.
import types
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook as plsgd
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.algorithms.model_averaging import utils as avg_utils
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager,
)
from torch.distributed.optim import PostLocalSGDOptimizer

from .autoratio import AutoRatio
from .comm import CommCounter, GradCompression, StepComm, _counting, compression_hook


def _rebind(fn: types.FunctionType, **names: Any) -> types.FunctionType:
    """A copy of `fn` whose module globals `names` are replaced (torch's module stays untouched)."""
    glob = dict(fn.__globals__)
    glob.update(names)
    out = types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _ratio(dense: int, sent: int) -> float | None:
    return round(dense / sent, 3) if sent else None


class AllReduceSync:
    """Every step all-reduces gradients through the compression hook (comm.py)."""

    name = "allreduce"

    def __init__(self, compression: GradCompression, auto: AutoRatio | None = None):
        self.hook_state, self.hook = compression, compression_hook
        self.compression, self.auto = compression, auto

    def wrap(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return opt

    def begin_step(self, step: int) -> None:
        self.compression.begin_step(step)

    def end_step(self, step: int, comm: StepComm, comm_s: float, compute_s: float) -> tuple[float, dict]:
        """(seconds of communication outside the backward pass, extra sample fields)."""
        if self.auto is not None:
            self.auto.observe(step, comm.bytes_sent, comm.dense_bytes, comm_s, compute_s,
                              self.compression.compressing)
        if self.compression.kind == "none":
            return 0.0, {}
        return 0.0, {"compression_ratio": _ratio(comm.dense_bytes, comm.bytes_sent)}


class _HookState:
    """DDP hook state: torch's PostLocalSGDState and our counter."""

    def __init__(self, counter: CommCounter, start_step: int):
        self.counter = counter
        # subgroup unused: post_local_gradient_allreduce=False leaves gradients local after start
        self.torch_state = plsgd.PostLocalSGDState(process_group=None, subgroup=None,
                                                   start_localSGD_iter=start_step,
                                                   post_local_gradient_allreduce=False)
        counted = types.SimpleNamespace(
            _allreduce_fut=_counting(default_hooks._allreduce_fut, counter))
        self.torch_hook = _rebind(plsgd.post_localSGD_hook, default=counted)


def counted_post_local_sgd_hook(state: _HookState,
                                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's post_localSGD_hook, its all-reduces counted and timed like comm.py's hooks."""
    counter = state.counter
    buf = bucket.buffer()
    counter.dense_bytes += buf.numel() * buf.element_size()
    start = counter.launch()
    return counter.landed(start, state.torch_hook(state.torch_state, bucket))


class _CountedAverager:
    """A torch model averager whose parameter all-reduce is counted and timed, and which only
    averages when the trainer's optimizer step asks (armed by begin_step): get_state_dict steps
    a fresh optimizer once with zero gradients and lr 0 to create its state, outside the loop."""

    def __init__(self, inner: averagers.ModelAverager, counter: CommCounter):
        self.inner, self.counter = inner, counter
        avg = _counting(avg_utils.average_parameters, counter)
        utils = types.SimpleNamespace(average_parameters_or_parameter_groups=_rebind(
            avg_utils.average_parameters_or_parameter_groups, average_parameters=avg))
        self._average = types.MethodType(_rebind(type(inner).average_parameters, utils=utils), inner)
        self.armed = False
        self.level: str | None = None
        self.marks: tuple | None = None

    @property
    def step(self) -> int:
        return self.inner.step

    @step.setter
    def step(self, value: int) -> None:
        self.inner.step = value

    def average_parameters(self, params) -> None:
        if not self.armed:
            return
        self.armed = False
        self.level = self._level()
        clock = self.counter.clock
        start = clock.mark()
        self._average(params)
        self.marks = (start, clock.mark())

    def _level(self) -> str | None:
        inner = self.inner
        if inner.step < inner.warmup_steps:
            return None
        if isinstance(inner, HierarchicalModelAverager):
            for period in reversed(inner._periods):
                if inner.step % period == 0:
                    group = inner.period_process_group_dict[period]
                    return "global" if group is inner.process_group else "node"
            return None
        return "global" if (inner.step - inner.warmup_steps) % inner.period == 0 else None


class _LocalSGDOptimizer(PostLocalSGDOptimizer):
    """PostLocalSGDOptimizer that takes step(closure=None), as get_state_dict calls it."""

    def step(self, closure=None):  # type: ignore[override]
        if closure is not None:
            raise ValueError("local SGD: optimizer closures are not supported")
        super().step()


class LocalSGDSync:
    """Post-local SGD: dense gradient all-reduce until start_step, then local steps and periodic
    (or hierarchical) model averaging."""

    def __init__(self, name: str, counter: CommCounter, averager: averagers.ModelAverager,
                 start_step: int, rank: int, event: Callable[..., None], describe: dict):
        self.name, self.start_step, self.rank = name, start_step, rank
        self.hook_state = _HookState(counter, start_step)
        self.hook = counted_post_local_sgd_hook
        self.averager = _CountedAverager(averager, counter)
        self.event, self.describe = event, describe
        self.first: int | None = None
        self.params: list[torch.Tensor] = []

    def wrap(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.params = [p for g in opt.param_groups for p in g["params"]]
        return _LocalSGDOptimizer(opt, self.averager)

    def begin_step(self, step: int) -> None:
        # torch counts from 0: the hook all-reduces while iter < start_step, the averager
        # averages once step >= warmup_steps; both follow the trainer, resumed or not
        self.hook_state.torch_state.iter = step - 1
        self.averager.step = step - 1
        self.averager.armed = True
        self.averager.level, self.averager.marks = None, None
        if self.first is None:
            self.first = step
        if step == max(self.start_step + 1, self.first) and self.rank == 0:
            self.event("local_sgd_started", step=step, sync=self.name, **self.describe)

    def end_step(self, step: int, comm: StepComm, comm_s: float, compute_s: float) -> tuple[float, dict]:
        avg = self.averager
        avg_s = 0.0
        if avg.marks is not None:
            avg_s = avg.counter.clock.seconds(*avg.marks)
        checksum = torch.stack([p.detach().double().sum() for p in self.params]).sum().item()
        return avg_s, {"averaged": avg.level, "params_checksum": checksum}


def build_sync(sync: str, *, rank: int, world: int, counter: CommCounter,
               compression: GradCompression, auto_ratio: bool, start_step: int, period: int,
               periods: tuple[int, int], procs_per_node: int, event: Callable[..., None],
               say: Callable[[str], None] = lambda line: None):
    """The sync strategy `sync` (comm.sync); call on every rank, after init_process_group and
    before the strategy (both create process groups, which every rank must do in one order).
    auto_ratio: comm.ratio auto (top-k's ratio chosen by autoratio.py); period: local_sgd's;
    periods: hierarchical's (node, global) periods."""
    if sync == "allreduce":
        auto = None
        if auto_ratio:
            # every rank decides the same ratio from agreed inputs; rank 0 reports it
            def quiet(*a, **k):
                return None

            from trainyard.sdk.groups import new_group  # the run's collective timeout
            auto = AutoRatio(compression, world, new_group(backend="gloo"),
                             event if rank == 0 else quiet, say if rank == 0 else quiet)
        return AllReduceSync(compression, auto)
    if sync == "local_sgd":
        averager = averagers.PeriodicModelAverager(period=period, warmup_steps=start_step)
        return LocalSGDSync(sync, counter, averager, start_step, rank, event,
                            {"period": period, "start_step": start_step})
    node, glob = periods  # hierarchical
    levels = OrderedDict()
    if 1 < procs_per_node < world:  # a one-process node has nothing to average within
        levels[node] = procs_per_node
    levels[glob] = world
    averager = HierarchicalModelAverager(levels, warmup_steps=start_step)
    return LocalSGDSync(sync, counter, averager, start_step, rank, event,
                        {"periods": {"node": node, "global": glob}, "procs_per_node": procs_per_node,
                         "start_step": start_step})
