"""Pipeline equivalence cases, run under torchrun by tests/workers/runtime/test_pipeline.py.

    python -m torch.distributed.run --standalone --nproc-per-node N \
        tests/workers/runtime/pipeline_cases.py OUT_DIR CASE [CASE ...]

Each case (name "pp<P>-<schedule>" or "dp<D>pp<P>-<schedule>") builds a fresh GPT with
torch.manual_seed(SEED), wraps it in PipelineStrategy and trains it K steps with the trainer's
AdamW on fixed random batches; every rank also trains the plain model on the same global batch
in-process (the reference). Each rank writes OUT_DIR/<case>-rank<r>.json with its losses, the
reference's, eval losses, param_bytes, its stage's parameter FQNs and the largest relative
difference between its stage's step-1 gradients and the reference's gradients of the same names
(gradients, not parameters after K steps: AdamW turns the rounding noise of a ~0 gradient into
a full lr-sized step, so parameters are no sharper a test than the losses). The assertions live in the test.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainyard.spec import ModelSpec
from workers.runtime.config import parse_run_config
from workers.runtime.model import build_model, lm_loss
from trainyard.mesh import Mesh
from workers.runtime.parallel import param_bytes
from workers.runtime.pipeline import PipelineStrategy

SEED, STEPS, GLOBAL_BATCH, MICROBATCHES = 3, 6, 8, 4
MODEL = {"kind": "gpt", "layers": 4, "hidden": 32, "heads": 4, "seq_len": 32, "vocab": 256}


def _config(dp: int, pp: int, schedule: str):
    raw = {"job_id": 1, "attempt_id": 1, "node": "n", "run_dir": "/tmp/x", "redis_url": "redis://x:1/0",
           "stream": "s", "data_root": "/tmp/x", "checkpoint_dir": "/tmp/x",
           "spec": {"name": "x", "model": MODEL, "train": {"global_batch": GLOBAL_BATCH, "seed": SEED},
                    "resources": {"nodes": 1, "procs_per_node": dp * pp},
                    "parallel": {"dp": dp, "pp": pp, "tp": 1, "microbatches": MICROBATCHES,
                                 "schedule": schedule}}}
    return parse_run_config(raw)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)


def _batches():
    g = torch.Generator().manual_seed(SEED + 1)
    data = torch.randint(0, MODEL["vocab"], (STEPS + 1, GLOBAL_BATCH, MODEL["seq_len"] + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in data]


def _grad_diff(module, ref_grads: dict) -> float:
    """Largest ||g - g_ref|| / ||g_ref|| over this stage's parameters at step 1 (before any
    optimizer step). Tensors whose reference gradient is ~0 in exact arithmetic (the key bias:
    softmax ignores a constant added to every score of a query) are measured against 1e-6 of
    the whole model's gradient norm instead of their own rounding noise."""
    floor = 1e-6 * torch.sqrt(sum(g.pow(2).sum() for g in ref_grads.values()))
    return max((torch.linalg.vector_norm(p.grad - ref_grads[n])
                / torch.maximum(torch.linalg.vector_norm(ref_grads[n]), floor)).item()
               for n, p in module.named_parameters())


def _save(path: Path, model, opt) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(path: Path, model, opt) -> None:
    msd, osd = get_state_dict(model, opt)  # initialises the optimizer's state: shapes to load into
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _state_diff(stage, stage_opt, full, full_opt) -> float:
    """Largest |difference| between the stage's parameters and AdamW state and the full model's
    entries of the same names (0.0: a bit-exact round trip)."""
    full_params = dict(full.named_parameters())
    worst = 0.0
    for fqn, p in stage.named_parameters():
        q = full_params[fqn]
        worst = max(worst, (p - q).abs().max().item())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            a, b = stage_opt.state[p][key], full_opt.state[q][key]
            worst = max(worst, (a - b).abs().max().item())
    return worst


def reshard_checks(name: str, out: Path, cfg, mesh, strategy, opt, ref, ref_opt) -> dict:
    """DCP checkpoints cross plans both ways, optimizer state included: this pipeline's state
    loaded into a plain model (what a DDP resume does), and the plain model's into a fresh
    pipeline. Both targets start from other weights (seed 99) so a no-op load cannot pass."""
    rank = dist.get_rank()
    _save(out / f"ckpt-{name}-pp", strategy.module, opt)
    torch.manual_seed(99)
    full = build_model(ModelSpec(**MODEL))
    full_opt = _adamw(full.parameters())
    _load(out / f"ckpt-{name}-pp", full, full_opt)
    pp_to_full = _state_diff(strategy.module, opt, full, full_opt)

    _save(out / f"ckpt-{name}-full", ref, ref_opt)
    torch.manual_seed(99)
    fresh = PipelineStrategy(build_model(ModelSpec(**MODEL)), mesh, rank, torch.device("cpu"),
                             hidden=cfg.model.hidden, microbatches=cfg.parallel.microbatches,
                             schedule=cfg.parallel.schedule)
    fresh_opt = _adamw(fresh.module.parameters())
    _load(out / f"ckpt-{name}-full", fresh.module, fresh_opt)
    full_to_pp = _state_diff(fresh.module, fresh_opt, ref, ref_opt)
    return {"pp_to_full": pp_to_full, "full_to_pp": full_to_pp}


def run_case(name: str, out: Path) -> None:
    m = re.fullmatch(r"(?:dp(\d+))?pp(\d+)-(gpipe|1f1b)", name)
    dp, pp, schedule = int(m.group(1) or 1), int(m.group(2)), m.group(3)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dp * pp == world, (name, world)
    cfg = _config(dp, pp, schedule)
    mesh = Mesh.for_world(world, tp=cfg.parallel.tp, pp=cfg.parallel.pp, dp=cfg.parallel.dp)
    batches = _batches()

    torch.manual_seed(SEED)
    ref = build_model(ModelSpec(**MODEL))
    ref_opt = _adamw(ref.parameters())
    full_bytes = param_bytes(ref)
    ref_losses, ref_grads = [], {}
    for x, y in batches[:STEPS]:
        loss = lm_loss(ref(x), y)
        loss.backward()
        if not ref_grads:
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())
    with torch.no_grad():
        ref_eval = lm_loss(ref(batches[STEPS][0]), batches[STEPS][1]).item()

    torch.manual_seed(SEED)
    strategy = PipelineStrategy(build_model(ModelSpec(**MODEL)), mesh, rank, torch.device("cpu"),
                                hidden=cfg.model.hidden, microbatches=cfg.parallel.microbatches,
                                schedule=cfg.parallel.schedule)
    opt = _adamw(strategy.module.parameters())
    d = mesh.coords(rank)["dp"]
    share = GLOBAL_BATCH // dp
    losses, dp_losses = [], []
    for x, y in batches[:STEPS]:
        xs, ys = x[d * share:(d + 1) * share], y[d * share:(d + 1) * share]
        loss = strategy.forward_backward(xs, ys, 1)
        if not losses:
            grad_diff = _grad_diff(strategy.module, ref_grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    x, y = batches[STEPS]
    eval_loss = strategy.eval_loss(x, y)
    ref_params = dict(ref.named_parameters())
    # once per layout: the schedule does not change what a stage holds
    reshard = None
    if schedule == "1f1b":
        reshard = reshard_checks(name, out, cfg, mesh, strategy, opt, ref, ref_opt)
    # the step loss averaged over dp coordinates is the global batch's mean loss (every rank of
    # one pipeline reports its dp coordinate's loss, so the mean over the world is that mean)
    if dp > 1:
        t = torch.tensor(losses)
        dist.all_reduce(t)
        dp_losses = (t / world).tolist()
    result = {"case": name, "rank": rank, "coords": mesh.coords(rank), "info": strategy.info(),
              "losses": losses, "dp_mean_losses": dp_losses, "ref_losses": ref_losses,
              "eval_loss": eval_loss, "ref_eval_loss": ref_eval,
              "param_bytes": param_bytes(strategy.module), "full_param_bytes": full_bytes,
              "fqns": sorted(n for n, _ in strategy.module.named_parameters()),
              "ref_fqns": sorted(ref_params), "grad_rel_diff": grad_diff, "reshard": reshard}
    (out / f"{name}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)  # N ranks share 2 cores
    dist.init_process_group("gloo")
    try:
        for name in cases:
            run_case(name, out)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print("cases done:", " ".join(cases), flush=True)


if __name__ == "__main__":
    main()
