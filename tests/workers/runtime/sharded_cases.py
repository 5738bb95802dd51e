"""Run under torchrun by test_sharded.py: ShardedStrategy against single-process training.

    torchrun --nproc-per-node N tests/workers/runtime/sharded_cases.py OUT.json CASE [CASE ...]

CASE is "<plan>:<accum>" with plan fsdp | tp | dp2xtp2, or "<plan>:<accum>:w" where dp rank d
weights its share of the gradient average by WEIGHTS[d] (DDPStrategy's `weight`, balancing).
Every case builds a fresh GPT with the same seed and trains it STEPS AdamW steps (the trainer's
settings) on a fixed global batch through the strategy; every rank also trains the unsharded
model on the whole batch locally (the reference). Rank 0 writes per case: the job's loss per
step (mean over dp), the reference's, each rank's param/optimizer bytes and role, the largest
difference between the final full weights and the reference's, and the largest difference of
replicated gradients across tp ranks.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from trainyard.mesh import Mesh
from trainyard.spec import ModelSpec
from trainyard.spec_parallel import ParallelSpec
from trainyard.sdk.procexit import main_then_exit
from workers.runtime.model import build_model, lm_loss
from workers.runtime.parallel import optim_bytes, param_bytes
from workers.runtime.sharded import ShardedStrategy

SMALL = ModelSpec(kind="gpt", layers=2, hidden=64, heads=4, seq_len=64, vocab=256)
STEPS, BATCH, SEED = 6, 8, 0
PLANS = {"fsdp": dict(dp=2, tp=1, fsdp=True), "tp": dict(dp=1, tp=2, fsdp=False),
         "dp2xtp2": dict(dp=2, tp=2, fsdp=False)}
WEIGHTS = (1.5, 0.5)  # dp 2: the update is that of 0.75 x loss(first half) + 0.25 x loss(second)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)


def batch():
    # a learnable stream: each token is the previous one plus a small random step
    g = torch.Generator().manual_seed(1)
    steps = torch.randint(0, 3, (BATCH, SMALL.seq_len + 1), generator=g)
    tokens = (steps.cumsum(1) + torch.randint(0, 256, (BATCH, 1), generator=g)) % 256
    return tokens[:, :-1], tokens[:, 1:]


def reference(x, y, weights=None):
    """Single-process training on the whole batch; with `weights`, on the weighted mean of
    the dp halves' losses (the reported loss stays the unweighted mean)."""
    torch.manual_seed(SEED)
    model = build_model(SMALL)
    opt, losses = adamw(model.parameters()), []
    for _ in range(STEPS):
        if weights is None:
            loss = lm_loss(model(x), y)
            loss.backward()
        else:
            halves = [lm_loss(model(xh), yh) for xh, yh in zip(x.chunk(2), y.chunk(2))]
            sum(w / 2 * h for w, h in zip(weights, halves)).backward()
            loss = sum(halves) / 2
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def replicated_diff(strategy: ShardedStrategy, mesh: Mesh, rank: int, of=lambda p: p.grad) -> float:
    """Largest |of(p) - of(p) on tp rank 0| over the parameters every tp rank holds whole
    (their gradient by default; `of=lambda p: p` compares the parameters themselves)."""
    if mesh.tp == 1:
        return 0.0
    model, group = strategy.module, strategy.device_mesh["tp"].get_group()
    first = rank - mesh.coords(rank)["tp"]
    worst = 0.0
    for p in model.parameters():
        if hasattr(p, "placements") and not all(pl.is_replicate() for pl in p.placements):
            continue
        g = _local(of(p))
        src = g.clone()
        dist.broadcast(src, first, group=group)
        worst = max(worst, (g - src).abs().max().item())
    return worst


def run_case(case: str, x, y, ref_losses, ref_state, rank: int, world: int) -> dict:
    plan, accum, *weighted = case.split(":")
    weight = 1.0
    if weighted:
        ref_losses, ref_state = reference(x, y, WEIGHTS)
    p = ParallelSpec(**PLANS[plan])
    mesh = Mesh(pp=1, dp=p.dp, tp=p.tp, fsdp=p.fsdp)
    assert mesh.dp * mesh.tp == world, (case, world)
    torch.manual_seed(SEED)
    model = build_model(SMALL)
    strategy = ShardedStrategy(model, mesh, rank, torch.device("cpu"), vocab=SMALL.vocab,
                               heads=SMALL.heads, hidden=SMALL.hidden)
    opt = adamw(strategy.module.parameters())
    dp = mesh.coords(rank)["dp"]
    share = BATCH // mesh.dp
    if weighted:
        weight = WEIGHTS[dp]
    xs, ys = x[dp * share:(dp + 1) * share], y[dp * share:(dp + 1) * share]
    losses, grad_diff = [], 0.0
    for step in range(STEPS):
        loss = strategy.forward_backward(xs, ys, int(accum), weight).clone()
        if step == STEPS - 1:
            grad_diff = replicated_diff(strategy, mesh, rank)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss)  # every rank of a dp coordinate holds its dp share's mean loss
        losses.append(loss.item() / world)
    param_diff = replicated_diff(strategy, mesh, rank, of=lambda p: p)  # after every step
    state = {k: full(v) for k, v in strategy.module.state_dict().items()}
    weight_diff, worst = max(((state[k] - v).abs().max().item(), k) for k, v in ref_state.items())
    eval_loss = strategy.eval_loss(x, y)
    mine = {"rank": rank, "info": strategy.info(), "optim_bytes": optim_bytes(opt),
            "weight_diff": weight_diff, "worst": worst, "grad_diff": grad_diff,
            "param_diff": param_diff, "eval_loss": eval_loss, "keys": sorted(state)}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    return {"losses": losses, "ref_losses": ref_losses, "ranks": ranks}


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch()
    ref_losses, ref_state = reference(x, y)
    ref_model = build_model(SMALL)
    ref_opt = adamw(ref_model.parameters())
    lm_loss(ref_model(x), y).backward()
    ref_opt.step()
    results = {"full_param_bytes": param_bytes(ref_model), "full_optim_bytes": optim_bytes(ref_opt),
               "ref_keys": sorted(ref_state), "cases": {}}
    for case in cases:
        results["cases"][case] = run_case(case, x, y, ref_losses, ref_state, rank, world)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main_then_exit(main)  # not through finalization: torch's gloo workers can abort it (trainyard/sdk/procexit.py)
