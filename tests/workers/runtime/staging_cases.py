"""Run under torchrun by test_checkpoint.py: three async saves of a DDP model on gloo, then each
reloaded into a fresh model.

    torchrun --nproc-per-node 2 tests/workers/runtime/staging_cases.py OUT_DIR

Each rank writes OUT_DIR/rank-<r>.json: the bytes of its state (model and optimizer tensors'
storages), the bytes torch's StateDictStager copied for each save (measured at the library:
every storage it stages), whether each checkpoint reloaded the weights, optimizer state and
step exactly, and whether the RNG draws after each load equal those after its save.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import _state_dict_stager
from torch.nn.parallel import DistributedDataParallel

from trainyard.sdk import checkpoint as ck
from trainyard.spec import CheckpointSpec

STAGED = [0]
_stage_storage = _state_dict_stager.StateDictStager._stage_untyped_storage


def _counting(self, storage, non_blocking=False):
    STAGED[0] += storage.nbytes()
    return _stage_storage(self, storage, non_blocking=non_blocking)


class Events:
    def event(self, kind, **fields):
        pass


def _model_and_opt(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 48),
                                torch.nn.GELU(), torch.nn.Linear(48, 8))
    return DistributedDataParallel(model), model


def _step(ddp, opt):
    ddp(torch.randn(4, 32)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt):
    osd = opt.state_dict()
    return ([v.clone() for v in model.state_dict().values()],
            [v.clone() for st in osd["state"].values() for v in st.values()])


def _same(a, b):
    return all(len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)) for x, y in zip(a, b))


def _draws():
    return [random.random(), float(np.random.rand()), torch.rand(3).tolist()]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _state_dict_stager.StateDictStager._stage_untyped_storage = _counting
    ddp, model = _model_and_opt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saver = ck.Checkpointer(CheckpointSpec(every_steps=1), out / "ckpt", job_id=1, attempt_id=1,
                            rank=rank, world_size=dist.get_world_size(), device=torch.device("cpu"),
                            reporter=Events())
    saved, staged = [], []
    for step in (1, 2, 3):
        _step(ddp, opt)
        at_save = _state(model, opt)
        random.seed(step * 10 + rank)
        before = STAGED[0]
        saver.save(step, model, opt)
        draws = _draws()
        saver.wait_for_staging()
        staged.append(STAGED[0] - before)
        saved.append((step, at_save, draws))
        _step(ddp, opt)  # changes everything the save copied
    saver.close()
    exact, rng = [], []
    for step, at_save, draws in saved:
        fresh_ddp, fresh = _model_and_opt(100 + step)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        _step(fresh_ddp, fresh_opt)  # optimizer state exists, different from the saved one
        resumed = saver.load(out / "ckpt" / f"step-{step:08d}-a1", fresh, fresh_opt, seed=0)
        exact.append(resumed.step == step and _same(_state(fresh, fresh_opt), at_save))
        rng.append(resumed.rng_restored and _draws() == draws)
    state_bytes = sum(t.untyped_storage().nbytes() for part in _state(model, opt) for t in part)
    (out / f"rank-{rank}.json").write_text(json.dumps(
        {"state_bytes": state_bytes, "staged_bytes": staged, "exact": exact, "rng": rng}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
