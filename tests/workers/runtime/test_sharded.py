"""FSDP2, tensor parallelism and dp x tp (workers/runtime/sharded.py).

In-process: the plans the JobSpec refuses, the TP plan, the mesh arithmetic. Real torchrun (gloo):
- sharded_cases.py on 2 ranks (fsdp and tp, grad_accum 1 and 2) and on 4 ranks (dp 2 x tp 2):
  per-step losses equal single-process training on the same global batch, the final weights
  too, replicated gradients agree across tp ranks, and each rank holds about half the bytes;
- the trainer: a DDP job checkpoints; its step-3 checkpoint resumes under tp 2 and under fsdp
  (DCP reshards on load), and those runs train, report their plan and checkpoint in turn.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tests.conftest import REPO
from trainyard.sdk import checkpoint as ck
from trainyard.mesh import Mesh
from trainyard.spec import SpecError, parse_job_spec
from trainyard.spec import ModelSpec
from workers.runtime.model import build_model
from workers.runtime.sharded import tp_plan

from .conftest import SMALL_MODEL
from .test_torchrun import run_job

CASES = Path(__file__).with_name("sharded_cases.py")


def _spec_errors(parallel: dict, model=None, comm=None, procs: int = 2) -> dict[str, list[str]]:
    try:
        parse_job_spec({"name": "x", "model": model or SMALL_MODEL, "parallel": parallel,
                        "comm": comm or {}, "resources": {"nodes": 1, "procs_per_node": procs}})
    except SpecError as e:
        return e.errors
    return {}


# What the sharded strategy cannot run is refused by the JobSpec (trainyard/spec.py
# unsupported_options), at submit and for the runtime's launch config alike.
@pytest.mark.parametrize("kwargs, field, message", [
    ({"parallel": {"dp": 1, "tp": 2, "fsdp": True}}, "parallel.fsdp", "tensor parallelism"),
    ({"parallel": {"dp": 1, "tp": 2}, "model": {**SMALL_MODEL, "kind": "mlp"}}, "parallel.tp",
     "model.kind mlp"),
    ({"parallel": {"dp": 1, "tp": 8}, "procs": 8}, "parallel.tp", "tp (8) must divide model.heads (4)"),
    ({"parallel": {"dp": 2, "fsdp": True}, "comm": {"compression": "fp16"}}, "comm.compression",
     "plain data parallelism"),
    ({"parallel": {"dp": 1, "tp": 2}, "comm": {"sync": "local_sgd"}}, "comm.sync",
     "plain data parallelism"),
])
def test_plans_the_sharded_strategy_cannot_run_are_refused_by_the_spec_naming_the_field(
        kwargs, field, message):
    errors = _spec_errors(**kwargs)
    assert message in " ".join(errors.get(field, [])), errors


def test_tp_plan_splits_every_block_and_the_vocab_when_it_divides():
    model = build_model(ModelSpec(**SMALL_MODEL))
    plan = tp_plan(model, 2, 256)
    names = dict(model.named_modules())
    assert set(plan) <= set(names)
    for i in range(2):
        for col in ("attn.q", "attn.k", "attn.v", "mlp.0"):
            assert isinstance(plan[f"blocks.{i}.{col}"], ColwiseParallel)
        for row in ("attn.proj", "mlp.2"):
            assert isinstance(plan[f"blocks.{i}.{row}"], RowwiseParallel)
    assert isinstance(plan["tok"], RowwiseParallel) and isinstance(plan["head"], ColwiseParallel)
    assert "tok" not in tp_plan(model, 3, 256) and "head" not in tp_plan(model, 3, 256)


def test_dp_x_tp_groups_are_the_rows_of_the_row_major_grid():
    # init_device_mesh((dp, tp)) lays ranks out row-major: tp groups are consecutive ranks, dp
    # groups strided by tp, exactly Mesh.coords' layout
    mesh = Mesh(pp=1, dp=2, tp=2)
    grid = [[d * 2 + t for t in range(2)] for d in range(2)]
    for d, row in enumerate(grid):
        for t, rank in enumerate(row):
            assert mesh.coords(rank) == {"pp": 0, "dp": d, "tp": t}
    assert [mesh.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]


# ---------------------------------------------------------------- equivalence under torchrun

def _cases(tmp_path: Path, env: dict, nproc: int, cases: list[str]) -> dict:
    out = tmp_path / f"cases-{nproc}.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), str(CASES), str(out), *cases]
    proc = subprocess.run(argv, cwd=REPO, env=env, text=True, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def _check_equivalence(results: dict, case: str, nproc: int) -> dict:
    r = results["cases"][case]
    # fp32: only the summation order differs (sharded matmuls, all-reduces)
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=0), case
    assert r["losses"][-1] < r["losses"][0] - 0.3, case  # it learns
    assert [k["rank"] for k in r["ranks"]] == list(range(nproc))
    for k in r["ranks"]:
        assert k["keys"] == results["ref_keys"], case  # the plain model's FQNs: checkpoints port
        # AdamW divides by sqrt(v): near-zero gradients turn 1e-7 relative rounding into up to
        # ~5e-5 of a weight (a single process splitting the batch in two does the same);
        # lr x steps = 6e-3 is what a wrong gradient would move
        assert k["weight_diff"] < 2e-4, (case, k["worst"], k["weight_diff"])
        assert k["grad_diff"] == 0.0, case  # replicated params: identical grads on all tp ranks
        # so the replicated parameters stay bitwise equal on every tp rank after all the steps
        assert k["param_diff"] == 0.0, case
        assert k["eval_loss"] == pytest.approx(r["ranks"][0]["eval_loss"], rel=1e-6)
    return r


@pytest.mark.procs
def test_fsdp_and_tp_on_two_ranks_train_like_one_process_on_half_the_bytes(tmp_path, repo_env):
    res = _cases(tmp_path, repo_env, 2, ["fsdp:1", "fsdp:2", "fsdp:1:w", "tp:1", "tp:2"])
    full_p, full_o = res["full_param_bytes"], res["full_optim_bytes"]
    for case in ("fsdp:1", "fsdp:2", "fsdp:1:w"):  # w: the ranks' gradients weighted 1.5, 0.5
        r = _check_equivalence(res, case, 2)
        for k in r["ranks"]:
            assert k["info"]["strategy"] == "fsdp" and k["info"]["coords"]["dp"] == k["rank"]
            assert k["info"]["role"].startswith(f"fsdp shard {k['rank']} of 2")
            assert 0.4 <= k["info"]["param_bytes"] / full_p <= 0.55, k["info"]
            assert 0.4 <= k["optim_bytes"] / full_o <= 0.55, k
    for case in ("tp:1", "tp:2"):
        r = _check_equivalence(res, case, 2)
        roles = [k["info"]["role"] for k in r["ranks"]]
        assert roles == ["tp rank 0 of 2: heads 0-1 of 4, MLP columns 0-127, vocab 0-127",
                         "tp rank 1 of 2: heads 2-3 of 4, MLP columns 128-255, vocab 128-255"]
        for k in r["ranks"]:
            assert k["info"]["strategy"] == "tp" and k["info"]["coords"]["tp"] == k["rank"]
            # blocks, token embedding and head split; position embedding and LayerNorms whole
            assert 0.45 <= k["info"]["param_bytes"] / full_p <= 0.6, k["info"]
            assert k["optim_bytes"] / full_o == pytest.approx(k["info"]["param_bytes"] / full_p)
    print("fsdp/tp param_bytes share:", {
        c: res["cases"][c]["ranks"][0]["info"]["param_bytes"] / full_p for c in ("fsdp:1", "tp:1")})


@pytest.mark.procs
def test_dp2_x_tp2_on_four_ranks_trains_like_one_process(tmp_path, repo_env):
    res = _cases(tmp_path, repo_env, 4, ["dp2xtp2:1", "dp2xtp2:2:w"])
    for case in ("dp2xtp2:1", "dp2xtp2:2:w"):
        r = _check_equivalence(res, case, 4)
        coords = [k["info"]["coords"] for k in r["ranks"]]
        assert coords == [{"pp": 0, "dp": d, "tp": t} for d in (0, 1) for t in (0, 1)]
        assert r["ranks"][3]["info"]["role"] == ("replica 1 of 2, tp rank 1 of 2: heads 2-3 of 4, "
                                                 "MLP columns 128-255, vocab 128-255")
        assert {k["info"]["strategy"] for k in r["ranks"]} == {"dp x tp"}


# ---------------------------------------------------------------- the trainer, and resharding

STEPS, EVERY, FROM = 10, 3, 3


def _run(tmp_path: Path, url: str, env: dict, name: str, job_id: int, parallel: dict,
         resume: dict | None = None) -> tuple[list[dict], list[dict], str]:
    t0 = time.monotonic()
    result = run_job(tmp_path, url, env, name, job_id, resume=resume, model=SMALL_MODEL, parallel=parallel,
                     train={"steps": STEPS, "global_batch": 16},
                     checkpoint={"every_steps": EVERY, "async": True, "keep": 3})
    print(f"{name}: torchrun {time.monotonic() - t0:.1f} s")
    return result


def _model():
    torch.manual_seed(0)
    return build_model(ModelSpec(**SMALL_MODEL))


def _weights(path: str) -> dict:
    """The model weights of a checkpoint, whatever plan saved it, loaded in this one process."""
    state = {"model": _model().state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]


def _job_loss(samples: list[dict]) -> dict[int, float]:
    """Loss of the step's global batch: the mean of the dp ranks' means (equal shares)."""
    by_step: dict[int, list[float]] = {}
    for s in samples:
        by_step.setdefault(s["step"], []).append(s["loss"])
    return {step: sum(v) / len(v) for step, v in by_step.items()}


@pytest.mark.procs
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # _weights: one process
def test_a_ddp_checkpoint_resumes_under_tp_and_fsdp_which_train_report_and_checkpoint(
        tmp_path, redis_server, repo_env):
    url = redis_server.url
    full = sum(p.numel() * p.element_size() for p in _model().parameters())
    ddp, ddp_events, _ = _run(tmp_path, url, repo_env, "ddp", 21, {"dp": 2, "tp": 1, "fsdp": False})
    [c3] = [e for e in ddp_events if e["kind"] == "checkpoint" and e["step"] == FROM]
    ddp_loss = _job_loss(ddp)
    resume = {"path": c3["path"], "step": FROM, "checkpoint_id": 1}
    [ddp10] = [e["path"] for e in ddp_events if e["kind"] == "checkpoint" and e["step"] == STEPS]
    plans = {"tp": {"dp": 1, "tp": 2, "fsdp": False}, "fsdp": {"dp": 2, "tp": 1, "fsdp": True}}
    for job_id, (name, parallel) in enumerate(plans.items(), start=22):
        samples, events, text = _run(tmp_path, url, repo_env, name, job_id, parallel, resume)
        for rank in (0, 1):
            # run_job copies the checkpoint into the resumed run's own checkpoint directory
            assert f"rank {rank} resumed from step {FROM} (" in text and \
                f"/{name}/ckpt/{Path(c3['path']).name})" in text, text
        # it trains: every rank reports every resumed step, the loss keeps falling
        assert sorted((s["rank"], s["step"]) for s in samples) == [
            (r, s) for r in (0, 1) for s in range(FROM + 1, STEPS + 1)]
        loss = _job_loss(samples)
        print(name, "resumed losses vs ddp:", {s: (round(loss[s], 6), round(ddp_loss[s], 6))
                                                for s in sorted(loss)})
        # the first resumed step: the DDP weights and AdamW moments, resharded, on the same batch
        assert loss[FROM + 1] == pytest.approx(ddp_loss[FROM + 1], rel=1e-5, abs=0), name
        for step in range(FROM + 2, STEPS + 1):  # and on: only rounding differs
            assert loss[step] == pytest.approx(ddp_loss[step], rel=1e-4, abs=0), (name, step)
        assert loss[STEPS] < ddp_loss[1] - 0.5
        # rank_plan: coordinates and the bytes this rank really holds
        plan = {e["rank"]: e for e in events if e["kind"] == "rank_plan"}
        assert sorted(plan) == [0, 1], events
        for rank, e in plan.items():
            assert e["strategy"] == name and e["full_param_bytes"] == full
            assert e["coords"] == {"pp": 0, "dp": rank if name == "fsdp" else 0,
                                   "tp": rank if name == "tp" else 0}
            assert e["mesh"]["shape"] == {"pp": 1, "dp": parallel["dp"], "tp": parallel["tp"]}
            assert 0.4 <= e["param_bytes"] / full <= 0.6, e
            assert e["optim_bytes"] == pytest.approx(2 * e["param_bytes"], rel=0.01), e
        # checkpoints written, in the plan-independent format
        ckpts = [e for e in events if e["kind"] == "checkpoint"]
        assert [e["step"] for e in ckpts] == [6, 9, 10], name
        for e in ckpts:
            assert ck.read_manifest(Path(e["path"]))["step"] == e["step"]
            files = {p.name for p in Path(e["path"]).iterdir()}
            assert {"rank-0.pt", "rank-1.pt", ".metadata"} <= files, files
        # ... which a single process loads into the plain model: the DDP run's step-10 weights
        # (up to AdamW-amplified rounding, see _check_equivalence)
        mine, ref, init = _weights(ckpts[-1]["path"]), _weights(ddp10), _model().state_dict()
        assert max((mine[k] - v).abs().max().item() for k, v in ref.items()) < 2e-4, name
        assert max((init[k] - v).abs().max().item() for k, v in ref.items()) > 5e-3  # it moved
