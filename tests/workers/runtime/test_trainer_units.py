import json
import os

import pytest

from trainyard.spec import TrainSpec
from workers.runtime.config import ConfigError, parse_run_config
from workers.runtime.trainer import DistEnv, check_world, lr_at, write_rank_file

from .conftest import make_launch_config


def test_warmup_then_constant():
    t = TrainSpec(steps=100, lr=1e-3, warmup_steps=10)
    assert [lr_at(s, t) for s in (1, 5, 10)] == pytest.approx([1e-4, 5e-4, 1e-3])
    assert lr_at(11, t) == lr_at(100, t) == 1e-3


def test_cosine_decays_from_lr_to_a_tenth():
    t = TrainSpec(steps=110, lr=1e-3, warmup_steps=10, lr_schedule="cosine")
    assert lr_at(10, t) == pytest.approx(1e-3)
    assert lr_at(60, t) == pytest.approx(0.55e-3)  # halfway: floor + half the range
    assert lr_at(110, t) == pytest.approx(1e-4)
    lrs = [lr_at(s, t) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_rank_file_is_written_atomically(tmp_path):
    path = write_rank_file(tmp_path, DistEnv(rank=3, local_rank=1, world_size=4, local_world_size=2),
                           "node-b")
    assert path == tmp_path / "ranks" / "1.json"
    assert json.loads(path.read_text()) == {"rank": 3, "local_rank": 1, "pid": os.getpid(),
                                            "node": "node-b"}
    assert [p.name for p in (tmp_path / "ranks").iterdir()] == ["1.json"]  # no temp file left


def test_world_must_match_the_spec(tmp_path):
    cfg = parse_run_config(make_launch_config(tmp_path, "redis://x:1/0"))
    check_world(cfg, DistEnv(0, 0, 2, 2))
    with pytest.raises(ConfigError, match="torchrun started 4 ranks"):
        check_world(cfg, DistEnv(0, 0, 4, 4))


def test_dist_env_outside_torchrun_says_so(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="RANK is not set: run this module under torchrun"):
        DistEnv.from_environ()


@pytest.fixture
def gloo_world_of_one():
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_accumulated_micro_batches_give_the_gradient_and_loss_of_one_batch(gloo_world_of_one):
    import torch

    from trainyard.sdk.comm import CommCounter, CpuClock, counting_allreduce_hook
    from trainyard.spec import ModelSpec
    from workers.runtime.model import build_model
    from trainyard.mesh import Mesh
    from workers.runtime.parallel import DDPStrategy

    mcfg = ModelSpec(layers=2, hidden=32, heads=4, seq_len=16, vocab=256)
    x = torch.randint(0, 256, (8, 16))
    y = torch.randint(0, 256, (8, 16))
    runs = {}
    for accum in (1, 2, 4):
        torch.manual_seed(0)
        model = build_model(mcfg)
        counter = CommCounter(CpuClock())
        strategy = DDPStrategy(model, Mesh(pp=1, dp=1, tp=1), 0, torch.device("cpu"),
                               counter, counting_allreduce_hook)
        loss = strategy.forward_backward(x, y, accum)
        comm = counter.take()
        runs[accum] = (loss.item(), [p.grad.clone() for p in model.parameters()], comm)
    grad_bytes = sum(g.numel() * g.element_size() for g in runs[1][1])
    for accum, (loss, grads, comm) in runs.items():
        assert loss == pytest.approx(runs[1][0], rel=1e-6)
        for g, ref in zip(grads, runs[1][1]):
            assert torch.allclose(g, ref, rtol=1e-5, atol=1e-7)
        # gradients are synchronised once per step, whatever the number of micro-steps
        assert comm.bytes_sent == comm.dense_bytes == grad_bytes, accum
