import json

import pytest

from workers.runtime.config import ConfigError, load_run_config, parse_run_config

from .conftest import make_launch_config


def test_default_spec_parses_to_the_demo_job(tmp_path):
    raw = make_launch_config(tmp_path, "redis://127.0.0.1:1/0")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    cfg = load_run_config(path)
    assert (cfg.job_id, cfg.attempt_id, cfg.node, cfg.stream) == (7, 9, "node-a", "trainyard:job:7")
    assert cfg.run_dir == tmp_path / "run" and cfg.data_root == tmp_path / "data"
    m = cfg.model
    assert (m.kind, m.layers, m.hidden, m.heads, m.seq_len, m.vocab) == ("gpt", 4, 128, 4, 128, 256)
    assert cfg.data.kind == "demo" and cfg.data.path is None
    t = cfg.train
    assert (t.steps, t.global_batch, t.lr, t.lr_schedule, t.seed) == (200, 32, 1e-3, "constant", 0)
    assert cfg.resources.world_size == 2 and cfg.parallel.dp == 2
    assert cfg.per_rank_batch(2) == 16 and cfg.per_rank_batch(4) == 8


def test_unused_spec_keys_are_ignored_and_parallel_auto_means_plain_ddp(tmp_path):
    raw = make_launch_config(tmp_path, "redis://x:1/0", parallel="auto",
                             checkpoint={"every_steps": 5, "future_key": 1})
    cfg = parse_run_config(raw)
    assert cfg.parallel.dp is None and cfg.parallel.tp == 1


@pytest.mark.parametrize("sections, message", [
    ({"model": {"vocab": 100}}, "needs model.vocab >= 256"),
    ({"model": {"kind": "rnn"}}, "model.kind must be gpt or mlp"),
    ({"model": {"hidden": 130, "heads": 4}}, "divisible by model.heads"),
    ({"data": {"kind": "tokens"}}, "needs data.path"),
    ({"data": {"kind": "parquet"}}, "data.kind must be"),
    ({"train": {"lr_schedule": "step"}}, "lr_schedule must be constant or cosine"),
    ({"train": {"grad_accum": 0}}, "train.grad_accum must be an integer >= 1"),
    ({"train": {"global_batch": 32, "grad_accum": 3}}, r"not divisible by the data-parallel size x train.grad_accum = 2 x 3"),
    ({"train": {"balance": "fast"}}, "train.balance must be none or auto"),
    ({"parallel": {"tp": 3, "dp": 1}, "resources": {"nodes": 1, "procs_per_node": 3}},
     "parallel.tp=3 must divide model.heads=4"),
    ({"parallel": {"pp": 8, "dp": 1}, "resources": {"nodes": 1, "procs_per_node": 8}},
     "parallel.pp=8 is more stages than model.layers=4"),
    ({"parallel": {"schedule": "zb"}}, "parallel.schedule must be 1f1b or gpipe"),
    ({"comm": {"compression": "zip"}}, "comm.compression must be one of none, fp16, bf16, powersgd, topk"),
    ({"comm": {"compression": "topk", "ratio": 0}}, r"comm.ratio must be a number in \(0, 1\]"),
    ({"comm": {"compression": "powersgd", "rank": 0}}, "comm.rank must be an integer >= 1"),
    ({"comm": {"start_step": -1}}, "comm.start_step must be an integer >= 0"),
    ({"comm": {"sync": "gossip"}}, "comm.sync must be allreduce, local_sgd or hierarchical"),
    ({"comm": {"period": 0}}, "comm.period must be an integer >= 1"),
    ({"resources": {"device": "tpu"}}, "resources.device must be cpu or cuda"),
])
def test_values_the_runtime_cannot_honour_are_refused_with_the_field_named(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(make_launch_config(tmp_path, "redis://x:1/0", **sections))


def test_compression_and_accumulation_settings_reach_the_runtime(tmp_path):
    cfg = parse_run_config(make_launch_config(
        tmp_path, "redis://x:1/0", train={"global_batch": 16, "grad_accum": 4},
        comm={"compression": "powersgd", "rank": 4, "start_step": 3}))
    assert (cfg.comm.compression, cfg.comm.rank, cfg.comm.start_step) == ("powersgd", 4, 3)
    assert cfg.per_rank_batch(2) == 8 and cfg.micro_batch(2) == 2
    with pytest.raises(ConfigError, match="world size x train.grad_accum = 8 x 4"):
        cfg.micro_batch(8)
    # ratio "auto" only matters to topk; the control plane refuses it at submit anyway
    cfg = parse_run_config(make_launch_config(tmp_path, "redis://x:1/0",
                                              comm={"compression": "topk", "ratio": 0.05}))
    assert (cfg.comm.compression, cfg.comm.ratio) == ("topk", 0.05)


def test_mlp_ignores_heads_and_synthetic_accepts_any_vocab(tmp_path):
    cfg = parse_run_config(make_launch_config(
        tmp_path, "redis://x:1/0", model={"kind": "mlp", "hidden": 130, "heads": 7, "vocab": 50},
        data={"kind": "synthetic"}))
    assert cfg.model.kind == "mlp" and cfg.model.vocab == 50


def test_missing_launch_key_and_indivisible_batch(tmp_path):
    raw = make_launch_config(tmp_path, "redis://x:1/0")
    del raw["stream"]
    with pytest.raises(ConfigError, match="'stream'"):
        parse_run_config(raw)
    cfg = parse_run_config(make_launch_config(tmp_path, "redis://x:1/0", train={"global_batch": 30}))
    with pytest.raises(ConfigError, match="not divisible by the world size 4"):
        cfg.per_rank_batch(4)
