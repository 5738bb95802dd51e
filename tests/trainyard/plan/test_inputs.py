"""Bad planner input is a PlanInputError naming the field, never a traceback or a search."""
import copy

import pytest

from trainyard.plan import PlanInputError, parse_plan_request

GOOD = {"model": {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 256},
        "cluster": {"nodes": 2, "devices_per_node": 2, "device": {"name": "cpu", "memory_gb": 8, "peak_tflops": 0.1},
                    "intra_node_gbs": 5, "inter_node_gbs": 1},
        "global_batch": 16}


def with_(path: str, value):
    data = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return data


def errors_of(data) -> dict:
    with pytest.raises(PlanInputError) as exc:
        parse_plan_request(data)
    return exc.value.errors


def test_a_good_request_parses_with_the_precision_default_per_device():
    assert parse_plan_request(GOOD).dtype == "fp32"
    gpu = with_("cluster.device", {"name": "A100", "memory_gb": 80, "peak_tflops": 312})
    assert parse_plan_request(gpu).dtype == "bf16"
    assert parse_plan_request(with_("precision", "bf16")).dtype == "bf16"


@pytest.mark.parametrize("path,value", [
    ("model.layers", 0), ("model.hidden", -128), ("cluster.nodes", 0), ("cluster.devices_per_node", -1),
    ("cluster.device.memory_gb", 0), ("cluster.device.peak_tflops", -3), ("cluster.intra_node_gbs", 0),
    ("global_batch", 0), ("cluster.nodes", 1_000_000), ("model.layers", 10**6), ("model.hidden", 10**8),
    ("model.seq_len", 10**9), ("global_batch", 10**12), ("model.layers", "4"), ("precision", "fp8"),
    ("fix.tp", 0), ("fix.recompute", "selective"), ("fix.schedule", "interleaved"), ("model.colour", "red"),
])
def test_zero_negative_absurd_or_mistyped_values_name_their_field(path, value):
    assert path in errors_of(with_(path, value))


def test_contradictions_are_field_errors():
    assert "model.heads" in errors_of(with_("model.heads", 3))                       # 3 does not divide 128
    e = errors_of(with_("fix", {"dp": 1, "tp": 2, "pp": 1}))                         # 2 != 4 devices
    assert "dp*tp*pp = 2" in e["fix"][0]
    assert "fix.tp" in errors_of(with_("fix", {"tp": 8}))                            # not a divisor of 4 devices
    assert "fix.pp" in errors_of(with_("fix", {"pp": 3}))                            # 3 does not divide 4
    e = errors_of(with_("model", {"layers": 2, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 256}) | {"fix": {"pp": 4}})
    assert "more stages than the 2 layers" in e["fix.pp"][0]
    assert "fix.tp" in errors_of(with_("model.heads", 2) | {"fix": {"tp": 4}})      # 4 does not divide 2 heads
    assert "fix.shard_optimizer" in errors_of(with_("fix", {"fsdp": True, "shard_optimizer": True}))
    assert "fix.schedule" in errors_of(with_("fix", {"pp": 1, "schedule": "gpipe"}))
    assert "fix.dp" in errors_of(with_("global_batch", 6) | {"fix": {"dp": 4}})     # 6 sequences over 4 replicas


def test_a_model_given_only_by_size_cannot_be_split_and_not_both_forms():
    sized = with_("model", {"params": 1_000_000})
    assert parse_plan_request(sized).model.sized_only
    assert "fix.tp" in errors_of(sized | {"fix": {"tp": 2}})
    assert "model" in errors_of(with_("model.params", 5))
    assert set(errors_of(with_("model", {"layers": 2}))) == {"model.hidden", "model.heads"}


def test_not_an_object():
    assert errors_of([1, 2]) == {"request": ["a plan request is a JSON object {model, cluster, global_batch, ...}"]}
