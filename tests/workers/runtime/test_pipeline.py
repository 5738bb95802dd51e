"""Pipeline parallelism (workers/runtime/pipeline.py): the stage split (trainyard/mesh.py) and
the plans the JobSpec refuses for it, in-process, then real torchrun (gloo):
- one 2-rank launch of tests/workers/runtime/pipeline_cases.py: pp=2 with GPipe and with 1F1B match
  single-process training of the same GPT on the same global batch and seed (losses over K steps,
  step-1 gradients, eval loss), each stage holds about half the parameter bytes, and a DCP
  checkpoint (model + AdamW state) moves bit-exactly from the pipeline to a plain model and back;
- one 4-rank launch: dp=2 x pp=2 (1F1B) and pp=4 (GPipe, middle stages) match the same way;
- the trainer: `python -m workers.runtime` with pp=2, 1F1B, a checkpoint every 5 steps; then
  that pp=2 checkpoint resumed under plain DDP (dp=2) through the trainer's resume path.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from trainyard.mesh import Mesh, stage_layers
from trainyard.spec import SpecError, parse_job_spec
from trainyard.spec import ModelSpec
from workers.runtime.model import build_model
from workers.runtime.parallel import param_bytes
from workers.runtime.pipeline import GPTStage, dp_ranks, pp_ranks

from .conftest import SMALL_MODEL
from .test_torchrun import run_job

# ---------------------------------------------------------------- in-process


@pytest.mark.parametrize("layers, stages, expected", [
    (2, 2, [(0, 1), (1, 2)]), (4, 2, [(0, 2), (2, 4)]), (5, 2, [(0, 3), (3, 5)]),
    (7, 3, [(0, 3), (3, 5), (5, 7)]), (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]), (3, 1, [(0, 3)]),
])
def test_blocks_are_split_contiguously_and_as_evenly_as_possible(layers, stages, expected):
    assert [(r.start, r.stop) for r in stage_layers(layers, stages)] == expected


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="parallel.pp=3 must be between 1 and model.layers=2"):
        stage_layers(2, 3)


def test_mesh_groups_follow_the_rank_order_of_the_mesh():
    mesh = Mesh(pp=2, dp=3, tp=1)  # rank = pp_coord * dp + dp_coord
    assert [pp_ranks(mesh, d) for d in range(3)] == [[0, 3], [1, 4], [2, 5]]
    assert [dp_ranks(mesh, s) for s in range(2)] == [[0, 1, 2], [3, 4, 5]]
    for d in range(3):
        assert [mesh.coords(r) for r in pp_ranks(mesh, d)] == [{"pp": p, "dp": d, "tp": 0} for p in (0, 1)]


def test_stages_keep_the_full_models_names_and_chain_to_its_forward():
    cfg = ModelSpec(**{**SMALL_MODEL, "layers": 3})
    torch.manual_seed(0)
    full = build_model(cfg)
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        expected = full(idx)
    names = {n for n, _ in full.named_parameters()}
    stages = []
    for s, blocks in enumerate(stage_layers(3, 2)):
        torch.manual_seed(0)
        stages.append(GPTStage(build_model(cfg), blocks, s == 0, s == 1))
    stage_names = [{n for n, _ in st.named_parameters()} for st in stages]
    assert stage_names[0] | stage_names[1] == names and not stage_names[0] & stage_names[1]
    assert "tok.weight" in stage_names[0] and "blocks.1.ln1.weight" in stage_names[0]
    assert "blocks.2.ln1.weight" in stage_names[1] and "head.weight" in stage_names[1]
    assert sum(param_bytes(st) for st in stages) == param_bytes(full)
    assert [st.describe() for st in stages] == ["tok, pos, blocks 0-1", "blocks 2-2, ln_f, head"]
    with torch.no_grad():
        got = stages[1](stages[0](idx))
    assert torch.equal(got, expected)


def _spec_errors(**spec) -> dict[str, list[str]]:
    sections = {"name": "pp", "model": SMALL_MODEL, "train": {"global_batch": 16},
                "parallel": {"dp": 1, "pp": 2, "microbatches": 4, "schedule": "1f1b"}, **spec}
    try:
        parse_job_spec(sections)
    except SpecError as e:
        return e.errors
    return {}


# What the pipeline cannot run is refused by the JobSpec (trainyard/spec.py unsupported_options),
# at submit and for the runtime's launch config alike.
@pytest.mark.parametrize("spec, field, message", [
    ({"model": {**SMALL_MODEL, "kind": "mlp"}}, "parallel.pp", "model.kind must be gpt"),
    ({"train": {"global_batch": 16, "grad_accum": 2}}, "train.grad_accum", "parallel.microbatches"),
    ({"comm": {"compression": "fp16"}}, "comm.compression", "plain data parallelism"),
    ({"parallel": {"dp": 1, "pp": 2, "microbatches": 3}}, "parallel.microbatches",
     "divisible by microbatches"),
    ({"parallel": {"dp": 1, "pp": 2, "microbatches": 1, "schedule": "1f1b"}},
     "parallel.microbatches", "at least as many micro-batches"),
])
def test_what_the_pipeline_cannot_run_is_refused_by_the_spec_naming_the_field(spec, field, message):
    errors = _spec_errors(**spec)
    assert message in " ".join(errors.get(field, [])), errors


def test_gpipe_runs_with_fewer_microbatches_than_stages():
    assert _spec_errors(parallel={"dp": 1, "pp": 2, "microbatches": 1, "schedule": "gpipe"}) == {}


# ---------------------------------------------------------------- torchrun: equivalence

CASES = Path(__file__).with_name("pipeline_cases.py")


def _launch_cases(tmp_path: Path, env: dict, nproc: int, cases: list[str]) -> dict:
    out = tmp_path / f"cases-{nproc}"
    out.mkdir()
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), str(CASES), str(out), *cases]
    proc = subprocess.run(argv, cwd=REPO, env=env, text=True, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {}
    for case in cases:
        results[case] = [json.loads((out / f"{case}-rank{r}.json").read_text()) for r in range(nproc)]
    return results


def _assert_matches_single_process(case: str, ranks: list[dict]) -> None:
    for r in ranks:
        ref = r["ref_losses"]
        # every rank reports its pipeline's loss: that of its dp coordinate's batch
        if not r["dp_mean_losses"]:
            assert r["losses"] == pytest.approx(ref, rel=1e-5, abs=0), (case, r["rank"])
        else:  # dp x pp: the mean over dp coordinates is the global batch's mean loss
            assert r["dp_mean_losses"] == pytest.approx(ref, rel=1e-5, abs=0), (case, r["rank"])
        assert r["grad_rel_diff"] < 1e-5, (case, r["rank"], r["grad_rel_diff"])
        assert r["eval_loss"] == pytest.approx(r["ref_eval_loss"], rel=1e-5), (case, r["rank"])
        assert set(r["fqns"]) <= set(r["ref_fqns"])  # the full model's names
        if case.endswith("1f1b"):  # DCP round trips pipeline <-> plain model, bit for bit
            assert r["reshard"] == {"pp_to_full": 0.0, "full_to_pp": 0.0}, (case, r["rank"])
    # the stages of one pipeline hold the whole model, each name once
    for d in {r["coords"]["dp"] for r in ranks}:
        pipe = [r for r in ranks if r["coords"]["dp"] == d]
        names = [n for r in pipe for n in r["fqns"]]
        assert sorted(names) == ranks[0]["ref_fqns"], case
        assert sum(r["param_bytes"] for r in pipe) == ranks[0]["full_param_bytes"]


@pytest.mark.procs
def test_two_stage_gpipe_and_1f1b_match_single_process_training(tmp_path, repo_env):
    results = _launch_cases(tmp_path, repo_env, 2, ["pp2-gpipe", "pp2-1f1b"])
    for case, ranks in results.items():
        _assert_matches_single_process(case, ranks)
        roles = [r["info"]["role"] for r in ranks]
        assert roles == ["stage 0 of 2: tok, pos, blocks 0-1", "stage 1 of 2: blocks 2-3, ln_f, head"]
        for r in ranks:  # sharding: each stage really holds about half the parameter bytes
            share = r["param_bytes"] / r["full_param_bytes"]
            assert 0.35 <= share <= 0.65, (case, r["rank"], share)
            assert r["info"]["param_bytes"] == r["param_bytes"]
        print(case, "largest relative loss difference:",
              max(abs(a / b - 1) for a, b in zip(ranks[0]["losses"], ranks[0]["ref_losses"])),
              "gradient:", max(r["grad_rel_diff"] for r in ranks),
              "param share:", [round(r["param_bytes"] / r["full_param_bytes"], 3) for r in ranks])


@pytest.mark.procs
def test_dp2_x_pp2_and_four_stages_match_single_process_training(tmp_path, repo_env):
    results = _launch_cases(tmp_path, repo_env, 4, ["dp2pp2-1f1b", "pp4-gpipe"])
    for case, ranks in results.items():
        _assert_matches_single_process(case, ranks)
    dpp = results["dp2pp2-1f1b"]
    assert {r["info"]["strategy"] for r in dpp} == {"dp x pp"}
    assert [r["coords"] for r in dpp] == [{"pp": p, "dp": d, "tp": 0} for p in (0, 1) for d in (0, 1)]
    # the two dp coordinates trained on different halves of the batch: different losses
    assert dpp[0]["losses"] != dpp[1]["losses"] and dpp[0]["losses"] == dpp[2]["losses"]
    assert [r["info"]["role"] for r in results["pp4-gpipe"]][1:3] == [
        "stage 1 of 4: blocks 1-1", "stage 2 of 4: blocks 2-2"]


# ---------------------------------------------------------------- torchrun: the trainer

TRAIN_STEPS = 10


def _train(tmp_path: Path, url: str, env: dict, name: str, job_id: int, parallel: dict,
           resume: dict | None = None) -> tuple[dict, list[dict], str]:
    """One `python -m workers.runtime` job under torchrun: (samples by (rank, step), events, output)."""
    samples, events, text = run_job(tmp_path, url, env, name, job_id, resume=resume, model=SMALL_MODEL,
                                    parallel=parallel, train={"steps": TRAIN_STEPS, "global_batch": 16},
                                    checkpoint={"every_steps": 5, "async": True, "keep": 3})
    return {(s["rank"], s["step"]): s for s in samples}, events, text


@pytest.mark.procs
def test_trainer_runs_a_two_stage_pipeline_and_its_checkpoint_resumes_under_ddp(
        tmp_path, redis_server, repo_env):
    url = redis_server.url
    pp = {"dp": 1, "pp": 2, "tp": 1, "microbatches": 4, "schedule": "1f1b"}
    samples, events, text = _train(tmp_path, url, repo_env, "pp", 31, pp)
    assert sorted(samples) == [(r, s) for r in (0, 1) for s in range(1, TRAIN_STEPS + 1)]
    for step in range(1, TRAIN_STEPS + 1):  # the pipeline's loss, broadcast to both stages
        assert samples[(0, step)]["loss"] == samples[(1, step)]["loss"], step
    assert samples[(0, 1)]["loss"] == pytest.approx(math.log(256), abs=0.2)
    assert samples[(0, TRAIN_STEPS)]["loss"] < samples[(0, 1)]["loss"] - 0.3
    # eval_loss at the end: "rank 0 finished steps 10 final_loss 4.1 val_loss 4.2 wall_s 3.0",
    # the pipeline's held-out loss, the same on both stages
    vals = {int(line.split()[1]): line.split()[8] for line in text.splitlines()
            if line.startswith("rank ") and " finished steps " in line}
    assert sorted(vals) == [0, 1] and vals[0] == vals[1] and vals[0] != "None", vals
    assert abs(float(vals[0]) - samples[(0, TRAIN_STEPS)]["loss"]) < 0.5, vals

    full = param_bytes(build_model(ModelSpec(**SMALL_MODEL)))
    plans = {e["rank"]: e for e in events if e["kind"] == "rank_plan"}
    assert sorted(plans) == [0, 1]
    for rank, plan in plans.items():
        assert plan["strategy"] == "pp" and plan["coords"] == {"pp": rank, "dp": 0, "tp": 0}
        assert plan["mesh"]["shape"] == {"pp": 2, "dp": 1, "tp": 1}
        assert 0.35 <= plan["param_bytes"] / full <= 0.65, plan
        assert plan["optim_bytes"] == 2 * plan["param_bytes"]  # AdamW: exp_avg + exp_avg_sq
    assert plans[0]["param_bytes"] + plans[1]["param_bytes"] == full
    assert plans[0]["role"] == "stage 0 of 2: tok, pos, blocks 0-0"
    assert plans[1]["role"] == "stage 1 of 2: blocks 1-1, ln_f, head"
    ckpts = {e["step"]: e for e in events if e["kind"] == "checkpoint"}
    assert sorted(ckpts) == [5, 10]
    print("pp=2 rank_plan param_bytes share:", [round(plans[r]["param_bytes"] / full, 3) for r in (0, 1)])

    # ---- resharding: the pp=2 checkpoint of step 5 resumed under plain DDP over 2 ranks
    ddp = {"dp": 2, "pp": 1, "tp": 1}
    resumed, events2, text2 = _train(tmp_path, url, repo_env, "ddp", 32, ddp,
                                     resume={"path": ckpts[5]["path"], "step": 5})
    assert "rank 0 resumed from step 5" in text2, text2
    assert sorted(resumed) == [(r, s) for r in (0, 1) for s in range(6, TRAIN_STEPS + 1)]
    # each dp rank's loss is over its half of the step's 16 samples, the same 16 as under pp
    for step in range(6, TRAIN_STEPS + 1):
        mean = (resumed[(0, step)]["loss"] + resumed[(1, step)]["loss"]) / 2
        assert mean == pytest.approx(samples[(0, step)]["loss"], rel=1e-5), (step, mean)
    print("resumed DDP (dp mean) vs pp=2 loss, relative difference by step:", {
        s: abs((resumed[(0, s)]["loss"] + resumed[(1, s)]["loss"]) / 2 / samples[(0, s)]["loss"] - 1)
        for s in range(6, TRAIN_STEPS + 1)})
    print("step-6 loss, pp=2 vs resumed DDP (dp mean):", samples[(0, 6)]["loss"],
          (resumed[(0, 6)]["loss"] + resumed[(1, 6)]["loss"]) / 2)
    # ---- dp x pp through the trainer: the same checkpoint resumed on 4 ranks (2 replicas of a
    # 2-stage pipeline). Replica d trains on DDP rank d's samples (data is split over dp only),
    # so both of its stages report DDP rank d's loss.
    dp_pp = {"dp": 2, "pp": 2, "tp": 1, "microbatches": 2, "schedule": "gpipe"}
    grid, events3, text3 = run_job(tmp_path, url, repo_env, "dp-pp", 33, nproc=4, model=SMALL_MODEL,
                                   parallel=dp_pp, resources={"nodes": 2, "procs_per_node": 2},
                                   train={"steps": TRAIN_STEPS, "global_batch": 16},
                                   checkpoint={"every_steps": 100, "async": True, "keep": 3},
                                   resume={"path": ckpts[5]["path"], "step": 5})
    grid = {(s["rank"], s["step"]): s for s in grid}
    coords = {e["rank"]: e["coords"] for e in events3 if e["kind"] == "rank_plan"}
    assert coords == {0: {"pp": 0, "dp": 0, "tp": 0}, 1: {"pp": 0, "dp": 1, "tp": 0},
                      2: {"pp": 1, "dp": 0, "tp": 0}, 3: {"pp": 1, "dp": 1, "tp": 0}}, text3
    for step in range(6, TRAIN_STEPS + 1):
        for rank, c in coords.items():
            assert grid[(rank, step)]["loss"] == pytest.approx(resumed[(c["dp"], step)]["loss"], rel=1e-5), \
                (step, rank)
            assert grid[(rank, step)]["bytes_sent"] > 0  # activations and the dp gradient all-reduce

    print("median step_s (ms), steps 6-10, pp=2 1f1b vs DDP dp=2:", [
        round(1000 * statistics.median(run[(r, s)]["step_s"] for r in (0, 1) for s in range(6, 11)), 1)
        for run in (samples, resumed)])
