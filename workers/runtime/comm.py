"""DDP comm hook that all-reduces gradient buckets exactly as DDP's default does, and counts.

Per bucket it records
- bytes: `numel * element_size` of the bucket handed to all_reduce. This is the payload the
  rank gives the collective, not wire traffic (a ring all-reduce moves ~2(n-1)/n of it each way).
- an in-flight interval [launch, completion]. Completion is observed in the future's `then`
  callback on CPU/gloo; on CUDA the callback runs once NCCL work is *enqueued*, so both ends are
  CUDA events instead and are resolved to seconds after the step has synchronised.

From those `StepComm.measure` derives, relative to the end of backward:
- comm_s: wall time during which at least one gradient collective was in flight (the union of
  the intervals, so overlapping buckets are not double-counted). It includes the part hidden
  behind backward compute.
- exposed_s: the part of comm_s after the last bucket was launched. The last bucket launches
  when the last gradient is produced, so from then on backward() only waits for the network;
  that wait is what the trainer subtracts from forward+backward wall time to get compute_s.
"""
# No `from __future__ import annotations`: DDP inspects the hook's annotations and wants
# the real dist.GradBucket / Future[Tensor] objects, not strings.
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class CpuClock:
    """Marks are perf_counter floats; valid as soon as they are taken."""

    def mark(self) -> Any:
        return time.perf_counter()

    def seconds(self, ref: Any, mark: Any) -> float:
        return mark - ref

    def sync(self) -> None:
        pass


class CudaClock:
    """Marks are CUDA events on the current stream: GPU time, resolved after `sync()`."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, ref: Any, mark: Any) -> float:
        return ref.elapsed_time(mark) / 1000.0

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


@dataclass
class CommCounter:
    """Hook state: what this rank handed to gradient collectives since the last `take()`."""

    clock: Any
    group: Any = None
    bytes_sent: int = 0
    launches: list = field(default_factory=list)
    intervals: list = field(default_factory=list)

    def take(self) -> "StepComm":
        out = StepComm(self.bytes_sent, self.launches, self.intervals)
        self.bytes_sent, self.launches, self.intervals = 0, [], []
        return out


@dataclass
class StepComm:
    bytes_sent: int
    launches: list
    intervals: list

    def measure(self, clock: Any, ref: Any, backward_end: Any) -> tuple[float, float]:
        """(comm_s, exposed_s) in seconds; call after `clock.sync()`."""
        if not self.intervals:
            return 0.0, 0.0
        spans = sorted((clock.seconds(ref, a), clock.seconds(ref, b)) for a, b in self.intervals)
        last_launch = max(clock.seconds(ref, m) for m in self.launches)
        end = clock.seconds(ref, backward_end)
        return _union(spans), _union([(max(a, last_launch), min(b, end)) for a, b in spans])


def _union(spans: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [a, b] spans (empty ones ignored)."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def counting_allreduce_hook(state: CommCounter,
                            bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks (DDP's default semantics) and account for it."""
    tensor = bucket.buffer()
    state.bytes_sent += tensor.numel() * tensor.element_size()
    group = state.group if state.group is not None else dist.group.WORLD
    start = state.clock.mark()
    state.launches.append(start)
    tensor.div_(dist.get_world_size(group))
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        # Runs on the collective's completion thread; list.append is atomic under the GIL and
        # DDP waits on this future before backward() returns, so the trainer reads after it.
        state.intervals.append((start, state.clock.mark()))
        return f.value()[0]

    return fut.then(done)
