import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainyard.sdk.comm import (CommCounter, CpuClock, GradCompression, RunComm, StepComm, _pack, _union,
                                  _unpack, compression_hook, counting_allreduce_hook, topk_count,
                                  topk_select)


@pytest.mark.parametrize("spans, total", [
    ([], 0.0),
    ([(0.0, 1.0)], 1.0),
    ([(0.0, 1.0), (0.5, 2.0)], 2.0),           # overlap counted once
    ([(0.0, 1.0), (2.0, 3.0)], 2.0),           # gap not counted
    ([(2.0, 3.0), (0.0, 4.0), (1.0, 1.5)], 4.0),  # nested, unsorted
    ([(1.0, 0.5)], 0.0),                        # empty span ignored
])
def test_union_of_in_flight_spans(spans, total):
    assert _union(spans) == pytest.approx(total)


def test_comm_s_is_all_in_flight_time_and_exposed_is_what_follows_the_last_launch():
    # Two buckets: one launched at 0.2 finishing 0.5 (hidden behind backward), the last launched
    # at 0.6 finishing 0.9; backward returned at 0.95.
    step = StepComm(bytes_sent=10, launches=[0.2, 0.6], intervals=[(0.2, 0.5), (0.6, 0.9)])
    comm_s, exposed_s = step.measure(CpuClock(), ref=0.0, backward_end=0.95)
    assert comm_s == pytest.approx(0.6) and exposed_s == pytest.approx(0.3)
    # A bucket still in flight when the last one launched contributes only its tail.
    step = StepComm(10, [0.1, 0.6], [(0.1, 0.8), (0.6, 0.7)])
    assert step.measure(CpuClock(), 0.0, 0.9) == pytest.approx((0.7, 0.2))


@pytest.fixture
def gloo_world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_hook_counts_every_gradient_byte_and_keeps_ddp_semantics(gloo_world_of_one):
    torch.manual_seed(0)
    def net():  # 4 x 1 MB of weights
        return torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))

    model, reference = net(), net()
    reference.load_state_dict(model.state_dict())
    counter = CommCounter(CpuClock())
    # 1 MB buckets over 4 MB of gradients: several collectives per step
    ddp = DDP(model, bucket_cap_mb=1, gradient_as_bucket_view=True)
    ddp.register_comm_hook(counter, counting_allreduce_hook)
    x = torch.randn(4, 512)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # torch 2.13 DDP starts with one bucket and rebuilds by bucket_cap_mb after step 1
    for min_buckets in (1, 3):
        ddp(x).sum().backward()
        step = counter.take()
        assert step.bytes_sent == grad_bytes
        assert len(step.intervals) == len(step.launches) >= min_buckets
        assert all(b >= a for a, b in step.intervals)
        ddp.zero_grad()
    reference(x).sum().backward()  # world of one: the average is the local gradient
    ddp(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad)
    assert counter.take().bytes_sent == grad_bytes and counter.take().bytes_sent == 0


# ---- compression ------------------------------------------------------------------------------
def test_topk_error_feedback_sends_every_gradient_eventually():
    # Pure tensor math: over any number of steps, what was sent plus what is still held back
    # is exactly the sum of the gradients (nothing is lost, nothing invented).
    gen = torch.Generator().manual_seed(0)
    n, k = 1000, 13
    residual = torch.zeros(n, dtype=torch.float64)
    sent_total = torch.zeros(n, dtype=torch.float64)
    grad_total = torch.zeros(n, dtype=torch.float64)
    for _ in range(50):
        grad = torch.randn(n, generator=gen, dtype=torch.float64)
        acc = residual + grad
        idx, values = topk_select(residual, grad, k)
        assert idx.numel() == len(set(idx.tolist())) == k
        # the k entries of largest magnitude of grad + residual, with their values
        assert values.abs().min() >= acc.abs().kthvalue(n - k).values
        assert torch.equal(values, acc[idx])
        assert torch.equal(residual[idx], torch.zeros(k, dtype=torch.float64))
        sent_total.index_add_(0, idx, values)
        grad_total += grad
        assert torch.allclose(sent_total + residual, grad_total, rtol=0, atol=1e-12)


@pytest.mark.parametrize("ratio, numel, k", [(0.01, 1000, 10), (0.01, 1001, 11), (1e-9, 50, 1),
                                             (1.0, 7, 7), (0.5, 1, 1)])
def test_topk_sends_ceil_of_ratio_times_numel_at_least_one(ratio, numel, k):
    assert topk_count(ratio, numel) == k


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def _compressed_steps(kind, steps, **kw):
    """One rank of DDP with `kind`; yields (step, compressing, StepComm, ddp grads, local grads)."""
    torch.manual_seed(0)
    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())
    counter = CommCounter(CpuClock())
    state = GradCompression(kind, counter, **kw)
    ddp = DDP(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(state, compression_hook)
    for step in steps:
        x = torch.randn(8, 64)
        state.begin_step(step)
        ddp(x).square().mean().backward()
        reference(x).square().mean().backward()
        yield (step, state.compressing, counter.take(), [p.grad.clone() for p in model.parameters()],
               [p.grad.clone() for p in reference.parameters()])
        ddp.zero_grad()
        reference.zero_grad()


# 64x64 + 64 + 32x64 + 32 fp32 = 24960 bytes: one bucket
DENSE = (64 * 64 + 64 + 32 * 64 + 32) * 4


@pytest.mark.parametrize("kind, kw, compressed_bytes", [
    ("fp16", {}, DENSE // 2),
    ("bf16", {}, DENSE // 2),
    # rank 2: P (n x 2) and Q (m x 2) per matrix, the biases uncompressed
    ("powersgd", {"rank": 2}, ((64 + 64) * 2 + (32 + 64) * 2 + 64 + 32) * 4),
    # ceil(0.01 x 6240) = 63 int32 indices + 63 fp32 values
    ("topk", {"ratio": 0.01}, 63 * 4 * 2),
])
def test_each_compression_counts_the_bytes_its_collectives_really_carry(gloo_world_of_one, kind, kw,
                                                                         compressed_bytes):
    seen = []
    for step, compressing, comm, grads, local in _compressed_steps(kind, range(1, 6), start_step=2, **kw):
        seen.append(compressing)
        assert comm.dense_bytes == DENSE
        assert comm.bytes_sent == (compressed_bytes if compressing else DENSE), step
        assert len(comm.intervals) == len(comm.launches) == 1  # one bucket: one span, any collectives
        if not compressing:  # dense steps average exactly (a world of one: the local gradient)
            assert all(torch.equal(g, h) for g, h in zip(grads, local))
        elif kind in ("fp16", "bf16"):  # a cast: same gradient to 16-bit precision
            tol = 1e-2 if kind == "bf16" else 1e-3
            assert all(torch.allclose(g, h, rtol=tol, atol=1e-6) for g, h in zip(grads, local))
    assert seen == [False, False, True, True, True]  # steps 1..start_step dense


def test_topk_with_ratio_one_is_exact_averaging(gloo_world_of_one):
    for _, compressing, comm, grads, local in _compressed_steps("topk", range(1, 4), start_step=0,  # noqa: B007 - the last step is checked below
                                                                  ratio=1.0):
        assert all(torch.equal(g, h) for g, h in zip(grads, local))
    assert compressing and comm.bytes_sent == DENSE * 2  # every index and every value


def test_the_first_step_of_an_attempt_is_dense_even_past_start_step(gloo_world_of_one):
    # A resumed attempt (first step 11 > start_step 3): DDP rebuilds its buckets after the
    # process's first step, so the compressors' per-bucket state starts only after it.
    flags = [c for _, c, *_ in _compressed_steps("powersgd", range(11, 14), start_step=3)]
    assert flags == [False, True, True]
    state = GradCompression("none", CommCounter(CpuClock()), start_step=0)
    state.begin_step(5)
    state.begin_step(6)
    assert not state.compressing  # none never compresses
    with pytest.raises(ValueError, match="unknown compression 'zip'"):
        GradCompression("zip", CommCounter(CpuClock()))


def test_run_totals_give_the_compression_ratio_over_the_run_and_the_compressed_steps():
    run = RunComm("topk")
    run.add(StepComm(1000, [], [], dense_bytes=1000), compressed=False)
    for _ in range(3):
        run.add(StepComm(20, [], [], dense_bytes=1000), compressed=True)
    assert run.summary() == {"compression": "topk", "bytes_sent": 1060, "dense_bytes": 4000,
                             "compression_ratio": round(4000 / 1060, 3),
                             "compression_ratio_compressed_steps": 50.0}
    assert RunComm("none").summary()["compression_ratio"] is None


class _DeviceOrderedFuture(torch.futures.Future):
    """What NCCL's `work.get_future()` is to the CPU: complete as soon as the collective is
    enqueued, its output landing only later on the collective's stream. Callbacks chained on this
    future itself are ordered after the data (NCCL's future carries the device and makes the
    callback's stream wait); anything else (collect_all, reading the tensor) sees the buffer as
    it was at enqueue."""

    def __init__(self, land):
        super().__init__()
        self._land = land

    def then(self, callback):
        def ordered(f):
            self._land()
            return callback(f)

        return super().then(ordered)


class _EnqueuedWork:
    def __init__(self, output, staged):
        self.output, self.staged, self.landed = output, staged, False
        self._fut = _DeviceOrderedFuture(self.land)
        self._fut.set_result([output])  # NCCL: done at enqueue

    def land(self):
        if not self.landed:
            self.output.copy_(self.staged)
            self.landed = True

    def wait(self, timeout=None):
        self.land()
        return True

    def get_future(self):
        return self._fut


def test_topk_decompresses_only_data_the_collective_has_delivered(gloo_world_of_one, monkeypatch):
    # Finding 1 of issue 14: the gathered buffers hold garbage (zeros here) until the collective's
    # data lands; a hook that decompresses before that averages zeros instead of the gradients.
    works = []

    def enqueue_only(real):
        def gather(output, input, group=None, async_op=False):
            staged = torch.empty_like(output)
            real(staged, input, group=group)  # the data that will arrive
            output.zero_()                    # what the buffer holds at enqueue
            works.append(_EnqueuedWork(output, staged))
            return works[-1] if async_op else works[-1].wait()
        return gather

    for name in ("all_gather_single", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, enqueue_only(getattr(dist, name)))
    flags = []
    for step, compressing, _, grads, local in _compressed_steps("topk", range(1, 4), start_step=1,
                                                                ratio=1.0):
        flags.append(compressing)
        assert all(torch.equal(g, h) for g, h in zip(grads, local)), f"step {step}: read before landing"
    assert flags == [False, True, True] and len(works) == 2 and all(w.landed for w in works)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k", [1, 7, 64])
def test_topk_packing_round_trips_every_rank_row(dtype, k):
    # Rows of several ranks side by side, as all_gather lays them out: an odd k of 16-bit values
    # or 8-byte values would misalign the next part or row without the padding.
    rows = [[torch.randperm(1000)[:k].to(torch.int32), torch.randn(k).to(dtype)] for _ in range(3)]
    packed = [_pack(r) for r in rows]
    assert len({p.numel() for p in packed}) == 1
    if dtype == torch.float32:
        assert packed[0].numel() == 8 * k  # index + value, no padding
    gathered = torch.cat(packed)
    for row, parts in zip(gathered.view(3, -1), rows):
        got = _unpack(row, parts)
        assert all(g.dtype == p.dtype and torch.equal(g, p) for g, p in zip(got, parts))
