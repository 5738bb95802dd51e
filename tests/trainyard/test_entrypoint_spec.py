"""JobSpec for user code (issue 12): `code`, `entrypoint`, `config`, `env`, `python`.

Pure pydantic (no database): what an entrypoint job parses to, that built-in jobs keep their
defaults, and each refusal, naming its field."""
import json

import pytest

from trainyard import usercode
from trainyard.spec import RULES, JobSpec, SpecError, parse_job_spec, validate_job_spec

BUNDLE = "sha256:" + "ab" * 32
SCRIPT = {"code": {"bundle": BUNDLE}, "entrypoint": {"script": "train.py"}}
MODULE = {"entrypoint": {"module": "mypkg.train"}}


def errors_of(spec: dict) -> dict[str, list[str]]:
    with pytest.raises(SpecError) as info:
        parse_job_spec({"name": "x", **spec})
    return info.value.errors


def test_an_entrypoint_job_has_no_model_or_data_and_keeps_what_it_was_given():
    spec = parse_job_spec({"name": "mine", "code": {"bundle": BUNDLE},
                           "entrypoint": {"script": "./src/train.py", "args": ["--lr", "3e-4", 5, 0.5, " a b "]},
                           "config": {"lr": 0.0003, "layers": [1, 2], "nested": {"ok": None}},
                           "env": {"HF_HOME": " /data/hf ", "WORKERS": 4}, "python": "/opt/envs/nlp/bin/python",
                           "train": {"steps": 2000}})
    assert spec.user_code
    full = spec.to_json()
    assert full["model"] is None and full["data"] is None
    assert full["entrypoint"] == {"script": "src/train.py", "module": None,
                                  "args": ["--lr", "3e-4", "5", "0.5", " a b "]}  # numbers as text, never stripped
    assert full["env"] == {"HF_HOME": " /data/hf ", "WORKERS": "4"}
    assert full["config"] == {"lr": 0.0003, "layers": [1, 2], "nested": {"ok": None}}
    assert full["python"] == "/opt/envs/nlp/bin/python" and full["code"] == {"bundle": BUNDLE}
    assert full["train"]["steps"] == 2000
    # the stored form parses back to the same spec (the runtime validates its launch config with it)
    assert validate_job_spec(full).to_json() == full


def test_a_module_entrypoint_needs_no_bundle():
    spec = parse_job_spec({"name": "m", **MODULE})
    assert spec.user_code and spec.code is None and spec.entrypoint.target == "-m mypkg.train"
    assert spec.to_json()["model"] is None


def test_built_in_jobs_keep_their_defaults_and_no_user_code_fields():
    spec = parse_job_spec({"name": "x"})
    assert not spec.user_code
    full = spec.to_json()
    assert full["model"]["kind"] == "gpt" and full["data"] == {"kind": "demo", "path": None}
    assert (full["code"], full["entrypoint"], full["config"], full["env"], full["python"]) == (None, None, {}, {}, None)
    assert parse_job_spec({"name": "x", "model": None, "data": None}).to_json()["model"]["kind"] == "gpt"
    assert JobSpec(name="direct").model is not None  # the defaults hold for direct construction too


@pytest.mark.parametrize("spec, field, message", [
    # exactly one of a built-in model and an entrypoint
    ({**SCRIPT, "model": {"kind": "mlp"}}, "model", "model and entrypoint exclude each other"),
    ({**SCRIPT, "model": {}}, "model", "remove model"),
    ({**MODULE, "data": {"kind": "synthetic"}}, "data", "remove data"),
    ({"entrypoint": {}}, "entrypoint", "exactly one of script"),
    ({"entrypoint": {"script": "/abs/train.py", "module": "a.b"}}, "entrypoint", "exactly one of script"),
    ({"entrypoint": {"script": "t.py", "cmd": "x"}}, "entrypoint.cmd", "unknown key"),
    # script paths: inside the bundle with one, absolute on the nodes without
    ({"code": {"bundle": BUNDLE}, "entrypoint": {"script": "/opt/train.py"}}, "entrypoint.script", "inside the bundle"),
    ({"entrypoint": {"script": "train.py"}}, "entrypoint.script", "without code.bundle, script must be an absolute"),
    ({"code": {"bundle": BUNDLE}, "entrypoint": {"script": "../train.py"}}, "entrypoint.script", "a file path inside"),
    ({"code": {"bundle": BUNDLE}, "entrypoint": {"script": "a/../../t.py"}}, "entrypoint.script", "a file path inside"),
    ({"code": {"bundle": BUNDLE}, "entrypoint": {"script": "."}}, "entrypoint.script", "a file path inside"),
    ({"code": {"bundle": BUNDLE}, "entrypoint": {"script": "a\\b.py"}}, "entrypoint.script", "a file path inside"),
    ({"code": {"bundle": BUNDLE}, "entrypoint": {"script": "t\x00.py"}}, "entrypoint.script", "NUL"),
    ({"code": {"bundle": BUNDLE}, "entrypoint": {"script": "a" * 1025}}, "entrypoint.script", "a file path inside"),
    ({"entrypoint": {"module": "my-pkg.train"}}, "entrypoint.module", "dotted Python module name"),
    ({"entrypoint": {"module": "mypkg..train"}}, "entrypoint.module", "dotted Python module name"),
    ({"entrypoint": {"module": "1pkg"}}, "entrypoint.module", "dotted Python module name"),
    # code
    ({"code": {"bundle": "sha256:ABCD"}, "entrypoint": {"script": "t.py"}}, "code.bundle", "64 lowercase hex"),
    ({"code": {"bundle": "md5:" + "a" * 64}, "entrypoint": {"script": "t.py"}}, "code.bundle", "64 lowercase hex"),
    ({"code": {}, "entrypoint": {"script": "t.py"}}, "code.bundle", "required"),
    # args: count, length, types
    ({**MODULE, "entrypoint": {"module": "a", "args": ["x"] * 257}}, "entrypoint.args", "at most 256"),
    ({**MODULE, "entrypoint": {"module": "a", "args": ["x" * 4097]}}, "entrypoint.args", "limit is 4096"),
    ({**MODULE, "entrypoint": {"module": "a", "args": [None]}}, "entrypoint.args.0", "string or a number"),
    ({**MODULE, "entrypoint": {"module": "a", "args": [True]}}, "entrypoint.args.0", "string or a number"),
    ({**MODULE, "entrypoint": {"module": "a", "args": [["nested"]]}}, "entrypoint.args.0", "string or a number"),
    ({**MODULE, "entrypoint": {"module": "a", "args": ["a\x00b"]}}, "entrypoint.args", "NUL"),
    ({**MODULE, "entrypoint": {"module": "a", "args": "--lr 3"}}, "entrypoint.args", "valid list"),
    # env: names, refused names, count, values
    ({**MODULE, "env": {"hf_home": "x"}}, "env", "must match [A-Z_][A-Z0-9_]*"),
    ({**MODULE, "env": {"9LIVES": "x"}}, "env", "must match"),
    ({**MODULE, "env": {"A-B": "x"}}, "env", "must match"),
    ({**MODULE, "env": {"A" * 129: "x"}}, "env", "at most 128"),
    ({**MODULE, "env": {"TRAINYARD_RUN_CONFIG": "/x"}}, "env", "set by Trainyard's launcher"),
    ({**MODULE, "env": {"TRAINYARD_ANYTHING": "1"}}, "env", "cannot be set"),
    ({**MODULE, "env": {"RANK": "0"}}, "env", "set by torchrun"),
    ({**MODULE, "env": {"LOCAL_RANK": "0"}}, "env", "set by torchrun"),
    ({**MODULE, "env": {"WORLD_SIZE": "8"}}, "env", "set by torchrun"),
    ({**MODULE, "env": {"MASTER_ADDR": "10.0.0.1"}}, "env", "set by torchrun"),
    ({**MODULE, "env": {"MASTER_PORT": "29500"}}, "env", "set by torchrun"),
    ({**MODULE, "env": {"TORCHELASTIC_RUN_ID": "x"}}, "env", "set by torchrun"),
    ({**MODULE, "env": {"PET_NPROC_PER_NODE": "8"}}, "env", "set by torchrun"),
    ({**MODULE, "env": {"PYTHONPATH": "/x"}}, "env", "cannot be set"),
    ({**MODULE, "env": {"PYTHONHOME": "/x"}}, "env", "cannot be set"),
    ({**MODULE, "env": {"LD_PRELOAD": "/evil.so"}}, "env", "cannot be set"),
    ({**MODULE, "env": {"LD_LIBRARY_PATH": "/x"}}, "env", "cannot be set"),
    ({**MODULE, "env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env", "cannot be set"),
    ({**MODULE, "env": {"OMP_NUM_THREADS": "64"}}, "env", "cannot be set"),
    ({**MODULE, "env": {f"V{i}": "x" for i in range(65)}}, "env", "the limit is 64"),
    ({**MODULE, "env": {"A": "x" * 4097}}, "env", "the limit is 4096"),
    ({**MODULE, "env": {"A": None}}, "env", "string or a number"),
    ({**MODULE, "env": {"A": False}}, "env", "string or a number"),
    ({**MODULE, "env": {"A": "a\x00b"}}, "env", "NUL"),
    ({**MODULE, "env": ["A=1"]}, "env", "mapping of NAME: value"),
    # python
    ({**MODULE, "python": "bin/python"}, "python", "absolute path"),
    ({**MODULE, "python": "python3"}, "python", "absolute path"),
    ({**MODULE, "python": "/" + "a" * 1024}, "python", "absolute path"),
    ({**MODULE, "python": "/usr/bin/py\x00thon"}, "python", "NUL"),
    # config: a JSON object, size-capped
    ({**MODULE, "config": {"blob": "x" * (64 * 1024)}}, "config", "the limit is 65536"),
    ({**MODULE, "config": [1, 2]}, "config", "valid dictionary"),
    ({**MODULE, "config": {"x": float("nan")}}, "config", "plain JSON"),
    ({**MODULE, "config": {"x": float("inf")}}, "config", "plain JSON"),
])
def test_user_code_fields_are_bounded_naming_the_field(spec, field, message):
    errors = errors_of(spec)
    assert field in errors, errors
    assert any(message in m for m in errors[field]), errors


@pytest.mark.parametrize("spec, field, message", [
    ({**MODULE, "parallel": {"pp": 2, "dp": 1}}, "parallel", "has no pipeline stages (pp 1)"),
    ({**MODULE, "parallel": {"pp": 2, "dp": 1}}, "parallel", "pp for your own model is not supported yet"),
    ({**MODULE, "resources": {"nodes": 1, "procs_per_node": 4}, "parallel": {"tp": 2, "shard_optimizer": True}},
     "parallel.shard_optimizer", "not tensor-parallel shards"),
    ({**MODULE, "parallel": {"fsdp": True}, "comm": {"compression": "fp16"}}, "comm.compression",
     "needs plain data parallelism"),
    ({**MODULE, "parallel": {"fsdp": True}, "train": {"balance": "auto"}}, "train.balance",
     "needs plain data parallelism"),
    ({"code": {"bundle": BUNDLE}}, "code", "add entrypoint"),
    ({"config": {"lr": 1}}, "config", "applies to an entrypoint job"),
    ({"env": {"HF_HOME": "/x"}}, "env", "applies to an entrypoint job"),
    ({"python": "/usr/bin/python3"}, "python", "applies to an entrypoint job"),
])
def test_user_code_restrictions_are_submit_rules_naming_the_field(spec, field, message):
    errors = errors_of(spec)
    assert field in errors, errors
    assert [m for m in errors[field] if message in m] == errors[field][:1], errors  # ours comes first


@pytest.mark.parametrize("extra", [
    {"comm": {"compression": "topk", "ratio": 0.01}}, {"comm": {"compression": "powersgd", "rank": 4}},
    {"comm": {"compression": "topk", "ratio": "auto"}}, {"comm": {"sync": "local_sgd", "period": 4}},
    {"train": {"grad_accum": 2, "global_batch": 8}}, {"parallel": {"shard_optimizer": True}},
    {"parallel": {"recompute": "full"}}, {"parallel": {"fsdp": True, "recompute": "full"}},
    {"parallel": {"tp": 2}}, {"parallel": {"tp": 2, "dp": 1, "recompute": "full"}, "train": {"grad_accum": 2}},
    {"train": {"balance": "auto"}}, {"train": {"balance": "auto", "grad_accum": 2, "global_batch": 8}},
])
def test_run_prepare_makes_the_data_plane_available_to_user_code(extra):
    """comm, grad_accum, recompute, ZeRO-1, FSDP, tp and balance are applied by run.prepare (trainyard/sdk/prepare.py)."""
    spec = parse_job_spec({"name": "x", **MODULE, "resources": {"nodes": 1, "procs_per_node": 2}, **extra})
    assert spec.user_code and spec.plan.pp == 1


def test_user_code_grad_accum_must_divide_the_global_batch():
    errors = errors_of({**MODULE, "resources": {"nodes": 1, "procs_per_node": 2},
                        "train": {"grad_accum": 3, "global_batch": 8}})
    assert "divisible by dp x grad_accum = 6" in errors["train.global_batch"][0]


def test_built_in_rules_do_not_repeat_the_user_code_message():
    errors = errors_of({**MODULE, "resources": {"nodes": 1, "procs_per_node": 2}, "parallel": {"pp": 2, "dp": 1},
                        "comm": {"compression": "fp16"}, "train": {"balance": "auto"}})
    assert set(errors) == {"parallel", "comm.compression", "train.balance"}
    assert all(len(v) == 1 for v in errors.values()), errors  # no built-in "needs plain ddp" echo


def test_user_code_ignores_the_built_in_batch_rules_but_keeps_the_world_size_rule():
    # global_batch is the built-in trainer's: 3 processes do not have to divide it
    assert parse_job_spec({"name": "x", **MODULE, "resources": {"nodes": 3, "procs_per_node": 1}}).dp == 3
    errors = errors_of({**MODULE, "resources": {"nodes": 2, "procs_per_node": 2}, "parallel": {"dp": 3}})
    assert "parallel.dp" in errors


def test_several_submit_refusals_are_reported_together():
    errors = errors_of({"code": {"bundle": BUNDLE}, "env": {"A": "1"}, "python": "/x/python", "config": {"a": 1}})
    assert set(errors) == {"code", "env", "python", "config"}


def test_the_rules_live_in_the_one_table():
    fields = {(r.on, r.field) for r in RULES}
    for expected in [("spec", "model"), ("spec", "data"), ("spec", "entrypoint"), ("spec", "entrypoint.script"),
                     ("submit", "parallel"), ("submit", "comm.compression"), ("submit", "train.balance"),
                     ("submit", "code"), ("submit", "env"), ("submit", "python"), ("submit", "config")]:
        assert expected in fields


def test_every_user_code_field_is_described():
    for name in ("code", "entrypoint", "config", "env", "python", "model", "data"):
        assert JobSpec.model_fields[name].description, name
    for model in (usercode.CodeSpec, usercode.EntrypointSpec):
        for name, f in model.model_fields.items():
            assert f.description, (model.__name__, name)


def test_config_at_the_cap_is_accepted():
    blob = "x" * (usercode.MAX_CONFIG_BYTES - len(json.dumps({"b": ""}, separators=(",", ":"))))
    assert len(json.dumps({"b": blob}, separators=(",", ":"))) == usercode.MAX_CONFIG_BYTES
    assert parse_job_spec({"name": "x", **MODULE, "config": {"b": blob}}).config["b"] == blob


def test_yaml_values_in_config_must_be_json():
    import datetime
    errors = errors_of({**MODULE, "config": {"when": datetime.date(2026, 1, 1)}})
    assert "config" in errors and "plain JSON" in errors["config"][0]


@pytest.mark.parametrize("name", ["HF_HOME", "NCCL_DEBUG", "_PRIVATE", "TORCH_HOME", "GLOO_SOCKET_IFNAME", "PATH"])
def test_ordinary_env_names_are_accepted(name):
    assert usercode.env_name_problem(name) is None
    assert parse_job_spec({"name": "x", **MODULE, "env": {name: "v"}}).env == {name: "v"}
