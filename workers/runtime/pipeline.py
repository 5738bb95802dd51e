"""Pipeline parallelism (pp, and dp x pp) for the built-in GPT, on torch.distributed.pipelining.

The stage: every rank builds the full model with the job seed (trainer.py), then keeps only the
modules of its stage, torchtitan style: stage 0 holds the token and position embeddings and the
first blocks, the last stage the last blocks, ln_f and the head; the blocks are split as evenly
as possible (the first `layers % pp` stages take one more). The kept blocks sit in an
nn.ModuleDict under their index in the full model, so parameter FQNs are the full model's
("blocks.3.attn..."): get_state_dict on a stage yields a subset of the plain model's keys, the
stages' checkpoint shards together hold the whole model, and the checkpoint loads under any other
plan (and the reverse). Only block granularity is assumed: what is inside a block is model.py's.

A step (`forward_backward`): PipelineStage + ScheduleGPipe or Schedule1F1B over the pp group
(the ranks with this rank's dp coordinate), `parallel.microbatches` micro-batches of equal size,
loss_fn = lm_loss (the mean over one micro-batch). The schedule divides the gradients by the
number of micro-batches (scale_grads=True), so they are those of the mean of the micro-batch
means = the mean loss over the batch; the reported loss is that same mean, computed on the last
stage and broadcast over the pp group so that every rank reports the step's loss. With dp > 1
the gradients are then averaged over the dp group (the ranks holding the same stage) with one
all_reduce of a flat buffer, so each replica of a stage applies the mean over the global batch.

Evaluation (`eval_loss`) is a plain no-grad forward handed from stage to stage with send/recv
over the pp group (no schedule state involved), the loss broadcast from the last stage.

What this cannot run (the MLP, tp or fsdp with pp, grad_accum, compression, local SGD, balancing,
microbatches that do not divide the replica's batch, 1f1b with fewer micro-batches than stages)
the JobSpec refuses at submit (trainyard/spec.py `unsupported_options`); the stage split is
trainyard/mesh.py's `stage_layers`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from trainyard.mesh import Mesh, stage_layers
from trainyard.sdk.groups import new_group

from .model import GPT, lm_loss
from .parallel import param_bytes

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # parallel.schedule -> torch's class


class GPTStage(nn.Module):
    """The part of a GPT one pipeline stage runs, under the full model's parameter names.

    forward: stage 0 takes (B, T) token ids, the others the previous stage's (B, T, hidden)
    activations; the last stage returns (B, T, vocab) logits, the others activations.
    """

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool):
        super().__init__()
        self.seq_len = model.seq_len
        self.block_range = blocks
        # The modules of the full model themselves (no copies): what this stage does not keep
        # is dropped with the full model once the caller lets go of it.
        self.tok = model.tok if first else None
        self.pos = model.pos if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.ln_f = model.ln_f if last else None
        self.head = model.head if last else None
        # ... and delete them from the full model too (the trainer still holds it), so this
        # rank's memory holds only its stage; the gutted GPT must not be called any more.
        model.tok, model.pos, model.ln_f, model.head = self.tok, self.pos, self.ln_f, self.head
        model.blocks = self.blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:  # the same arithmetic as GPT.forward's embedding
            t = x.shape[1]
            if t > self.seq_len:
                raise ValueError(f"sequence of {t} tokens exceeds model.seq_len={self.seq_len}")
            x = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x

    def describe(self) -> str:
        parts = ["tok", "pos"] if self.tok is not None else []
        r = self.block_range
        parts.append(f"blocks {r.start}-{r.stop - 1}")
        if self.head is not None:
            parts += ["ln_f", "head"]
        return ", ".join(parts)


def pp_ranks(mesh: Mesh, dp: int, tp: int = 0) -> list[int]:
    """Global ranks of the pipeline with dp coordinate `dp`, stage 0 first."""
    return [mesh.rank_of(pp=p, dp=dp, tp=tp) for p in range(mesh.pp)]


def dp_ranks(mesh: Mesh, pp: int, tp: int = 0) -> list[int]:
    """Global ranks holding stage `pp` (one per dp coordinate)."""
    return [mesh.rank_of(pp=pp, dp=d, tp=tp) for d in range(mesh.dp)]


class PipelineStrategy:
    """One pipeline stage per rank; dp replicas of each stage average their gradients."""

    def __init__(self, model: GPT, mesh: Mesh, rank: int, device: torch.device, *, hidden: int,
                 microbatches: int, schedule: str):
        self.mesh, self.rank, self.device = mesh, rank, device
        self.name = "pp" if mesh.dp == 1 else "dp x pp"  # as sharded.py names "tp", "dp x tp"
        c = mesh.coords(rank)
        self.stage_index, self.dp_index = c["pp"], c["dp"]
        # Every rank creates every group, in the same order (new_group is collective).
        pp_groups = [new_group(pp_ranks(mesh, d)) for d in range(mesh.dp)]
        self.pp_group = pp_groups[self.dp_index]
        self.pp_ranks = pp_ranks(mesh, self.dp_index)
        dp_groups = [new_group(dp_ranks(mesh, s)) for s in range(mesh.pp)] if mesh.dp > 1 else []
        self.dp_group = dp_groups[self.stage_index] if dp_groups else None
        self.first = self.stage_index == 0
        self.last = self.stage_index == mesh.pp - 1
        blocks = stage_layers(len(model.blocks), mesh.pp)[self.stage_index]
        self.module = GPTStage(model, blocks, self.first, self.last).to(device)
        self.hidden = hidden
        self.stage = PipelineStage(self.module, self.stage_index, mesh.pp, device,
                                   group=self.pp_group)
        self.microbatches = microbatches
        self.schedule = SCHEDULES[schedule](
            self.stage, n_microbatches=microbatches, loss_fn=lm_loss, scale_grads=True)
        self.schedule_name = schedule

    # ---- training ----------------------------------------------------------------------------
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, accum: int,
                         weight: float = 1.0) -> torch.Tensor:
        """One schedule step over (x, y) (the schedule cuts the micro-batches: `accum` is 1)."""
        losses: list[torch.Tensor] = []
        if self.first:  # pp >= 2: no stage is both first and last
            self.schedule.step(x, return_outputs=False)
        elif self.last:
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        if self.last:
            loss = torch.stack([v.detach() for v in losses]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.pp_ranks[-1], group=self.pp_group)
        if weight != 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(weight)
        if self.dp_group is not None:
            self._average_grads()
        return loss

    def _average_grads(self) -> None:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(self.mesh.dp)
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    # ---- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """No-grad loss of the whole pipeline on (x, y), the same float on every rank."""
        self.module.eval()
        try:
            if self.first:
                h = x
            else:
                dtype = next(self.module.parameters()).dtype
                h = torch.empty(x.shape[0], x.shape[1], self.hidden, dtype=dtype, device=self.device)
                dist.recv(h, src=self.pp_ranks[self.stage_index - 1], group=self.pp_group)
            out = self.module(h)
            if not self.last:
                dist.send(out.contiguous(), dst=self.pp_ranks[self.stage_index + 1],
                          group=self.pp_group)
                loss = torch.zeros((), device=self.device)
            else:
                loss = lm_loss(out, y).float()
            dist.broadcast(loss, src=self.pp_ranks[-1], group=self.pp_group)
            return loss.item()
        finally:
            self.module.train()

    def info(self) -> dict:
        role = f"stage {self.stage_index} of {self.mesh.pp}: {self.module.describe()}"
        if self.mesh.dp > 1:
            role += f" (replica {self.dp_index} of {self.mesh.dp})"
        return {"strategy": self.name, "mesh": self.mesh.describe(),
                "coords": self.mesh.coords(self.rank), "role": role,
                "schedule": self.schedule_name, "microbatches": self.microbatches,
                "param_bytes": param_bytes(self.module)}
