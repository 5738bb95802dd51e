"""parallel.recompute (activation checkpointing) and parallel.shard_optimizer (ZeRO-1).

In-process: what the JobSpec refuses, naming the field; recomputation gives the same loss and
gradients and keeps fewer saved tensors; a ZeRO checkpoint is keyed like an unsharded one.
Real torchrun (gloo, the built-in trainer end to end):
- DDP on 2 ranks: shard_optimizer gives the unsharded run's per-step losses, holds about half
  the optimizer bytes per rank, checkpoints, and its checkpoint resumes exactly under ZeRO and
  under plain AdamW; recompute full gives the same losses as none;
- tensor parallel on 2 ranks and fsdp on 2 ranks with recompute full; dp 2 x tp 2 and dp 2 x pp 2
  on 4 ranks with recompute full and shard_optimizer: the DDP run's losses up to rounding.
"""
from pathlib import Path

import pytest
import torch

from trainyard.sdk import checkpoint as ck
from trainyard.spec import ModelSpec, SpecError, parse_job_spec
from workers.runtime.model import build_model, lm_loss

from .conftest import SMALL_MODEL
from .test_torchrun import run_job

STEPS, EVERY = 8, 4


def _errors(parallel: dict, procs: int = 2, **sections) -> dict[str, list[str]]:
    try:
        parse_job_spec({"name": "x", "model": SMALL_MODEL, "parallel": parallel,
                        "resources": {"nodes": 1, "procs_per_node": procs}, **sections})
    except SpecError as e:
        return e.errors
    return {}


@pytest.mark.parametrize("parallel, sections, field, message", [
    ({"dp": 2, "fsdp": True, "shard_optimizer": True}, {}, "parallel.shard_optimizer",
     "fsdp already shards the optimizer state"),
    ({"dp": 1, "tp": 2, "shard_optimizer": True}, {}, "parallel.shard_optimizer", "the job has dp 1"),
    ({"dp": 1, "pp": 2, "shard_optimizer": True}, {}, "parallel.shard_optimizer", "the job has dp 1"),
    ({"shard_optimizer": True}, {"comm": {"sync": "local_sgd"}}, "parallel.shard_optimizer",
     "comm.sync local_sgd averages no gradients"),
    ({"recompute": "partial"}, {}, "parallel.recompute", "'none' or 'full'"),
    ({"shard_optimizer": "sometimes"}, {}, "parallel.shard_optimizer", "valid boolean"),
])
def test_what_recompute_and_shard_optimizer_cannot_run_is_refused_naming_the_field(
        parallel, sections, field, message):
    errors = _errors(parallel, **sections)
    assert message in " ".join(errors.get(field, [])), errors


def test_an_entrypoint_job_may_ask_for_recompute_and_shard_optimizer():
    """run.prepare applies them to the script's model (tests/workers/runtime/test_prepare.py)."""
    for parallel in ({"recompute": "full"}, {"shard_optimizer": True}):
        spec = parse_job_spec({"name": "x", "entrypoint": {"module": "train"}, "parallel": parallel,
                               "resources": {"nodes": 1, "procs_per_node": 2}})
        assert spec.plan.recompute == parallel.get("recompute", "none")


@pytest.mark.parametrize("parallel", [
    {"shard_optimizer": True, "recompute": "full"},
    {"dp": 2, "fsdp": True, "recompute": "full"},
    {"dp": 1, "tp": 2, "recompute": "full"},
])
def test_the_runnable_combinations_parse_and_default_to_off(parallel):
    assert _errors(parallel) == {}
    defaults = parse_job_spec({"name": "x"}).to_json()["parallel"]
    assert (defaults["recompute"], defaults["shard_optimizer"]) == ("none", False)


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, int]:
    """(loss, bytes of the distinct non-parameter tensors autograd keeps for the backward)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    return loss.item(), sum(seen.values())


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_recompute_gives_the_same_loss_and_gradients_and_keeps_fewer_activations(kind):
    cfg = ModelSpec(**{**SMALL_MODEL, "kind": kind, "layers": 4})
    x = torch.randint(0, 256, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    runs = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg, recompute=recompute)
        loss, saved = _saved_bytes(model, x)
        runs[recompute] = (loss, saved, {n: p.grad for n, p in model.named_parameters()})
    (loss0, saved0, grads0), (loss1, saved1, grads1) = runs[False], runs[True]
    assert loss1 == loss0
    assert max((grads1[n] - g).abs().max().item() for n, g in grads0.items()) == 0.0
    if kind == "gpt":  # of each block only its input stays (besides the embedding and the head)
        assert saved1 < 0.5 * saved0, (saved0, saved1)
    else:  # a residual layer kept its input and the GELU's input; now only its input
        assert saved0 - saved1 == cfg.layers * x.shape[0] * cfg.seq_len * cfg.hidden * 4
    with torch.no_grad():  # without gradients (evaluation) nothing is checkpointed: plain forward
        torch.manual_seed(0)
        plain = build_model(cfg)(x[:, :-1])
        torch.manual_seed(0)
        assert torch.equal(build_model(cfg, recompute=True)(x[:, :-1]), plain)


# ---- real torchrun ---------------------------------------------------------------------------
def _run(tmp_path, url, env, name, job_id, parallel, *, nproc=2, resume=None):
    return run_job(tmp_path, url, env, name, job_id, resume=resume, nproc=nproc, timeout_s=240,
                   model=SMALL_MODEL, parallel=parallel,
                   resources={"nodes": 1, "procs_per_node": nproc, "device": "cpu"},
                   train={"steps": STEPS, "global_batch": 16},
                   checkpoint={"every_steps": EVERY, "async": True, "keep": 3})


def _losses(samples: list[dict], attempt: int | None = None) -> dict[int, float]:
    """The job's loss per step (mean over the ranks' reports of this attempt)."""
    by_step: dict[int, list[float]] = {}
    for s in samples:
        if attempt is None or s["attempt"] == attempt:
            by_step.setdefault(s["step"], []).append(s["loss"])
    return {step: sum(v) / len(v) for step, v in sorted(by_step.items())}


def _per_rank(samples: list[dict], attempt: int) -> dict[tuple[int, int], float]:
    return {(s["rank"], s["step"]): s["loss"] for s in samples if s["attempt"] == attempt}


def _plans(events: list[dict]) -> dict[int, dict]:
    return {e["rank"]: e for e in events if e["kind"] == "rank_plan"}


def _checkpoint(events: list[dict], step: int) -> str:
    [path] = [e["path"] for e in events if e["kind"] == "checkpoint" and e["step"] == step]
    return path


@pytest.mark.procs
def test_zero1_trains_checkpoints_and_resumes_like_adamw_and_recompute_changes_no_loss(
        tmp_path, redis_server, repo_env):
    url, env = redis_server.url, repo_env
    base, base_events, _ = _run(tmp_path, url, env, "adamw", 31, {"dp": 2})
    zero, zero_events, _ = _run(tmp_path, url, env, "zero", 32, {"dp": 2, "shard_optimizer": True})
    # the same AdamW, parameter by parameter: identical per-rank losses at every step
    assert _per_rank(zero, 9) == _per_rank(base, 9)
    assert sorted(_per_rank(zero, 9)) == [(r, s) for r in (0, 1) for s in range(1, STEPS + 1)]
    assert _losses(zero)[STEPS] < _losses(zero)[1] - 0.3
    # each rank holds its partition's AdamW moments: together the unsharded bytes, about half each
    full = _plans(base_events)[0]["optim_bytes"]
    zero_bytes = {r: e["optim_bytes"] for r, e in _plans(zero_events).items()}
    print("optimizer bytes per rank: adamw", full, "zero-1", zero_bytes)
    assert all(e["optim_bytes"] == full and e["shard_optimizer"] is False for e in _plans(base_events).values())
    assert all(e["shard_optimizer"] is True and "its 1/2 share (ZeRO-1)" in e["role"]
               for e in _plans(zero_events).values())
    assert sum(zero_bytes.values()) == full and max(zero_bytes.values()) < 0.65 * full, zero_bytes

    # its step-4 checkpoint (each rank wrote its own partition's state) resumes exactly, under
    # ZeRO-1 and under plain AdamW (the entries are keyed by parameter, as an unsharded save's)
    c4 = _checkpoint(zero_events, EVERY)
    assert {"rank-0.pt", "rank-1.pt", ".metadata"} <= {p.name for p in Path(c4).iterdir()}
    resume = {"path": c4, "step": EVERY, "checkpoint_id": 1}
    for job_id, (name, parallel) in enumerate([("zero-resumed", {"dp": 2, "shard_optimizer": True}),
                                               ("adamw-from-zero", {"dp": 2})], start=33):
        samples, events, text = _run(tmp_path, url, env, name, job_id, parallel, resume=resume)
        # run_job copies the checkpoint into the resumed run's own checkpoint directory
        assert f"rank 1 resumed from step {EVERY} (" in text and f"/{name}/ckpt/{Path(c4).name})" in text, text
        got = _per_rank(samples, 10)
        assert sorted(got) == [(r, s) for r in (0, 1) for s in range(EVERY + 1, STEPS + 1)], name
        assert got == {k: v for k, v in _per_rank(base, 9).items() if k[1] > EVERY}, name
        assert [e["step"] for e in events if e["kind"] == "checkpoint" and e["attempt"] == 10] == [STEPS]

    # recompute full: the same forward and backward arithmetic, recomputed
    recomputed, events, _ = _run(tmp_path, url, env, "recompute", 35, {"dp": 2, "recompute": "full"})
    assert _per_rank(recomputed, 9) == pytest.approx(_per_rank(base, 9), rel=1e-6, abs=0)
    assert [e["recompute"] for e in _plans(events).values()] == ["full", "full"]
    assert [e["recompute"] for e in _plans(base_events).values()] == ["none", "none"]


@pytest.mark.procs
@pytest.mark.parametrize("name, parallel, nproc", [
    ("tp", {"dp": 1, "tp": 2, "recompute": "full"}, 2),
    ("fsdp", {"dp": 2, "fsdp": True, "recompute": "full"}, 2),
    ("dp x tp", {"dp": 2, "tp": 2, "recompute": "full", "shard_optimizer": True}, 4),
    ("dp x pp", {"dp": 2, "pp": 2, "microbatches": 2, "recompute": "full", "shard_optimizer": True}, 4),
])
def test_recompute_and_zero1_under_the_other_strategies_train_like_ddp(
        tmp_path, redis_server, repo_env, name, parallel, nproc):
    url, env = redis_server.url, repo_env
    base, _, _ = _run(tmp_path, url, env, "ddp", 41, {"dp": 2})
    samples, events, _ = _run(tmp_path, url, env, name.replace(" ", ""), 42, parallel, nproc=nproc)
    want, got = _losses(base), _losses(samples)
    # the same global batch over the same dp 2 split: only the rounding of the sharded math differs
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == pytest.approx(want, rel=1e-4, abs=0), (name, got, want)
    plans = _plans(events)
    assert sorted(plans) == list(range(nproc)) and plans[0]["strategy"] == name
    assert all(e["recompute"] == "full" for e in plans.values())  # every rank checkpoints its blocks
    assert all(e["shard_optimizer"] is bool(parallel.get("shard_optimizer")) for e in plans.values())
    if parallel.get("shard_optimizer"):  # replicas of one shard or stage split its AdamW state
        ranks = [r for r in plans if plans[r]["coords"]["dp"] == 0]
        for r in ranks:
            peer = next(q for q in plans if plans[q]["coords"] == {**plans[r]["coords"], "dp": 1})
            mine, theirs = plans[r]["optim_bytes"], plans[peer]["optim_bytes"]
            assert 0 < mine < 0.75 * (mine + theirs) and 0 < theirs, (name, plans)
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [EVERY, STEPS]
    assert Path(_checkpoint(events, STEPS)).is_dir() and ck.read_manifest(Path(_checkpoint(events, STEPS)))
