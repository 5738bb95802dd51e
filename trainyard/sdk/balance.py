"""train.balance=auto: heterogeneous load balancing for plain data parallelism (DDP).

Ranks of unequal speed (a slower GPU, a CPU core shared with other work) each take a share of
the step's global batch N proportional to their measured speed, so that they finish their
forward+backward at about the same time instead of the fast ones waiting in the all-reduce.

- Data (data.py `SliceBatches`): every rank walks the same global batch order and gathers only
  its contiguous slice [offset_i, offset_i + n_i) of each step's N samples.
- Exact gradients: rank i scales its loss by weight_i = world x n_i / N before backward. DDP
  averages gradients (sum / world), so the update is sum_i (n_i / N) grad(mean loss over rank
  i's n_i samples) = grad(mean loss over all N samples): the same step as one process on the
  whole global batch, whatever the split. Each rank still reports its own mean loss.
- Speeds: a rank's speed is n_i / compute_s (the trainer's compute_s: forward+backward wall
  time minus the exposed wait for peers' gradients, so a fast rank waiting for a slow one does
  not look slow). Every step the ranks all-gather their speeds on a gloo group of their own
  (one float each, ~0.1-0.3 ms on gloo/CPU), so every rank holds the same history and takes
  the same decision: no leader, no extra broadcast, all switch at the same step.
- Policy (`Balancer`, pure): equal split while warming up; the first step of a process is not
  measured (DDP rebuilds its buckets, allocators warm up: 2-10x a normal step); after WINDOW (5)
  measured steps, n_i is proportional to the per-rank median speed over them (largest
  remainder, every n_i >= unit). From then on, once DRIFT_WINDOW (10) steps were measured under
  the current split, it re-splits when some rank's speed share (speed / sum of speeds), median
  over the last DRIFT_WINDOW steps, differs from the share the split assumed by more than
  DRIFT (10%). A uniform slow-down of all ranks changes no
  share and triggers nothing. The history restarts at every change: speed per sample depends on
  the batch size (fixed per-step costs), so only speeds measured under a split judge it.
- grad_accum k > 1: every n_i is a multiple of k (the unit), so the k micro-batches of a rank
  stay equal and its mean loss is the mean of the micro-batch means.
- Supported only for plain DDP with comm.sync=allreduce (the JobSpec refuses the rest at
  submit, trainyard/spec.py `unsupported_options`): a tensor/pipeline parallel or FSDP rank's
  batch is not its own to resize, and model averaging (local SGD) is not a gradient average the
  weights can correct.

A split decided after step S applies from step S+1 on every rank; rank 0 reports it as a job
event `rebalanced` {step, counts, shares, speeds (the medians it assumed), previous}.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

WINDOW = 5  # measured steps of the warm-up (after 1 unmeasured step), equal split
# Later re-split decisions look at the median of the last 10 steps: on a shared machine a burst
# of other work on one rank's core lasts a few steps. With 5-step medians bench/hetero.py
# re-split 5-9 times in 50 steps, chasing bursts (balanced/ideal 0.87-0.91); with 10, 1-3 times
# (0.91-0.95), on the same loaded 2 cores.
DRIFT_WINDOW = 10
DRIFT = 0.10  # re-split when a rank's speed share drifts this far (relative) from the assumed one


def apportion(total: int, weights: Sequence[float], unit: int = 1) -> list[int]:
    """Integers proportional to `weights`, multiples of `unit`, each >= unit, summing to `total`
    (largest remainder, ties to the lower index). Non-positive or non-finite weights count as
    the smallest positive one (a rank is never starved to nothing)."""
    k = len(weights)
    if k < 1 or unit < 1 or total % unit or total // unit < k:
        raise ValueError(f"cannot split {total} into {k} shares of multiples of {unit}, each >= {unit}")
    good = [w for w in weights if w > 0 and math.isfinite(w)]
    floor_w = min(good) if good else 1.0
    w = [x if x > 0 and math.isfinite(x) else floor_w for x in weights]
    units, s = total // unit, sum(w)
    quota = [units * x / s for x in w]
    got = [max(1, math.floor(q)) for q in quota]
    left = units - sum(got)
    while left > 0:  # the largest remainders get one more unit
        i = max(range(k), key=lambda j: (quota[j] - got[j], -j))
        got[i] += 1
        left -= 1
    while left < 0:  # the minimum of 1 overshot: take from those furthest above their quota
        i = max((j for j in range(k) if got[j] > 1), key=lambda j: (got[j] - quota[j], -j))
        got[i] -= 1
        left += 1
    return [g * unit for g in got]


def offsets(counts: Sequence[int]) -> list[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


def _shares(xs: Sequence[float]) -> list[float]:
    s = sum(xs)
    return [x / s for x in xs]


class Balancer:
    """The pure policy: feed it every rank's speed each step (the same list on every rank);
    it answers the new counts when the split changes from the next step on."""

    def __init__(self, world: int, global_batch: int, unit: int = 1, window: int = WINDOW,
                 drift: float = DRIFT, drift_window: int = DRIFT_WINDOW):
        self.world, self.total, self.unit = world, global_batch, unit
        self.window, self.drift, self.drift_window = window, drift, drift_window
        self.counts = apportion(global_batch, [1.0] * world, unit)
        self.assumed: list[float] | None = None  # the speeds the split is based on (None: equal)
        self.history: list[list[float]] = []
        self.seen = 0

    def observe(self, speeds: Sequence[float]) -> list[int] | None:
        if len(speeds) != self.world:
            raise ValueError(f"expected {self.world} speeds, got {len(speeds)}")
        self.seen += 1
        if self.seen == 1:  # the process's first step: DDP bucket rebuild, cold caches
            return None
        if not all(v > 0 and math.isfinite(v) for v in speeds):
            return None  # a step that did no measurable compute says nothing
        self.history.append(list(speeds))
        window = self.window if self.assumed is None else self.drift_window
        if len(self.history) < window:
            return None
        del self.history[:-window]
        median = [statistics.median(h[i] for h in self.history) for i in range(self.world)]
        if self.assumed is not None and not self.drifted(median):
            return None
        self.history.clear()
        self.assumed = median
        counts = apportion(self.total, median, self.unit)
        if counts == self.counts:
            return None
        self.counts = counts
        return counts

    def drifted(self, speeds: Sequence[float]) -> bool:
        return any(abs(m / a - 1) > self.drift for m, a in zip(_shares(speeds), _shares(self.assumed)))


class Balance:
    """The runtime part on one rank: this rank's slice and loss weight, the per-step speed
    exchange, applying a new split to the data, and the `rebalanced` event."""

    def __init__(self, world: int, rank: int, global_batch: int, unit: int, batches,
                 reporter=None, say: Callable[[str], None] = print, group=None):
        self.world, self.rank, self.total = world, rank, global_batch
        self.policy = Balancer(world, global_batch, unit)
        self.batches, self.reporter, self.say, self.group = batches, reporter, say, group
        self._apply(self.policy.counts)

    @classmethod
    def start(cls, world: int, rank: int, global_batch: int, unit: int, batches, reporter,
              say) -> "Balance":
        """The Balance of a train.balance=auto run, with its gloo group (a collective: every rank
        calls this at the same point)."""
        from trainyard.sdk.groups import new_group  # the run's collective timeout
        return cls(world, rank, global_batch, unit, batches, reporter, say,
                   group=new_group(backend="gloo"))

    def _apply(self, counts: list[int]) -> None:
        self.counts = list(counts)
        self.n = counts[self.rank]
        self.offset = offsets(counts)[self.rank]
        self.share = self.n / self.total
        self.weight = self.world * self.n / self.total  # DDP's mean over ranks -> the batch mean
        self.batches.set_slice(self.offset, self.n)

    def exchange(self, speed: float) -> list[float]:
        """Every rank's speed this step, in rank order (collective)."""
        import torch
        import torch.distributed as dist
        mine = torch.tensor([speed], dtype=torch.float64)
        out = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.group)
        return [t.item() for t in out]

    def after_step(self, step: int, compute_s: float) -> bool:
        """Collective, once per step on every rank; True when the next step uses a new split."""
        speeds = self.exchange(self.n / compute_s if compute_s > 0 else 0.0)
        counts = self.policy.observe(speeds)
        if counts is None:
            return False
        previous = self.counts
        self._apply(counts)
        assumed = [round(v, 2) for v in self.policy.assumed]
        shares = [round(c / self.total, 4) for c in counts]
        if self.rank == 0:
            if self.reporter is not None:
                self.reporter.event("rebalanced", step=step, counts=counts, shares=shares,
                                    speeds=assumed, previous=previous)
            self.say(f"rank 0 rebalanced after step {step}: counts {previous} -> {counts} "
                     f"(speeds, samples/s: {assumed})")
        return True
