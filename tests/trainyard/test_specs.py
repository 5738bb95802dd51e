"""JobSpec validation for the data-plane options: parallel plans, accumulation, compression,
synchronization and balancing.

Pure pydantic (no database): what parses, the defaults it fills, and the 400 messages, each
naming its field."""
import pytest

from trainyard.spec import SpecError, parse_job_spec


def errors_of(spec: dict) -> dict[str, list[str]]:
    with pytest.raises(SpecError) as info:
        parse_job_spec(spec)
    return info.value.errors


@pytest.mark.parametrize("comm", [
    {"compression": "fp16"},
    {"compression": "bf16"},
    {"compression": "topk", "ratio": 0.01},
    {"compression": "topk", "ratio": 1},
    {"compression": "powersgd", "rank": 4, "start_step": 10},
    {"compression": "powersgd", "rank": 1, "start_step": 0},
])
def test_every_compression_is_accepted_with_its_settings(comm):
    spec = parse_job_spec({"name": "x", "comm": comm})
    full = spec.to_json()["comm"]
    assert {k: full[k] for k in comm} == comm


def test_compression_defaults_are_filled_in():
    comm = parse_job_spec({"name": "x", "comm": {"compression": "topk"}}).to_json()["comm"]
    assert (comm["compression"], comm["ratio"], comm["rank"], comm["start_step"]) == ("topk", 0.01, 2, 10)


@pytest.mark.parametrize("comm, field, message", [
    ({"compression": "topk", "ratio": 0}, "comm.ratio", "fraction in (0, 1]"),
    ({"compression": "topk", "ratio": -0.5}, "comm.ratio", "fraction in (0, 1]"),
    ({"compression": "topk", "ratio": 1.01}, "comm.ratio", "fraction in (0, 1]"),
    ({"compression": "topk", "ratio": "half"}, "comm.ratio", "fraction in (0, 1]"),
    ({"compression": "topk", "ratio": True}, "comm.ratio", "fraction in (0, 1]"),
    ({"compression": "powersgd", "rank": 0}, "comm.rank", "greater than or equal to 1"),
    ({"compression": "powersgd", "start_step": -1}, "comm.start_step", "greater than or equal to 0"),
    ({"compression": "gzip"}, "comm.compression", "'none', 'fp16', 'bf16', 'powersgd' or 'topk'"),
    ({"compression": "powersgd", "start_iter": 3}, "comm.start_iter", "unknown key"),
])
def test_impossible_compression_settings_are_refused_naming_the_field(comm, field, message):
    errors = errors_of({"name": "x", "comm": comm})
    assert list(errors) == [field] and len(errors[field]) == 1  # one clear message per field
    assert message in errors[field][0], errors


FOUR = {"resources": {"nodes": 2, "procs_per_node": 2}}


@pytest.mark.parametrize("spec", [
    {"parallel": {"tp": 2, "dp": 1}, "resources": {"nodes": 1, "procs_per_node": 2}},
    {"parallel": {"pp": 2, "dp": 1, "microbatches": 4, "schedule": "gpipe"}},
    {"parallel": {"pp": 2, "dp": 1, "microbatches": 2, "schedule": "1f1b"}},
    {"parallel": {"fsdp": True}},
    {"parallel": {"tp": 2, "dp": 2}, **FOUR},
    {"parallel": {"pp": 2, "dp": 2}, **FOUR},
    {"comm": {"sync": "local_sgd", "period": 8}},
    {"comm": {"sync": "hierarchical", "periods": {"node": 2, "global": 8}}, **FOUR},
    {"comm": {"compression": "topk", "ratio": "auto"}},
    {"train": {"balance": "auto"}},
    {"train": {"balance": "auto", "grad_accum": 2}, "comm": {"compression": "powersgd"}},
])
def test_every_data_plane_strategy_is_accepted(spec):
    parse_job_spec({"name": "x", **spec})


@pytest.mark.parametrize("spec, field, message", [
    ({"parallel": {"tp": 3, "dp": 1}, "resources": {"nodes": 1, "procs_per_node": 3}},
     "parallel.tp", "tp (3) must divide model.heads (4)"),
    ({"parallel": {"pp": 8, "dp": 1}, "resources": {"nodes": 2, "procs_per_node": 4}},
     "parallel.pp", "pp (8) must not exceed model.layers (4)"),
    ({"parallel": {"dp": 2, "tp": 2}}, "parallel.dp", "dp x tp x pp = 2 x 2 x 1 must equal"),
    ({"parallel": {"pp": 2, "dp": 1, "microbatches": 3}}, "parallel.microbatches", "divisible by microbatches (3)"),
    ({"parallel": {"pp": 2, "dp": 1, "microbatches": 1}}, "parallel.microbatches", "at least as many micro-batches"),
    ({"parallel": {"pp": 2, "dp": 1}, "train": {"grad_accum": 2}}, "train.grad_accum", "use that instead"),
    ({"parallel": {"pp": 2, "dp": 1, "fsdp": True}}, "parallel.fsdp", "pipeline"),
    ({"parallel": {"tp": 2, "dp": 1, "fsdp": True}}, "parallel.fsdp", "tensor parallelism"),
    ({"parallel": {"tp": 2, "dp": 1}, "model": {"kind": "mlp"}}, "parallel.tp", "no heads"),
    ({"parallel": {"pp": 2, "dp": 1}, "model": {"kind": "mlp"}}, "parallel.pp", "model.kind must be gpt"),
    ({"parallel": {"pp": 2, "tp": 2, "dp": 1}, **FOUR}, "parallel.pp", "tp x pp"),
    ({"parallel": {"fsdp": True}, "comm": {"compression": "fp16"}}, "comm.compression", "plain data parallelism"),
    ({"comm": {"sync": "local_sgd"}, "resources": {"nodes": 1, "procs_per_node": 1}}, "comm.sync",
     "at least 2 data-parallel ranks"),
    ({"comm": {"sync": "local_sgd", "compression": "topk"}}, "comm.compression", "use compression none"),
    ({"comm": {"sync": "hierarchical"}}, "comm.sync", "several nodes with several ranks"),
    ({"comm": {"sync": "hierarchical", "periods": {"node": 4, "global": 6}}, **FOUR}, "comm.periods.global",
     "multiple of the node period"),
    ({"comm": {"ratio": "auto"}}, "comm.ratio", "needs compression topk"),
    ({"comm": {"period": 0}}, "comm.period", "greater than or equal to 1"),
    ({"train": {"balance": "auto"}, "parallel": {"fsdp": True}}, "train.balance", "plain data parallelism"),
    ({"train": {"balance": "auto"}, "comm": {"sync": "local_sgd"}}, "train.balance", "comm.sync allreduce"),
])
def test_impossible_combinations_are_refused_at_submit_naming_the_field(spec, field, message):
    errors = errors_of({"name": "x", **spec})
    assert field in errors, errors
    assert any(message in m for m in errors[field]), errors


def test_the_stored_plan_describes_the_mesh_and_every_rank():
    from jobs.planning.policy import planner
    from trainyard.mesh import stage_layers

    spec = parse_job_spec({"name": "x", "parallel": {"dp": 2, "pp": 2, "microbatches": 4},
                           **FOUR}).to_json()
    plan = planner.describe(spec)
    assert plan["mesh"] == {"pp": 2, "dp": 2, "tp": 1} and plan["strategy"] == "dp 2 × pp 2"
    assert [d["name"] for d in plan["dims"]] == ["pp", "dp"]
    assert [r["coords"] for r in plan["roles"]] == [
        {"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 1, "tp": 0},
        {"pp": 1, "dp": 0, "tp": 0}, {"pp": 1, "dp": 1, "tp": 0}]
    assert plan["roles"][3]["role"] == "replica 1/2, stage 1/2: blocks 2-3"
    tp = planner.describe(parse_job_spec({"name": "x", "parallel": {"dp": 1, "tp": 2},
                                                  "resources": {"nodes": 1, "procs_per_node": 2}}).to_json())
    assert tp["roles"][1]["role"] == "replica 0/1, tp 1/2: heads 2-3" and tp["strategy"] == "tp 2"
    assert [(r.start, r.stop - 1) for r in stage_layers(5, 2)] == [(0, 2), (3, 4)]
    auto = planner.describe(parse_job_spec({"name": "x", "parallel": "auto"}).to_json())
    assert auto["mesh"] == {"pp": 1, "dp": 2, "tp": 1} and auto["strategy"] == "dp 2"
    assert (plan["recompute"], plan["shard_optimizer"], auto["recompute"], auto["shard_optimizer"]) == (
        "none", False, "none", False)
    zero = planner.describe(parse_job_spec(
        {"name": "x", "parallel": {"recompute": "full", "shard_optimizer": True}}).to_json())
    assert (zero["recompute"], zero["shard_optimizer"]) == ("full", True)
    assert zero["roles"][1]["role"] == "replica 1/2 (1/2 of the optimizer state)"
    # a plan stored before these fields existed still describes (as none / false)
    old = parse_job_spec({"name": "x"}).to_json()
    del old["parallel"]["recompute"], old["parallel"]["shard_optimizer"]
    assert (planner.describe(old)["recompute"], planner.describe(old)["shard_optimizer"]) == ("none", False)


def test_grad_accum_needs_the_global_batch_to_split_into_equal_micro_batches():
    spec = parse_job_spec({"name": "x", "train": {"global_batch": 32, "grad_accum": 4}})
    assert spec.train.grad_accum == 4  # 2 ranks x 4 micro-steps x 4 samples
    errors = errors_of({"name": "x", "train": {"global_batch": 32, "grad_accum": 3}})
    assert list(errors) == ["train.global_batch"]
    assert "divisible by dp x grad_accum = 6" in errors["train.global_batch"][0]
    assert "train.grad_accum" in errors_of({"name": "x", "train": {"grad_accum": 0}})


@pytest.mark.parametrize("resources, tp, refused", [
    ({"nodes": 2, "procs_per_node": 1}, 2, True),    # the tp pair is one rank on each node
    ({"nodes": 2, "procs_per_node": 2}, 4, True),    # one group of 4 over both nodes
    ({"nodes": 2, "procs_per_node": 6}, 4, True),    # ranks 4-7 straddle the node boundary at 6
    ({"nodes": 2, "procs_per_node": 2}, 2, False),
    ({"nodes": 2, "procs_per_node": 4}, 2, False),
    ({"nodes": 1, "procs_per_node": 4}, 4, False),   # one node: every group is on it
])
def test_a_tensor_parallel_group_must_fit_on_one_node(resources, tp, refused):
    spec = {"name": "x", "model": {"kind": "gpt", "heads": 4}, "resources": resources,
            "parallel": {"tp": tp}, "train": {"global_batch": 48}}
    if not refused:
        assert parse_job_spec(spec).plan.tp == tp
        return
    with pytest.raises(SpecError) as exc:
        parse_job_spec(spec)
    assert any(f"tp ({tp}) must divide resources.procs_per_node ({resources['procs_per_node']})" in m
               for m in exc.value.errors["parallel.tp"]), exc.value.errors
