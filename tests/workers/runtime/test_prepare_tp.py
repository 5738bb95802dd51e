"""run.prepare's tensor parallelism (trainyard/sdk/tensorpar.py) for a model that is not Trainyard's:
examples/own_model's Llama-style model (q_proj ... down_proj, grouped-query attention shaped by
head_dim) under real torchrun with gloo ranks and a real Redis. Under tp 2 and dp 2 x tp 2 the
mean of the ranks' per-step losses is single-process training's on the same global batch and seed
(fp32, rel 1e-5); a tp checkpoint resumes under dp with the loader mid-epoch; a model tp cannot
split (minGPT's fused c_attn) fails at prepare naming the module. The plan's refusals are unit
tests below (no processes)."""
import importlib.util
import math

import pytest
import torch
from torch import nn

from tests.conftest import REPO
from trainyard.sdk.config import ConfigError
from trainyard.sdk.prepare import find_blocks, needs_prepare
from trainyard.sdk.tensorpar import localise_heads, plan_styles

from .conftest import read_stream
from .test_prepare import STEPS, _losses, _mean_losses, _run, redis_url  # noqa: F401  (redis_url: the fixture)

_found = importlib.util.spec_from_file_location("own_model_train_tp", REPO / "examples" / "own_model" / "train.py")
example = importlib.util.module_from_spec(_found)
_found.loader.exec_module(example)
LLAMA_PARAM_BYTES = 4 * sum(p.numel() for p in example.Llama().parameters())
PLANS = {"tp": (2, {"dp": 1, "tp": 2}, {}), "dp_x_tp": (4, {"dp": 2, "tp": 2}, {}),
         "tp_recompute_accum": (2, {"dp": 1, "tp": 2, "recompute": "full"}, {"grad_accum": 2})}


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory, redis_url) -> list[float]:  # noqa: F811
    proc, _ = _run(tmp_path_factory.mktemp("single"), redis_url, nproc=1, job_id=70, arch="llama")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = _mean_losses(proc.stdout)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    return losses


@pytest.mark.procs
@pytest.mark.parametrize("name", list(PLANS))
def test_tensor_parallelism_trains_a_llama_style_model_as_single_process_training_does(
        name, llama_reference, redis_url, tmp_path):  # noqa: F811
    nproc, parallel, train = PLANS[name]
    proc, cfg = _run(tmp_path, redis_url, nproc=nproc, job_id=71 + list(PLANS).index(name), parallel=parallel,
                     train=train, arch="llama")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(len(v) == nproc for v in _losses(proc.stdout).values())
    assert _mean_losses(proc.stdout) == pytest.approx(llama_reference, rel=1e-5)
    samples, events, _ = read_stream(redis_url, cfg["stream"])
    assert sorted((s["rank"], s["step"]) for s in samples) == [(r, s) for r in range(nproc) for s in range(1, STEPS + 1)]
    dp = parallel["dp"]
    assert all((s["bytes_sent"] > 0) == (dp > 1) for s in samples)  # only dp's average is metered
    plans = {e["rank"]: e for e in events if e["kind"] == "rank_plan"}
    assert set(plans) == set(range(nproc)) and plans[0]["strategy"] == ("tp" if dp == 1 else "dp x tp")
    assert plans[1]["coords"]["tp"] == 1 and plans[nproc - 1]["coords"]["dp"] == dp - 1
    assert "heads 2-3 of 4" in plans[1]["role"] and "by columns: gate_proj, k_proj, q_proj, up_proj, v_proj" in \
        plans[1]["role"] and "by rows: down_proj, o_proj" in plans[1]["role"]
    assert plans[0]["param_bytes"] < 0.6 * LLAMA_PARAM_BYTES  # the blocks' Linear layers halved
    assert plans[0]["model"]["heads"] == 4  # the description is the unsplit model's


@pytest.mark.procs
def test_a_tp_checkpoint_resumes_under_dp_with_the_loader_mid_epoch(llama_reference, redis_url, tmp_path):  # noqa: F811
    first, cfg = _run(tmp_path, redis_url, nproc=2, job_id=75, steps=5, parallel={"dp": 1, "tp": 2}, arch="llama")
    assert first.returncode == 0, first.stdout + first.stderr
    _, events, _ = read_stream(redis_url, cfg["stream"])
    ckpt = [e for e in events if e["kind"] == "checkpoint"][-1]
    resume = {"path": ckpt["path"], "step": 5, "checkpoint_id": 1}
    second, _ = _run(tmp_path, redis_url, nproc=2, job_id=75, steps=STEPS, resume=resume, resume_check=True,
                     arch="llama")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "user rank 1 resumed at 5 consumed 5" in second.stdout
    losses = _losses(first.stdout) | _losses(second.stdout)
    assert [sum(v) / len(v) for _, v in sorted(losses.items())] == pytest.approx(llama_reference, rel=1e-5)


@pytest.mark.procs
def test_a_model_tp_cannot_split_fails_at_prepare_naming_the_module(redis_url, tmp_path):  # noqa: F811
    proc, _ = _run(tmp_path, redis_url, nproc=2, job_id=76, parallel={"dp": 1, "tp": 2})  # minGPT: fused c_attn
    assert proc.returncode != 0
    assert "ConfigError: run.prepare: parallel.tp cannot split 'h.0.attn.c_attn'" in proc.stdout + proc.stderr
    assert "step 1 loss" not in proc.stdout


@pytest.mark.procs
def test_parallel_auto_plans_a_user_model_on_the_ranks_and_applies_the_plan(llama_reference, redis_url, tmp_path):  # noqa: F811
    """Every rank plans the described model with the same inputs (the defaults here: no planner in
    the launch config), applies the best plan and trains as single-process training does."""
    proc, cfg = _run(tmp_path, redis_url, nproc=2, job_id=77, parallel="auto", arch="llama", seq_len=16)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _mean_losses(proc.stdout) == pytest.approx(llama_reference, rel=1e-5)
    said = [line for line in proc.stdout.splitlines() if line.startswith("parallel auto: ")]
    assert len(said) == 1 and "predicted" in said[0] and "best of" in said[0], said
    _, events, _ = read_stream(redis_url, cfg["stream"])
    plans = {e["rank"]: e for e in events if e["kind"] == "rank_plan"}
    auto = plans[0]["auto"]
    chosen = auto["chosen"]
    assert chosen["dp"] * chosen["tp"] == 2 and chosen["pp"] == 1 and auto["candidates"] >= 2
    assert plans[0]["model"]["seq_len"] == 16 and "auto" not in plans[1]
    want = "tp" if chosen["tp"] == 2 else "fsdp" if chosen["fsdp"] else "ddp"
    assert plans[0]["strategy"] == want and all(p["strategy"] == want for p in plans.values())
    assert all(r["why"] for r in auto["runners_up"])


@pytest.mark.procs
def test_parallel_auto_without_the_sequence_length_fails_fast_saying_so(redis_url, tmp_path):  # noqa: F811
    proc, _ = _run(tmp_path, redis_url, nproc=2, job_id=78, parallel="auto", arch="llama")
    assert proc.returncode != 0
    assert "parallel auto plans your model from its shape, which needs the tokens per sample" in proc.stdout + proc.stderr


@pytest.mark.procs
@pytest.mark.parametrize("parallel, arch", [({"fsdp": True}, "mingpt"), ({"dp": 1, "tp": 2}, "llama")],
                         ids=["fsdp", "tp"])
def test_a_model_built_on_the_meta_device_is_materialised_shard_by_shard(parallel, arch, redis_url, tmp_path):  # noqa: F811
    """run.init_device under fsdp / tp: parameters on meta (no memory), run.prepare shards them and
    allocates and initialises only this rank's shards (each module's reset_parameters); buffers
    (minGPT's causal mask) are the ones built at construction. It trains from a fresh init."""
    proc, cfg = _run(tmp_path, redis_url, nproc=2, job_id=79 + len(arch), parallel=parallel, arch=arch, meta=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = _mean_losses(proc.stdout)
    assert abs(losses[0] - math.log(64)) < 0.5 and losses[-1] < losses[0], losses  # vocab 64: a fresh init
    _, events, _ = read_stream(redis_url, cfg["stream"])
    plans = {e["rank"]: e for e in events if e["kind"] == "rank_plan"}
    assert all("built on the meta device, this shard initialised by each module's reset_parameters()" in p["role"]
               for p in plans.values()), plans


def test_meta_parameters_under_plain_dp_are_refused_and_init_device_is_the_device_there():
    from trainyard.sdk.metainit import init_context, on_meta, params_on_meta
    from trainyard.spec import parse_job_spec

    base = {"name": "x", "entrypoint": {"module": "m"}, "resources": {"nodes": 1, "procs_per_node": 2}}
    cpu = torch.device("cpu")
    assert init_context(parse_job_spec(base), cpu) == cpu and init_context(None, cpu) == cpu
    assert init_context(parse_job_spec({**base, "parallel": "auto"}), cpu) == cpu  # the plan is not known yet
    with init_context(parse_job_spec({**base, "parallel": {"fsdp": True}}), cpu):
        model = example.MinGPT()
    assert on_meta(model) and all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # the causal mask is real
    with params_on_meta():
        pass
    assert not on_meta(nn.Linear(2, 2))  # the patch is gone after the context
    from trainyard.sdk.metainit import uninitialisable

    class Scale(nn.Module):  # a parameter nothing would initialise after materialising
        def __init__(self):
            super().__init__()
            self.g = nn.Parameter(torch.ones(4))

    model = nn.Sequential(nn.Linear(4, 4), Scale())
    assert uninitialisable(model) == ["1 (Scale)"] and uninitialisable(example.Llama()) == []
    model.init_weights = lambda: None  # the model's own init covers everything
    assert uninitialisable(model) == []


def _blocks(model: nn.Module) -> list[str]:
    name, _ = find_blocks(model)
    return [f"{name}.{i}" for i in range(len(model.get_submodule(name)))]


def test_the_default_plan_splits_llama_names_and_divides_the_head_counts():
    model = example.Llama()
    styles = plan_styles(model, 2, _blocks(model))
    assert styles["layers.0.self_attn.q_proj"] == "colwise" and styles["layers.1.mlp.down_proj"] == "rowwise"
    assert not any(n.startswith(("embed_tokens", "lm_head", "norm")) for n in styles)  # replicated
    assert len(styles) == 14
    assert localise_heads(model, styles, 2) == [f"layers.{i}.self_attn.{a}" for i in (0, 1)
                                                for a in ("n_heads", "n_kv_heads")]
    assert model.layers[0].self_attn.n_heads == 2 and model.layers[0].self_attn.n_kv_heads == 1


class _Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2)}) for _ in range(2)])


@pytest.mark.parametrize("build, tp, user_plan, message", [
    (lambda: example.MinGPT(), 2, None, "cannot split 'h.0.attn.c_attn': it computes q, k and v in one Linear"),
    (lambda: _Fused(), 2, None, "cannot split 'blocks.0.attn', a fused nn.MultiheadAttention"),
    (lambda: example.Llama(n_heads=4, n_kv_heads=2), 4, None, "does not divide layers.0.self_attn.n_kv_heads = 2"),
    (lambda: example.Llama(dim=30, n_heads=6, n_kv_heads=6), 4, None,
     "does not divide the 30 output features of 'layers.0.self_attn.q_proj'"),
    (lambda: example.Llama(), 2, {"*.q_proj": "colwise"}, "splits layers of 'layers.0' by columns but none by rows"),
    (lambda: example.Llama(), 2, {"*.qkv": "colwise"}, "tp_plan pattern '*.qkv' matches no module"),
    (lambda: example.Llama(), 2, {"*.q_proj": "sideways"}, "a style is one of colwise, rowwise"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 2, None, "found no Linear layer to split"),
], ids=["fused_qkv", "multihead", "kv_heads", "width", "no_rowwise", "bad_pattern", "bad_style", "nothing"])
def test_what_tp_cannot_split_is_refused_naming_the_module_and_what_to_do(build, tp, user_plan, message):
    model = build()
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        plan_styles(model, tp, _blocks(model) if find_blocks(model)[1] else [], user_plan)


def test_a_user_tp_plan_replaces_the_default_and_tp_needs_prepare():
    model = example.MinGPT()  # its MLP is a Sequential (mlp.0, mlp.2): no default name, so the script names them
    styles = plan_styles(model, 2, _blocks(model), {"h.*.mlp.0": "colwise", "h.*.mlp.2": "rowwise"})
    assert styles == {f"h.{i}.mlp.{j}": s for i in (0, 1) for j, s in ((0, "colwise"), (2, "rowwise"))}
    from trainyard.spec import parse_job_spec

    spec = parse_job_spec({"name": "x", "entrypoint": {"module": "m"}, "parallel": {"tp": 2},
                           "resources": {"nodes": 1, "procs_per_node": 2}})
    assert needs_prepare(spec) == ["parallel.tp 2"]


@pytest.mark.procs
def test_a_standalone_run_prints_the_request_trainyard_plan_takes(tmp_path):
    """Before submitting: the script run by itself (no launch config) prints its model as a planner
    request, which the planner (the one behind `trainyard plan`) accepts as it is."""
    import json
    import subprocess
    import sys

    from trainyard.plan.search import plan_dict

    from .test_prepare import SCRIPT

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT)], cwd=tmp_path, env=env, text=True, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("trainyard plan request: ")]
    assert len(lines) == 1, proc.stdout[-2000:]  # rank 0, once
    req = json.loads(lines[0].removeprefix("trainyard plan request: "))
    assert req["model"] == {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64}  # the example's minGPT
    assert req["cluster"]["devices_per_node"] == 2 and req["global_batch"] == 16 and req["fix"] == {"pp": 1}
    plans = plan_dict(req)["plans"]
    assert plans and all(p["pp"] == 1 for p in plans)
