"""One replica of a heal-in-place data-parallel job (trainyard.sdk.heal): run it under its own
torchrun per replica, with TRAINYARD_HEAL_REPLICA / TRAINYARD_HEAL_REPLICAS / TORCHFT_LIGHTHOUSE
set, e.g. for replica 1 of 2:

    python -m trainyard.sdk.heal lighthouse --bind 127.0.0.1:29510 &
    TRAINYARD_HEAL_REPLICA=1 TRAINYARD_HEAL_REPLICAS=2 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \\
        torchrun --standalone --nproc-per-node 1 --max-restarts 3 examples/heal/train.py --steps 300

Each step's batch is drawn from (step, replica), so a replica that healed at step s reads exactly
the batches it would have read at s. Writes one JSON line per step (and per heal) to --out (or
stdout), and at the end a digest of the parameters: every replica's must be the same.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch
from torch import nn

from trainyard.sdk.heal import Healing


def batch(step: int, replica: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + replica)
    x = torch.randn(size, 64, generator=g)
    return x, x[:, :8] * 0.5 + 0.1 * torch.randn(size, 8, generator=g)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds of extra work per step")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = open(args.out, "a", buffering=1) if args.out else sys.stdout

    def say(**kw) -> None:
        out.write(json.dumps(kw) + "\n")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    healing = Healing(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    say(event="up", replica=healing.replica, step=healing.step, t=time.time())
    seen = 0
    while healing.step < args.steps:
        healing.begin()  # the quorum: after it, healing.step is the step every participant trains
        step = healing.step
        if len(healing.healed) > seen:  # this replica just received its state from a peer
            seen = len(healing.healed)
            h = healing.healed[-1]
            say(event="healed", replica=healing.replica, step=step, load_s=round(h.load_s, 4), t=h.at)
        x, y = batch(step, healing.replica)
        loss = nn.functional.mse_loss(healing.model(x), y)
        loss.backward()
        if args.sleep:
            time.sleep(args.sleep)
        committed = healing.commit()
        say(event="step", replica=healing.replica, step=step, committed=committed, participants=healing.participants,
            loss=round(loss.item(), 6), t=time.time())
    say(event="done", replica=healing.replica, step=healing.step, digest=digest(model), t=time.time())


if __name__ == "__main__":
    main()
