"""JobSpec `resources`: the node selector (`labels`) and `gpu_memory_gb`, bounded on their own
(issue 16, section 4). Pure pydantic: what parses and the 400 messages, each naming its field."""
import pytest

from trainyard.spec import MAX_LABELS, SpecError, parse_job_spec, validate_job_spec


def errors_of(resources: dict) -> dict[str, list[str]]:
    with pytest.raises(SpecError) as info:
        parse_job_spec({"name": "x", "resources": resources})
    return info.value.errors


def test_labels_and_gpu_memory_parse_and_default():
    spec = parse_job_spec({"name": "x", "resources": {"device": "cuda", "gpu_memory_gb": 80,
                                                      "labels": {"gpu": "a100", "rack": "r2"}}})
    assert spec.to_json()["resources"]["labels"] == {"gpu": "a100", "rack": "r2"}
    assert spec.resources.gpu_memory_gb == 80.0
    plain = parse_job_spec({"name": "x"}).to_json()["resources"]
    assert plain["labels"] == {} and plain["gpu_memory_gb"] is None


@pytest.mark.parametrize("labels,message", [
    ({"bad key": "x"}, "label 'bad key': a key is 1-63 letters"),
    ({"-gpu": "x"}, "a key is 1-63 letters"),
    ({"k" * 64: "v"}, "a key is 1-63 letters"),
    ({"gpu": "a,b"}, "label gpu: value 'a,b' must be 1-63 letters"),
    ({"gpu": "a=b"}, "must be 1-63 letters"),
    ({"gpu": ""}, "must be 1-63 letters"),
    ({"gpu": "v" * 64}, "must be 1-63 letters"),
    ({f"k{i}": "v" for i in range(MAX_LABELS + 1)}, f"at most {MAX_LABELS} labels, got {MAX_LABELS + 1}"),
])
def test_bad_labels_are_refused_with_the_field(labels, message):
    errors = errors_of({"labels": labels})
    assert list(errors) == ["resources.labels"] and message in errors["resources.labels"][0]


def test_label_values_must_be_strings_and_labels_a_mapping():
    assert "resources.labels.rack" in errors_of({"labels": {"rack": 2}})
    assert "resources.labels" in errors_of({"labels": ["gpu=a100"]})


def test_gpu_memory_is_bounded_and_only_for_cuda():
    assert "resources.gpu_memory_gb" in errors_of({"device": "cuda", "gpu_memory_gb": 0})
    assert "resources.gpu_memory_gb" in errors_of({"device": "cuda", "gpu_memory_gb": 10**6})
    assert errors_of({"gpu_memory_gb": 40}) == {
        "resources.gpu_memory_gb": ["gpu_memory_gb applies to a cuda job: set resources.device to cuda, or drop it"]}


def test_the_runtime_reads_a_spec_with_labels():
    stored = parse_job_spec({"name": "x", "resources": {"labels": {"gpu": "a100"}}}).to_json()
    assert validate_job_spec(stored).resources.labels == {"gpu": "a100"}


# ---- elastic node counts and adapt (the adaptive issue's pinned spec) ----------------------------
def test_elastic_nodes_range_is_stored_as_nodes_and_min_nodes():
    spec = parse_job_spec({"name": "e", "resources": {"nodes": {"min": 1, "max": 2}}})
    assert spec.to_json()["resources"]["nodes"] == 2 and spec.to_json()["resources"]["min_nodes"] == 1
    assert spec.resources.elastic and list(spec.resources.node_counts) == [1, 2]
    assert spec.adapt == "advise" and spec.adapt_max == 3
    one = spec.at_nodes(1)
    assert one.resources.nodes == 1 and one.dp == 1 and one.train.global_batch == spec.train.global_batch
    # the stored form parses back to the same spec
    assert parse_job_spec(spec.to_json()).to_json() == spec.to_json()


@pytest.mark.parametrize("resources,field,text", [
    ({"nodes": {"min": 3, "max": 2}}, "resources", "min (3) must not exceed max (2)"),
    ({"nodes": {"min": 1}}, "resources", "nodes is a number or {min: M, max: N}"),
    ({"nodes": {"min": 1, "max": 2, "step": 1}}, "resources", "unknown keys: step"),
    ({"nodes": {"min": 1, "max": 2}, "min_nodes": 1}, "resources", "give the elastic range once"),
    # 20 splits over 2 and 4 ranks but not over 3
    ({"nodes": {"min": 2, "max": 4}}, "train.global_batch", "on 3 nodes that is 3"),
])
def test_elastic_nodes_refused(resources, field, text):
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": "e", "resources": resources, "train": {"global_batch": 20}})
    assert any(text in m for m in e.value.errors[field]), e.value.errors


def test_elastic_job_must_leave_dp_to_the_node_count():
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": "e", "resources": {"nodes": {"min": 1, "max": 2}}, "parallel": {"dp": 2}})
    assert "leave parallel.dp unset" in e.value.errors["parallel.dp"][0]
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": "e", "resources": {"nodes": {"min": 1, "max": 2}}}).at_nodes(3)
    assert "outside [1, 2]" in e.value.errors["resources.nodes"][0]


def test_elastic_job_refuses_what_cannot_run_on_every_count():
    # tp 2 x pp 1 over 1 node x 1 process cannot split: refused naming the count
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": "e", "resources": {"nodes": {"min": 1, "max": 2}, "procs_per_node": 1},
                        "parallel": {"tp": 2}})
    assert "on 1 nodes its 1 processes do not split" in e.value.errors["parallel"][0]
    # local SGD on its least nodes would have a single replica
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": "e", "resources": {"nodes": {"min": 1, "max": 2}, "procs_per_node": 1},
                        "comm": {"sync": "local_sgd"}})
    assert "on its least nodes (1)" in " ".join(e.value.errors["comm.sync"])
    ok = parse_job_spec({"name": "e", "resources": {"nodes": {"min": 1, "max": 2}, "procs_per_node": 2},
                         "comm": {"sync": "local_sgd"}})
    assert ok.at_nodes(1).dp == 2


def test_adapt_is_advise_or_auto():
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": "a", "adapt": "always"})
    assert "adapt" in e.value.errors
    assert parse_job_spec({"name": "a", "adapt": "auto", "adapt_max": 0}).adapt_max == 0
