"""Pipeline equivalence cases, run under torchrun by tests/runtime/test_pipeline.py.

    python -m torch.distributed.run --standalone --nproc-per-node N \
        tests/runtime/pipeline_cases.py OUT_DIR CASE [CASE ...]

Each case (name "pp<P>-<schedule>" or "dp<D>pp<P>-<schedule>") builds a fresh GPT with
torch.manual_seed(SEED), wraps it in PipelineStrategy and trains it K steps with the trainer's
AdamW on fixed random batches; every rank also trains the plain model on the same global batch
in-process (the reference). Each rank writes OUT_DIR/<case>-rank<r>.json with its losses, the
reference's, eval losses, param_bytes, its stage's parameter FQNs and the largest relative
difference between its stage's final parameters and the reference's parameters of the same
names. The assertions live in the test.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from workers.runtime.config import ModelConfig, parse_run_config
from workers.runtime.model import build_model, lm_loss
from workers.runtime.parallel import Mesh, param_bytes
from workers.runtime.pipeline import PipelineStrategy

SEED, STEPS, GLOBAL_BATCH, MICROBATCHES = 3, 6, 8, 4
MODEL = {"kind": "gpt", "layers": 4, "hidden": 32, "heads": 4, "seq_len": 32, "vocab": 256}


def _config(dp: int, pp: int, schedule: str):
    raw = {"job_id": 1, "attempt_id": 1, "node": "n", "run_dir": "/tmp/x", "redis_url": "redis://x:1/0",
           "stream": "s", "data_root": "/tmp/x", "checkpoint_dir": "/tmp/x",
           "spec": {"model": MODEL, "train": {"global_batch": GLOBAL_BATCH, "seed": SEED},
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


def run_case(name: str, out: Path) -> None:
    m = re.fullmatch(r"(?:dp(\d+))?pp(\d+)-(gpipe|1f1b)", name)
    dp, pp, schedule = int(m.group(1) or 1), int(m.group(2)), m.group(3)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dp * pp == world, (name, world)
    cfg = _config(dp, pp, schedule)
    mesh = Mesh.from_config(cfg, world)
    batches = _batches()

    torch.manual_seed(SEED)
    ref = build_model(ModelConfig(**MODEL))
    ref_opt = _adamw(ref.parameters())
    full_bytes = param_bytes(ref)
    ref_losses = []
    for x, y in batches[:STEPS]:
        loss = lm_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())
    with torch.no_grad():
        ref_eval = lm_loss(ref(batches[STEPS][0]), batches[STEPS][1]).item()

    torch.manual_seed(SEED)
    strategy = PipelineStrategy(cfg, build_model(ModelConfig(**MODEL)), mesh, rank, torch.device("cpu"))
    opt = _adamw(strategy.module.parameters())
    d = mesh.coords(rank)["dp"]
    share = GLOBAL_BATCH // dp
    losses, dp_losses = [], []
    for x, y in batches[:STEPS]:
        xs, ys = x[d * share:(d + 1) * share], y[d * share:(d + 1) * share]
        loss = strategy.forward_backward(xs, ys, 1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    x, y = batches[STEPS]
    eval_loss = strategy.eval_loss(x, y)
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for fqn, p in strategy.module.named_parameters():
        r = ref_params[fqn].detach()
        worst = max(worst, ((p.detach() - r).abs().max() / r.abs().max()).item())
    # the step loss averaged over dp coordinates is the global batch's mean loss
    if dp > 1:
        t = torch.tensor(losses)
        dist.all_reduce(t)
        dp_losses = (t / dp).tolist()
    result = {"case": name, "rank": rank, "coords": mesh.coords(rank), "info": strategy.info(),
              "losses": losses, "dp_mean_losses": dp_losses, "ref_losses": ref_losses,
              "eval_loss": eval_loss, "ref_eval_loss": ref_eval, "param_bytes": param_bytes(strategy.module),
              "full_param_bytes": full_bytes, "fqns": sorted(n for n, _ in strategy.module.named_parameters()),
              "ref_fqns": sorted(ref_params), "max_param_rel_diff": worst}
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
