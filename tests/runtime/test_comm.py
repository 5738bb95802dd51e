import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.runtime.comm import CommCounter, CpuClock, StepComm, _union, counting_allreduce_hook


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
