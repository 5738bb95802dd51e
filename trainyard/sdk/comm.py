"""DDP comm hooks that average gradient buckets across ranks, optionally compressed, and count.

Per bucket every hook records
- bytes: `numel * element_size` of every tensor this rank hands to a collective (all_reduce,
  all_gather), counted at the call. This is the payload the rank gives the collective, not wire
  traffic (a ring all-reduce moves ~2(n-1)/n of it each way). `dense_bytes` is what DDP's plain
  all-reduce of the bucket would have handed over; dense_bytes / bytes is the compression ratio.
- an in-flight interval [launch, completion]: from the hook's call (DDP calls it when the
  bucket's gradients are ready) to the averaged bucket, so it spans the bucket's collectives
  and, when compressed, the compression and decompression arithmetic around and between them
  (PowerSGD's P and Q all-reduces run one after the other, with matrix products in between).
  Completion is observed in the future's `then` callback on CPU/gloo; on CUDA the callback runs
  once NCCL work is *enqueued*, so both ends are CUDA events instead and are resolved to seconds
  after the step has synchronised.

From those `StepComm.measure` derives, relative to the end of backward:
- comm_s: wall time during which at least one bucket was in flight (the union of the
  intervals, so overlapping buckets are not double-counted). It includes the part hidden
  behind backward compute.
- exposed_s: the part of comm_s after the last bucket was launched. The last bucket launches
  when the last gradient is produced, so from then on backward() only waits for gradient
  averaging; that wait is what the trainer subtracts from forward+backward wall time to get
  compute_s.

Compression (`comm.compression`, `GradCompression` + `compression_hook`):
- none: DDP's default all-reduce of the fp32 bucket (`counting_allreduce_hook`).
- fp16 / bf16: torch's cast hooks (default_hooks._compress_hook): the bucket is cast, divided by
  the world size, all-reduced in 16 bits and copied back: half the bytes.
- powersgd: torch's PowerSGD hook (rank-r factors P, Q per matrix with error feedback and warm
  start; 1-D tensors such as biases are all-reduced uncompressed).
- topk: `topk_hook`, ours: error feedback + the ceil(ratio x numel) largest |values| per bucket,
  exchanged as int32 indices + values packed into one all_gather. `comm.ratio: auto` sets the ratio from
  the measured link bandwidth and backward time (autoratio.py, driven by sync.py).
Measured on the 2-layer, hidden-64 test GPT (548 KB of fp32 gradients a step, 2 gloo ranks,
tests/workers/runtime/test_accum_compression.py), bytes sent per compressed step relative to none:
fp16 and bf16 0.50, powersgd rank 2 0.054, topk ratio 0.01 0.020 (4-byte index + 4-byte value
per kept entry); mean loss over steps 16-20: none/fp16/bf16 3.91, powersgd 3.93, topk 4.35
(5.53 at step 1).
torch's hooks call `dist.all_reduce` themselves, so they run as copies whose global `dist` is a
counting stand-in (`_counting`): the bytes are measured at the collectives they really make,
not derived from a formula. Steps 1..start_step, and the first step of every attempt, all-reduce
dense: DDP rebuilds its buckets after the first step a process makes, and the compressors'
state (residuals, PowerSGD's P/Q memory) is keyed by bucket. A resumed attempt starts that state
from zero (it is not in the checkpoint): it re-accumulates within a few steps.
"""
# No `from __future__ import annotations`: DDP inspects the hook's annotations and wants
# the real dist.GradBucket / Future[Tensor] objects, not strings.
import math
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook


class CpuClock:
    """Marks are perf_counter floats; valid as soon as they are taken. One thread, no streams:
    whatever a mark brackets, the step waited for."""

    def mark(self) -> Any:
        return time.perf_counter()

    def on_step_stream(self) -> bool:
        return True

    def seconds(self, ref: Any, mark: Any) -> float:
        return mark - ref

    def sync(self) -> None:
        pass


class CudaClock:
    """Marks are CUDA events recorded on the current stream: the time the device reaches them,
    so host stalls (waiting for data, a sleep, Python) count only where the device idled through
    them. `seconds` is valid only after `sync()`: the trainer takes its marks through the step
    and synchronises once, at its end. The step stream is the one current when the clock is
    made (the trainer's); a mark taken on another stream (FSDP2's all-gather and
    reduce-scatter streams) brackets work the step stream did not wait for."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.current_stream(device)

    def mark(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def on_step_stream(self) -> bool:
        return torch.cuda.current_stream(self.device) == self.stream

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
    dense_bytes: int = 0
    launches: list = field(default_factory=list)
    intervals: list = field(default_factory=list)
    # collectives a sharded or pipelined strategy waited for (parallel.CollectiveMeter):
    # (start mark, end mark, whether the step stream waited for it, i.e. it was exposed)
    blocking: list = field(default_factory=list)

    def count(self, tensor: torch.Tensor) -> None:
        """`tensor` is being handed to a gradient collective."""
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def launch(self) -> Any:
        """A bucket is launched now; returns the start mark for `landed`."""
        start = self.clock.mark()
        self.launches.append(start)
        return start

    def landed(self, start: Any, fut: torch.futures.Future) -> torch.futures.Future:
        """`fut` chained with recording [start, completion]; resolves to fut's value."""

        def done(f: torch.futures.Future) -> Any:
            # Runs on the collective's completion thread; list.append is atomic under the GIL and
            # DDP waits on the hook's future before backward() returns, so the trainer reads after it.
            self.intervals.append((start, self.clock.mark()))
            return f.value()

        return fut.then(done)

    def take(self) -> "StepComm":
        out = StepComm(self.bytes_sent, self.launches, self.intervals, self.dense_bytes, self.blocking)
        self.bytes_sent, self.dense_bytes, self.launches, self.intervals = 0, 0, [], []
        self.blocking = []
        return out


@dataclass
class StepComm:
    bytes_sent: int
    launches: list
    intervals: list
    dense_bytes: int = 0
    blocking: list = field(default_factory=list)

    def measure(self, clock: Any, ref: Any, backward_end: Any) -> tuple[float, float]:
        """(comm_s, exposed_s) in seconds; call after `clock.sync()`. DDP's bucket intervals are
        exposed after the last launch; a metered collective is exposed when the step stream
        waited for it (on CPU always: the call blocked the thread)."""
        def span(a: Any, b: Any) -> tuple[float, float]:
            return clock.seconds(ref, a), clock.seconds(ref, b)

        spans = [span(a, b) for a, b in self.intervals]
        exposed = [span(a, b) for a, b, waited in self.blocking if waited]
        if spans:
            last_launch = max(clock.seconds(ref, m) for m in self.launches)
            end = clock.seconds(ref, backward_end)
            exposed += [(max(a, last_launch), min(b, end)) for a, b in spans]
        spans += [span(a, b) for a, b, _ in self.blocking]
        return _union(spans), _union(exposed)


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


def _group(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


def _allreduce_mean(counter: CommCounter, tensor: torch.Tensor,
                    group: Any) -> torch.futures.Future[torch.Tensor]:
    """Average `tensor` across the group in place (DDP's default semantics), counted."""
    group = _group(group)
    tensor.div_(dist.get_world_size(group))
    counter.count(tensor)
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def counting_allreduce_hook(state: CommCounter,
                            bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks (DDP's default semantics) and account for it."""
    tensor = bucket.buffer()
    state.dense_bytes += tensor.numel() * tensor.element_size()
    start = state.launch()
    return state.landed(start, _allreduce_mean(state, tensor, state.group))


# ---- torch's hooks, counted -------------------------------------------------------------------
class _CountingDist:
    """`torch.distributed` as a `_counting` copy of a torch hook sees it: all_reduce is counted."""

    def __init__(self, counter: CommCounter):
        self._counter = counter

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self._counter.count(tensor)
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


def _counting(fn: types.FunctionType, counter: CommCounter) -> types.FunctionType:
    """A copy of module-level function `fn` whose global `dist` counts into `counter`.

    Functions nested in `fn` (PowerSGD's then-callbacks that launch the P and Q all-reduces)
    take their globals from it, so they are counted too; torch's module stays untouched.
    """
    glob = dict(fn.__globals__)
    glob["dist"] = _CountingDist(counter)
    counted = types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, fn.__closure__)
    counted.__kwdefaults__ = fn.__kwdefaults__
    return counted


# ---- compression ------------------------------------------------------------------------------
def topk_count(ratio: float, numel: int) -> int:
    return min(numel, max(1, math.ceil(ratio * numel)))


def topk_select(residual: torch.Tensor, grad: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback + top-k, in place: residual += grad, then the k entries of largest
    magnitude are taken out of it. Returns their (indices, values); `residual` keeps the rest,
    so over any number of steps sum(sent) + residual == sum(grad)."""
    residual.add_(grad)
    idx = residual.abs().topk(k, sorted=False).indices
    values = residual[idx]
    residual.index_fill_(0, idx, 0)
    return idx, values


@dataclass
class GradCompression:
    """DDP comm hook state: which compression, its settings and state, and the byte counter.

    The trainer calls `begin_step(step)` before each optimizer step's forward/backward passes.
    """

    kind: str
    counter: CommCounter
    ratio: float = 0.01
    rank: int = 2
    start_step: int = 0
    seed: int = 0
    group: Any = None
    step: int = 0
    first_step: int | None = None
    residuals: dict = field(default_factory=dict)  # topk: bucket index -> error feedback
    powersgd: Any = None
    tail: Any = None  # powersgd: the previous bucket's future (see `_after_previous`)

    def __post_init__(self) -> None:
        # The values are trainyard.spec's CommSpec.compression, validated there; this only
        # dispatches to each kind's set-up.
        try:
            setup = _SETUP[self.kind]
        except KeyError:
            raise ValueError(f"unknown compression {self.kind!r}: no set-up for it in comm.py") from None
        setup(self)

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.first_step is None:
            self.first_step = step

    @property
    def compressing(self) -> bool:
        return self.kind != "none" and self.step > self.start_step and self.step != self.first_step


def _setup_cast(state: GradCompression) -> None:
    state._cast = _counting(default_hooks._compress_hook, state.counter)
    state._dtype = torch.float16 if state.kind == "fp16" else torch.bfloat16


def _setup_powersgd(state: GradCompression) -> None:
    # start_powerSGD_iter: torch's minimum with error feedback / warm start. When to
    # compress is decided here (`compressing`), so its own iteration count never vetoes.
    state.powersgd = powerSGD_hook.PowerSGDState(
        process_group=state.group, matrix_approximation_rank=state.rank,
        start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
        random_seed=state.seed)
    state._powersgd = _counting(powerSGD_hook.powerSGD_hook, state.counter)


def _no_setup(state: GradCompression) -> None:
    return None


# comm.compression -> what GradCompression sets up for it (compression_hook dispatches the same way).
_SETUP = {"none": _no_setup, "fp16": _setup_cast, "bf16": _setup_cast, "powersgd": _setup_powersgd,
          "topk": _no_setup}


def compression_hook(state: GradCompression,
                     bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks, compressed as `state` says, and account for it."""
    counter = state.counter
    buf = bucket.buffer()
    counter.dense_bytes += buf.numel() * buf.element_size()
    start = counter.launch()
    if not state.compressing:
        fut = _allreduce_mean(counter, buf, state.group)
    elif state.kind == "topk":
        fut = topk_hook(state, bucket)
    elif state.kind == "powersgd":
        def launch() -> torch.futures.Future:
            ps = state.powersgd
            ps.iter = max(ps.iter, ps.start_powerSGD_iter)
            return state._powersgd(ps, bucket)

        fut = state.tail = _after_previous(state.tail, launch)
    else:
        fut = state._cast(state._dtype, state.group, bucket)
    return counter.landed(start, fut)


def _after_previous(prev: Any, launch: Any) -> torch.futures.Future:
    """launch() once `prev` (the previous bucket's PowerSGD chain) has completed.

    PowerSGD launches its P and Q all-reduces from completion callbacks, on gloo's threads. With
    two buckets in flight their collectives would be issued in a timing-dependent order, which
    can differ between ranks; gloo matches collectives by a per-group sequence number taken at
    the call, so the ranks would exchange mismatched buffers (seen on a 100 Mbit/s link with
    a 43 MB model: a gloo abort in the first compressed step). Chaining the buckets' chains
    gives every rank the same order; it costs their overlap with each other, not with backward.
    """
    if prev is None or prev.done():
        return launch()
    out: torch.futures.Future = torch.futures.Future()

    def forward(f: torch.futures.Future) -> None:
        try:
            out.set_result(f.value())
        except Exception as e:  # noqa: BLE001 - handed to DDP through the future
            out.set_exception(e)

    def go(_: torch.futures.Future) -> None:
        try:
            launch().add_done_callback(forward)
        except Exception as e:  # noqa: BLE001
            out.set_exception(e)

    prev.add_done_callback(go)
    return out


def _alignment(parts: list[torch.Tensor]) -> int:
    """Bytes each packed part is padded to, so every part of every rank's row views back as its
    dtype (a view's byte offset must divide by its element size): the largest element size."""
    return max(p.element_size() for p in parts)


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """The 1-D contiguous `parts`' bytes in one uint8 tensor, each padded to `_alignment`."""
    align, chunks = _alignment(parts), []
    for p in parts:
        raw = p.view(torch.uint8)
        chunks.append(raw)
        if pad := -raw.numel() % align:
            chunks.append(raw.new_zeros(pad))
    return torch.cat(chunks)


def _unpack(row: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of one `_pack`ed row as tensors of `like`'s dtypes and sizes."""
    align, out, off = _alignment(like), [], 0
    for p in like:
        nbytes = p.numel() * p.element_size()
        out.append(row[off:off + nbytes].view(p.dtype))
        off += nbytes + (-nbytes % align)
    return out


def topk_hook(state: GradCompression, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sparse averaging with error feedback: every rank sends its k largest |grad + residual|
    entries as (int32 index, value) pairs; each rank adds all of them into a dense bucket and
    divides by the world size. k is fixed per bucket, so all_gather's equal sizes hold.

    Indices and values travel packed in ONE all-gather, and decompression is chained on that
    work's own future. On NCCL the future completes when the collective is *enqueued*; only its
    own `then` (the future carries the device) orders the callback after the data has landed.
    Combining several such futures (torch.futures.collect_all) drops the devices, and the
    callback would read the gather buffers before NCCL has written them (issue 14, finding 1)."""
    group = _group(state.group)
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    n = buf.numel()
    residual = state.residuals.get(bucket.index())
    if residual is None:
        residual = state.residuals[bucket.index()] = torch.zeros_like(buf)
    elif residual.numel() != n:  # buckets are only rebuilt after a process's first step, never compressed
        raise RuntimeError(f"top-k: bucket {bucket.index()} has {n} elements but its residual "
                           f"{residual.numel()}: DDP changed its buckets after compression began")
    idx, values = topk_select(residual, buf, topk_count(state.ratio, n))
    parts = [idx.to(torch.int32), values]
    mine = _pack(parts)
    gathered = mine.new_empty(world * mine.numel())
    state.counter.count(mine)
    work = dist.all_gather_single(gathered, mine, group=group, async_op=True)

    def decompress(_: torch.futures.Future) -> torch.Tensor:
        # One index_add_ per rank: a rank's indices are distinct, so no two additions race
        # (CUDA's index_add_ uses atomics) and every rank sums in the same order: the replicas
        # stay bit-identical.
        buf.zero_()
        for row in gathered.view(world, -1):
            i, v = _unpack(row, parts)
            buf.index_add_(0, i.long(), v)
        return buf.div_(world)

    return work.get_future().then(decompress)


@dataclass
class RunComm:
    """Bytes over the run: all steps, and the steps that were compressed."""

    compression: str
    bytes_sent: int = 0
    dense_bytes: int = 0
    compressed_sent: int = 0
    compressed_dense: int = 0

    def add(self, step: StepComm, compressed: bool) -> None:
        self.bytes_sent += step.bytes_sent
        self.dense_bytes += step.dense_bytes
        if compressed:
            self.compressed_sent += step.bytes_sent
            self.compressed_dense += step.dense_bytes

    def summary(self) -> dict:
        """For the rank_finished event: ratios are dense bytes / bytes sent (None: nothing sent)."""
        def ratio(dense: int, sent: int) -> float | None:
            return round(dense / sent, 3) if sent else None

        return {"compression": self.compression, "bytes_sent": self.bytes_sent,
                "dense_bytes": self.dense_bytes,
                "compression_ratio": ratio(self.dense_bytes, self.bytes_sent),
                "compression_ratio_compressed_steps": ratio(self.compressed_dense, self.compressed_sent)}
