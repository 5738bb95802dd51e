"""Step timing on CUDA-like clocks (issue 14, finding 7).

A sharded or pipelined strategy's collectives are timed by parallel.CollectiveMeter with the
step clock. On CUDA the clock's marks are events (tests/runtime/fake_cuda.py fakes them at
torch.cuda's boundary): the meter once dropped every interval that was not a float, so on CUDA
comm_s was 0 and the time the rank waited in collectives (a straggling peer) landed in
compute_s. Collectives are slowed here by a dispatch mode beneath the meter, as a slow peer
would: the wait happens inside the collective's call.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from workers.runtime.comm import CommCounter, CpuClock, CudaClock
from workers.runtime.parallel import CollectiveMeter, MeteredStrategy

from .fake_cuda import FakeStream, install

COLLECTIVE_S = 0.05


class SlowCollectives(TorchDispatchMode):
    """Every collective takes `delay` longer, as if a peer joined it late."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay, self.calls = delay, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
            self.calls += 1
            time.sleep(self.delay)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_cuda(monkeypatch):
    return install(monkeypatch)


@pytest.fixture
def gloo_world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with CollectiveMeter():  # the first collective and dispatch mode set up (seconds, once)
        dist.all_reduce(torch.ones(1))
    yield
    dist.destroy_process_group()


class _AllReducing:
    """A strategy whose backward computes for COMPUTE_S, then all-reduces twice."""

    name = "fake"
    COMPUTE_S = 0.05

    def __init__(self):
        self.module = nn.Linear(2, 2)

    def forward_backward(self, x, y, accum, weight=1.0):
        time.sleep(self.COMPUTE_S)
        t = torch.ones(8)
        dist.all_reduce(t)
        dist.all_reduce(t)
        return t.sum()


def _metered(clock):
    counter = CommCounter(clock)
    strategy = MeteredStrategy(_AllReducing(), counter)
    with SlowCollectives(COLLECTIVE_S) as slow:
        ref = clock.mark()
        strategy.forward_backward(None, None, 1)
        end = clock.mark()
    clock.sync()
    comm_s, exposed_s = counter.take().measure(clock, ref, end)
    return slow.calls, comm_s, exposed_s, clock.seconds(ref, end) - exposed_s


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-clock", "cuda-events"])
def test_waiting_in_collectives_lands_in_comm_s_not_compute_s(gloo_world_of_one, fake_cuda, cuda):
    clock = CudaClock(torch.device("cpu")) if cuda else CpuClock()
    calls, comm_s, exposed_s, compute_s = _metered(clock)
    assert calls == 2
    assert comm_s == pytest.approx(calls * COLLECTIVE_S, abs=0.03)
    assert exposed_s == pytest.approx(comm_s)  # the step waited for every one of them
    assert compute_s == pytest.approx(_AllReducing.COMPUTE_S, abs=0.03)
    assert fake_cuda.syncs == (1 if cuda else 0)


def test_a_collective_on_a_side_stream_is_comm_but_not_exposed(gloo_world_of_one, fake_cuda):
    """FSDP2 launches its all-gathers and reduce-scatters from side streams: the step's stream
    did not wait for them there, so they count in comm_s but are not taken out of compute_s."""
    clock = CudaClock(torch.device("cpu"))
    fake_cuda.current = FakeStream("all-gather")
    calls, comm_s, exposed_s, _ = _metered(clock)
    assert comm_s == pytest.approx(calls * COLLECTIVE_S, abs=0.03) and exposed_s == 0.0


def test_cuda_marks_are_read_only_after_synchronising(fake_cuda):
    clock = CudaClock(torch.device("cpu"))
    a, b = clock.mark(), clock.mark()
    with pytest.raises(RuntimeError, match="device not ready"):
        clock.seconds(a, b)
    clock.sync()
    assert clock.seconds(a, b) >= 0.0
