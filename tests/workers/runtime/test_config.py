import json
from typing import get_args

import pytest

from trainyard.spec import CheckpointSpec, unsupported_options, validate_job_spec
from trainyard.spec_parallel import CommSpec, ParallelSpec
from workers.runtime.config import ConfigError, load_run_config, parse_run_config

from .conftest import make_launch_config


def test_default_spec_parses_to_the_demo_job(tmp_path):
    raw = make_launch_config(tmp_path, "redis://127.0.0.1:1/0")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    cfg = load_run_config(path)
    assert (cfg.launch.job_id, cfg.launch.attempt_id, cfg.launch.node, cfg.launch.stream) == (7, 9, "node-a", "trainyard:job:7")
    assert cfg.launch.run_dir == tmp_path / "run" and cfg.launch.data_root == tmp_path / "data"
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
    assert cfg.checkpoint == CheckpointSpec(every_steps=5)  # the spec's defaults fill the rest


# The runtime validates the spec with trainyard.spec's JobSpec itself: the messages are the spec's,
# prefixed by the field path.
@pytest.mark.parametrize("sections, message", [
    ({"model": {"vocab": 100}}, "model.vocab: the demo corpus uses byte tokens: vocab must be at least 256"),
    ({"model": {"kind": "rnn"}}, "model.kind: Input should be 'gpt' or 'mlp'"),
    ({"model": {"hidden": 130, "heads": 4}}, r"model: hidden \(130\) must be divisible by heads \(4\)"),
    ({"data": {"kind": "tokens"}}, "data: data.kind 'tokens' needs data.path"),
    ({"data": {"kind": "parquet"}}, "data.kind: Input should be"),
    ({"train": {"lr_schedule": "step"}}, "train.lr_schedule: Input should be 'constant' or 'cosine'"),
    ({"train": {"grad_accum": 0}}, "train.grad_accum: Input should be greater than or equal to 1"),
    ({"train": {"global_batch": 32, "grad_accum": 3}},
     r"train.global_batch: global_batch \(32\) must be divisible by dp x grad_accum = 6"),
    ({"train": {"balance": "fast"}}, "train.balance: Input should be 'none' or 'auto'"),
    ({"parallel": {"schedule": "zb"}}, "parallel.schedule: Input should be '1f1b' or 'gpipe'"),
    ({"comm": {"compression": "zip"}},
     "comm.compression: Input should be 'none', 'fp16', 'bf16', 'powersgd' or 'topk'"),
    ({"comm": {"compression": "topk", "ratio": 0}}, r"comm.ratio: ratio must be a fraction in \(0, 1\]"),
    ({"comm": {"compression": "powersgd", "rank": 0}}, "comm.rank: Input should be greater than or equal to 1"),
    ({"comm": {"start_step": -1}}, "comm.start_step: Input should be greater than or equal to 0"),
    ({"comm": {"sync": "gossip"}}, "comm.sync: Input should be 'allreduce', 'local_sgd' or 'hierarchical'"),
    ({"comm": {"period": 0}}, "comm.period: Input should be greater than or equal to 1"),
    ({"resources": {"device": "tpu"}}, "resources.device: Input should be 'cpu' or 'cuda'"),
])
def test_values_the_runtime_cannot_honour_are_refused_with_the_field_named(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(make_launch_config(tmp_path, "redis://x:1/0", **sections))


@pytest.mark.parametrize("sections, field", [
    ({"parallel": {"tp": 3, "dp": 1}, "resources": {"nodes": 1, "procs_per_node": 3}}, "parallel.tp"),
    ({"parallel": {"pp": 8, "dp": 1}, "resources": {"nodes": 1, "procs_per_node": 8}}, "parallel.pp"),
])
def test_combinations_refused_at_submit_live_in_the_spec_rules_not_the_launch_parse(tmp_path, sections, field):
    # The strategies refuse these again when they build (test_sharded.py, test_pipeline.py).
    raw = make_launch_config(tmp_path, "redis://x:1/0", **sections)
    assert parse_run_config(raw).parallel == ParallelSpec(**raw["spec"]["parallel"])
    assert field in unsupported_options(validate_job_spec(raw["spec"]))


def test_every_compression_the_spec_accepts_has_a_set_up_in_the_runtime():
    from trainyard.sdk import comm

    assert set(get_args(CommSpec.model_fields["compression"].annotation)) == set(comm._SETUP)


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
