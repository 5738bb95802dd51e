"""`comm.ratio: auto` for top-k compression: keep as many entries as the link can exchange while
backward still computes, so the compressed exchange hides behind compute.

Model (per step, this rank; w = world size, D = dense gradient bytes, fp32):
- The dense all-reduces of steps 1..start_step measure the link: a ring all-reduce of B handed
  bytes puts 2(w-1)/w x B on each rank's link, so bandwidth = that / comm_s (comm_s: the time
  at least one bucket was in flight, see comm.py; it includes per-bucket latency, so this is
  the effective bandwidth the gradient exchange really got).
- backward_s = 2/3 of compute_s (forward + backward): backward does ~2x the forward's FLOPs.
- top-k at ratio r hands r x D/4 entries x 8 bytes (int32 index + fp32 value) = 2 r D bytes to
  an all-gather, and each rank receives (w-1) of those: exchange_s = 2 r D (w-1) / bandwidth.
- r = HEADROOM x backward_s x bandwidth / (2 D (w-1)), clamped to [RATIO_MIN, RATIO_MAX]; the
  headroom leaves time for the top-k selection and the scatter-add that run around the exchange.

Re-evaluation: every REEVAL_EVERY steps after the first choice the compressed steps are measured
the same way (an all-gather of b handed bytes puts (w-1) x b on the link), and the ratio is chosen
again when bandwidth or backward_s moved by more than CHANGE since the last choice.

Every rank must use the same ratio (the all-gather needs equal sizes), so the measurements are
averaged across ranks (one 2-float all-reduce on a group of its own, only on decision steps)
before the pure `decide` runs: the same inputs give the same ratio everywhere. Rank 0 reports
each change as a `ratio_changed` job event (old, new, bandwidth_bytes_per_s, backward_s, reason).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

RATIO_MIN, RATIO_MAX = 0.001, 0.25
HEADROOM = 0.8
BACKWARD_SHARE = 2 / 3
REEVAL_EVERY = 50
CHANGE = 0.2
TOPK_BYTES_PER_ENTRY = 8  # int32 index + fp32 value, for a 4-byte dense entry


@dataclass(frozen=True)
class Decision:
    ratio: float
    bandwidth_bytes_per_s: float
    backward_s: float
    reason: str


def choose_ratio(dense_bytes: int, world: int, bandwidth_bytes_per_s: float, backward_s: float,
                 lo: float = RATIO_MIN, hi: float = RATIO_MAX, headroom: float = HEADROOM) -> float:
    """The largest ratio whose exchange fits in headroom x backward_s, clamped to [lo, hi],
    rounded to 4 significant digits (a stable number to log and compare)."""
    if world < 2 or dense_bytes <= 0 or not bandwidth_bytes_per_s > 0:
        return hi
    per_ratio_s = (TOPK_BYTES_PER_ENTRY / 4) * dense_bytes * (world - 1) / bandwidth_bytes_per_s
    r = headroom * max(0.0, backward_s) / per_ratio_s if per_ratio_s > 0 else hi
    return float(f"{min(hi, max(lo, r)):.4g}")


def dense_bandwidth(bytes_handed: float, comm_s: float, world: int) -> float:
    """Link bytes/s of a ring all-reduce that was handed `bytes_handed` (inf when untimed)."""
    return (bytes_handed * 2 * (world - 1) / world) / comm_s if comm_s > 0 else float("inf")


def gather_bandwidth(bytes_handed: float, comm_s: float, world: int) -> float:
    """Link bytes/s of an all-gather that was handed `bytes_handed` by each rank."""
    return bytes_handed * (world - 1) / comm_s if comm_s > 0 else float("inf")


def decide(prev: Decision | None, dense_bytes: int, world: int, bandwidth_bytes_per_s: float,
           backward_s: float, change: float = CHANGE) -> Decision | None:
    """The first choice (prev None), or a new one when bandwidth or backward_s moved by more
    than `change` relative to the last choice's measurements; None: keep `prev`."""
    if prev is None:
        return Decision(choose_ratio(dense_bytes, world, bandwidth_bytes_per_s, backward_s),
                        bandwidth_bytes_per_s, backward_s, "initial")
    reasons = []
    if _moved(prev.bandwidth_bytes_per_s, bandwidth_bytes_per_s, change):
        reasons.append("bandwidth_changed")
    if _moved(prev.backward_s, backward_s, change):
        reasons.append("backward_changed")
    if not reasons:
        return None
    return Decision(choose_ratio(dense_bytes, world, bandwidth_bytes_per_s, backward_s),
                    bandwidth_bytes_per_s, backward_s, "+".join(reasons))


def _moved(old: float, new: float, change: float) -> bool:
    if old == new:
        return False
    if not (old > 0 and old != float("inf")):
        return True
    return abs(new / old - 1) > change


class AutoRatio:
    """Runtime side: collects per-step measurements, agrees on them across ranks on decision
    steps and sets `compression.ratio` (a GradCompression with kind topk)."""

    def __init__(self, compression: Any, world: int, group: Any, event: Callable[..., None],
                 say: Callable[[str], None] = lambda line: None):
        self.compression, self.world, self.group = compression, world, group
        self.event, self.say = event, say
        compression.ratio = RATIO_MAX  # unused until the first decision (no step compresses before it)
        self.decision: Decision | None = None
        self.decided_at = 0
        self.window: list[tuple[float, float, float]] = []  # (bandwidth, backward_s, dense_bytes)

    def observe(self, step: int, bytes_sent: int, dense_bytes: int, comm_s: float,
                compute_s: float, compressed: bool) -> None:
        """After step `step` (all ranks call this every step)."""
        if dense_bytes > 0:
            bw = (gather_bandwidth(bytes_sent, comm_s, self.world) if compressed
                  else dense_bandwidth(bytes_sent, comm_s, self.world))
            self.window.append((bw, compute_s * BACKWARD_SHARE, float(dense_bytes)))
        next_compresses = step + 1 > self.compression.start_step
        due = (self.decision is None and next_compresses) or (
            self.decision is not None and step - self.decided_at >= REEVAL_EVERY)
        if not due:
            return
        bw, backward_s, dense = self._agreed()
        self.window = []
        self.decided_at = step
        new = decide(self.decision, int(dense), self.world, bw, backward_s)
        if new is None:
            return
        old = self.decision.ratio if self.decision else None
        self.decision = new
        if new.ratio != old:
            self.compression.ratio = new.ratio
            self.event("ratio_changed", step=step, old=old, new=new.ratio,
                       bandwidth_bytes_per_s=_num(bw), backward_s=round(backward_s, 6),
                       reason=new.reason)
            self.say(f"top-k ratio {old} -> {new.ratio} after step {step} ({new.reason}: "
                     f"bandwidth {_num(bw)} B/s, backward {backward_s * 1000:.1f} ms)")

    def _agreed(self) -> tuple[float, float, float]:
        """Medians of this rank's window, averaged over ranks (the same floats on every rank)."""
        if self.window:
            bws = [w[0] for w in self.window if w[0] != float("inf")]
            mine = [statistics.median(bws) if bws else 0.0,
                    statistics.median(w[1] for w in self.window), max(w[2] for w in self.window)]
        else:
            mine = [0.0, 0.0, 0.0]
        t = torch.tensor(mine, dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
            t /= self.world
        bw, backward_s, dense = t.tolist()
        return (bw if bw > 0 else float("inf")), backward_s, dense


def _num(x: float) -> float | None:
    return None if x == float("inf") else round(x, 1)
