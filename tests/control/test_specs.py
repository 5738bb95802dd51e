"""JobSpec validation for the data-plane options: accumulation and gradient compression.

Pure pydantic (no database): what parses, the defaults it fills, and the 400 messages, each
naming its field."""
import pytest

from jobs.specs import SpecError, parse_job_spec


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


def test_ratio_auto_is_not_supported_yet():
    errors = errors_of({"name": "x", "comm": {"compression": "topk", "ratio": "auto"}})
    assert list(errors) == ["comm.ratio"] and "not supported yet" in errors["comm.ratio"][0]


@pytest.mark.parametrize("spec, field", [
    ({"parallel": {"tp": 2, "dp": 1}}, "parallel.tp"),
    ({"parallel": {"pp": 2, "dp": 1}}, "parallel.pp"),
    ({"parallel": {"fsdp": True}}, "parallel.fsdp"),
    ({"comm": {"sync": "local_sgd"}}, "comm.sync"),
    ({"comm": {"sync": "hierarchical"}}, "comm.sync"),
    ({"train": {"balance": "auto"}}, "train.balance"),
])
def test_the_rest_of_the_data_plane_options_are_still_not_supported_yet(spec, field):
    errors = errors_of({"name": "x", **spec})
    assert field in errors and "not supported yet" in errors[field][0]


def test_grad_accum_needs_the_global_batch_to_split_into_equal_micro_batches():
    spec = parse_job_spec({"name": "x", "train": {"global_batch": 32, "grad_accum": 4}})
    assert spec.train.grad_accum == 4  # 2 ranks x 4 micro-steps x 4 samples
    errors = errors_of({"name": "x", "train": {"global_batch": 32, "grad_accum": 3}})
    assert list(errors) == ["train.global_batch"]
    assert "divisible by dp x grad_accum = 6" in errors["train.global_batch"][0]
    assert "train.grad_accum" in errors_of({"name": "x", "train": {"grad_accum": 0}})
