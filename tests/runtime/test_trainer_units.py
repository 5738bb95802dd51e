import json
import os

import pytest

from workers.runtime.config import ConfigError, TrainConfig, parse_run_config
from workers.runtime.trainer import DistEnv, check_world, lr_at, write_rank_file

from .conftest import make_launch_config


def test_warmup_then_constant():
    t = TrainConfig(steps=100, lr=1e-3, warmup_steps=10)
    assert [lr_at(s, t) for s in (1, 5, 10)] == pytest.approx([1e-4, 5e-4, 1e-3])
    assert lr_at(11, t) == lr_at(100, t) == 1e-3


def test_cosine_decays_from_lr_to_a_tenth():
    t = TrainConfig(steps=110, lr=1e-3, warmup_steps=10, lr_schedule="cosine")
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
