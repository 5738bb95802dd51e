"""The plain data-parallel Strategy (DDP) and what every Strategy shares: byte counts of what a
rank holds, the held-out loss, and the meter of the sharded and pipelined strategies'
collectives. The mesh (which rank is where) is trainyard/mesh.py's; `strategy.build_strategy`
picks the Strategy for a mesh.

Data: the ranks of one dp coordinate see the same samples (tp shards the math of one batch,
pp passes it from stage to stage); the global batch is split over dp only.

A Strategy is what the trainer talks to:
- `module`: the model whose parameters the optimizer updates and the checkpoint saves (for DDP
  the DDP wrapper; get_state_dict strips wrappers, so checkpoint keys are the plain model's FQNs
  under every plan, which is what lets one plan's checkpoint load under another).
- `forward_backward(x, y, accum)`: gradients of the mean loss over this dp coordinate's batch,
  as `accum` micro-batches that synchronise only in the last; returns the mean loss as a 0-d
  tensor, the same value on every rank of the job's step (every dp rank's own mean).
- `info()`: mesh shape and meaning, this rank's coordinates and role, bytes of parameters held.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.nn.parallel import DistributedDataParallel as DDP

from trainyard.mesh import Mesh
from trainyard.sdk.optim import optim_bytes, param_bytes  # noqa: F401 (every strategy's byte counts)

from .model import lm_loss


@torch.no_grad()
def eval_loss_of(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """lm_loss of `module` on (x, y) in eval mode, no gradients; train mode again afterwards."""
    module.eval()
    try:
        return lm_loss(module(x), y).item()
    finally:
        module.train()


class DDPStrategy:
    """Plain data parallelism: a full replica per rank, gradients averaged by DDP's buckets
    (through the comm hook that compresses and counts, see comm.py)."""

    name = "ddp"
    dp_group = None  # every rank is a replica: the default group (ZeRO-1 shards the optimizer over it)

    def __init__(self, model: nn.Module, mesh: Mesh, rank: int, device: torch.device,
                 hook_state=None, hook=None):
        self.mesh, self.rank = mesh, rank
        self.module = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                          gradient_as_bucket_view=True)
        if hook is not None:
            self.module.register_comm_hook(hook_state, hook)
        self.inner = model

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, accum: int,
                         weight: float = 1.0) -> torch.Tensor:
        """`weight` scales this rank's contribution to the averaged gradient (balancing: a rank
        with n_i of the N samples uses weight world x n_i / N); the returned loss is unscaled."""
        ddp, total = self.module, None
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            with ddp.no_sync() if i < accum - 1 else contextlib.nullcontext():
                loss = lm_loss(ddp(xm), ym)
                (loss * (weight / accum)).backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total / accum

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Loss of the current model on (x, y) without gradients; called on every rank."""
        return eval_loss_of(self.inner, x, y)

    def info(self) -> dict:
        return {"strategy": self.name, "mesh": self.mesh.describe(),
                "coords": self.mesh.coords(self.rank),
                "role": f"replica {self.mesh.coords(self.rank)['dp']} of {self.mesh.dp}: the whole model",
                "param_bytes": param_bytes(self.inner)}


# c10d ops whose first argument is the output: what this rank hands over is the second.
_OUTPUT_FIRST = frozenset({"_allgather_base_", "_reduce_scatter_base_", "allgather_", "reduce_scatter_",
                           "alltoall_base_", "alltoall_", "allgather_into_tensor_coalesced_",
                           "reduce_scatter_tensor_coalesced_", "allgather_coalesced_", "gather_", "scatter_"})
_RECEIVE_ONLY = frozenset({"recv_", "recv_any_source_", "barrier", "wait_tensor", "monitored_barrier_"})


def _tensor_bytes(arg) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(_tensor_bytes(a) for a in arg)
    return 0


# point-to-point ops: the peer may post its side only later (pipelining batches them), so
# the meter times their call but never waits for them
_P2P = frozenset({"send", "recv_", "recv_any_source_"})


def _wait(out) -> None:
    """Wait for the collective that returned `out`: a c10d op returns its Work (alone or after
    its tensors), a functional collective its output tensors. On CUDA the wait makes the current
    stream wait for the collective (the host goes on); on CPU it blocks until it is done."""
    work = out[-1] if isinstance(out, (tuple, list)) and out else out
    if isinstance(work, torch.ScriptObject):
        dist.Work.unbox(work).wait()
        return
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(t)


class CollectiveMeter(TorchDispatchMode):
    """Counts the bytes this thread hands to collectives and times them: every c10d op (FSDP2's
    all-gathers and reduce-scatters, pipelining's sends, our all-reduces) and functional
    collective (DTensor's tensor-parallel all-reduces and all-gathers) passes through the
    dispatcher, where this mode sees its input tensors. Dispatch modes are per thread, so a
    background checkpoint's collectives are not counted. It intercepts every op (about +35% on
    a tiny CPU model), which is why MeteredStrategy turns it on only for the first steps of an
    attempt.

    Timing: a collective's call only launches it (gloo runs it on its own threads, NCCL on its
    stream), so the meter waits for each one before returning it (p2p ops excepted) and records
    [clock mark before the call, clock mark after the wait] in `spans` as (start, end, exposed):
    perf_counter floats on CPU, CUDA events on the current stream on CUDA (resolved after the
    step's synchronisation; exposed when that stream is the step's, not a side stream)."""

    def __init__(self, clock=None):
        super().__init__()
        self.bytes_sent = 0
        self.calls = 0
        self.clock = clock or _PERF_CLOCK
        self.spans: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in ("c10d", "_c10d_functional"):
            return func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if name not in _RECEIVE_ONLY and args:
            self.bytes_sent += _tensor_bytes(args[1] if name in _OUTPUT_FIRST and len(args) > 1 else args[0])
            self.calls += 1
        start = self.clock.mark()
        out = func(*args, **kwargs)
        if name not in _P2P and name not in _RECEIVE_ONLY:
            _wait(out)
        self.spans.append((start, self.clock.mark(), self.clock.on_step_stream()))
        return out


class _PerfClock:
    def mark(self) -> float:
        return time.perf_counter()

    def on_step_stream(self) -> bool:
        return True


_PERF_CLOCK = _PerfClock()


class MeteredStrategy:
    """A sharded or pipelined strategy whose bytes_sent and comm time are measured at its
    collectives.

    A plan's collectives are the same every step (same shapes, same schedule), so the meter runs
    during the first METERED_STEPS forward/backward calls of the attempt (the first may add
    one-off setup traffic; the last measurement is kept) and each later step reports the bytes
    measured then. comm_s of these steps is the time from each collective's call until it was
    done (the meter waits for it, see CollectiveMeter), with the step clock (CUDA events on
    CUDA); the part the step's stream waited for is exposed and left out of compute_s. Later
    steps report comm_s 0: only DDP's comm hooks time every step."""

    METERED_STEPS = 2

    def __init__(self, inner, counter):
        self.inner, self.counter = inner, counter
        self.module = inner.module
        self.name = getattr(inner, "name", "")
        self._calls = 0
        self._bytes = 0

    def forward_backward(self, x, y, accum, weight: float = 1.0):
        if self._calls < self.METERED_STEPS:
            meter = CollectiveMeter(self.counter.clock if self.counter is not None else None)
            with meter:
                loss = self.inner.forward_backward(x, y, accum, weight)
            self._bytes = meter.bytes_sent
            if self.counter is not None:
                self.counter.blocking.extend(meter.spans)
        else:
            loss = self.inner.forward_backward(x, y, accum, weight)
        self._calls += 1
        if self.counter is not None:
            self.counter.bytes_sent += self._bytes
            self.counter.dense_bytes += self._bytes
        return loss

    def eval_loss(self, x, y) -> float:
        return self.inner.eval_loss(x, y)

    def info(self) -> dict:
        return self.inner.info()

    def __getattr__(self, name):  # anything else the trainer or tests ask of the strategy
        return getattr(self.inner, name)
