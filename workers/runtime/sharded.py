"""Sharded strategies: FSDP2 over the data-parallel ranks, and tensor parallelism (alone or
dp x tp) for the built-in GPT.

FSDP (tp 1): `fully_shard` on every Block (or MLP layer) and on the root, over a 1-D mesh of
the dp ranks. Each rank keeps 1/dp of every parameter (a DTensor sharded on dim 0) and so 1/dp
of the gradients and of AdamW's moments; a block's weights are all-gathered just before its
forward and again for its backward, and its gradients reduce-scattered (averaged) right after.
Gradient accumulation: the first accum-1 micro-batches run with
`set_requires_gradient_sync(False)` (FSDP's no_sync: unsharded gradients accumulate locally),
the last one reduce-scatters the sum.

TP (Megatron-style, torch.distributed.tensor.parallel): q, k, v and the MLP's first Linear are
split by output columns (ColwiseParallel), the attention output projection and the MLP's second
Linear by input rows (RowwiseParallel), so a tp rank computes heads/tp whole heads and 4h/tp MLP
columns, with one all-reduce after each of the two row-parallel Linears in the forward (and one
per block input in the backward). The token embedding is split by vocab rows and the LM head by
vocab columns (its logits all-gathered, so the loss is the plain one on every tp rank) when
vocab % tp == 0; position embeddings and LayerNorms stay replicated: their gradients come out
identical on every tp rank because the backward all-reduces the gradient of every block input.
dp x tp: a ("dp", "tp") mesh (tp innermost, as trainyard.mesh.Mesh orders ranks); after the last
micro-batch's backward every gradient (its local shard) is averaged over the dp group in one
flat all-reduce, which is what DDP would do, minus the overlap with backward.

Checkpoints: the parameters are DTensors, so get_state_dict yields the plain model's FQNs with
sharded values, and DCP reshards on load: a DDP checkpoint loads under TP or FSDP and back.

What this cannot run (FSDP with TP, TP of the MLP or over heads it does not divide, gradient
compression, local SGD) the JobSpec refuses at submit (trainyard/spec.py `unsupported_options`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from trainyard.mesh import Mesh
from trainyard.sdk.groups import track_group

from .model import GPT, lm_loss
from .parallel import eval_loss_of, param_bytes


def tp_plan(model: GPT, tp: int, vocab: int) -> dict:
    """parallelize_module's plan for the GPT: module FQN -> style."""
    plan = {}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan.update({f"{b}.attn.q": ColwiseParallel(), f"{b}.attn.k": ColwiseParallel(),
                     f"{b}.attn.v": ColwiseParallel(), f"{b}.attn.proj": RowwiseParallel(),
                     f"{b}.mlp.0": ColwiseParallel(), f"{b}.mlp.2": RowwiseParallel()})
    if vocab % tp == 0:  # even vocab shards only: no padded all-gathers of the logits
        plan["tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def _span(n: int, parts: int, i: int) -> str:
    size = n // parts
    return f"{i * size}-{(i + 1) * size - 1}"


class ShardedStrategy:
    """FSDP2 (mesh.fsdp), TP (mesh.tp > 1) or dp x tp; see the module docstring."""

    def __init__(self, model: nn.Module, mesh: Mesh, rank: int, device: torch.device, *,
                 vocab: int, heads: int, hidden: int):
        self.mesh, self.rank = mesh, rank
        self.vocab, self.heads, self.hidden = vocab, heads, hidden  # the role's arithmetic
        self.coords = mesh.coords(rank)
        self.full_param_bytes = param_bytes(model)
        if mesh.fsdp:
            self.name = "fsdp"
            self.device_mesh = init_device_mesh(device.type, (mesh.dp,), mesh_dim_names=("dp",))
            self.dp_group = None  # FSDP reduce-scatters over the dp mesh itself
            units = model.blocks if isinstance(model, GPT) else model.layers
            for unit in units:
                fully_shard(unit, mesh=self.device_mesh)
            fully_shard(model, mesh=self.device_mesh)
        else:
            self.name = "tp" if mesh.dp == 1 else "dp x tp"
            self.device_mesh = init_device_mesh(device.type, (mesh.dp, mesh.tp),
                                                mesh_dim_names=("dp", "tp"))
            for dim in ("dp", "tp"):  # the run's collective timeout from the first step
                track_group(self.device_mesh.get_group(dim))
            self.dp_group = self.device_mesh["dp"].get_group() if mesh.dp > 1 else None
            parallelize_module(model, self.device_mesh["tp"],
                               tp_plan(model, mesh.tp, vocab))
        self.module = model

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, accum: int,
                         weight: float = 1.0) -> torch.Tensor:
        """Gradients of the mean loss over this dp coordinate's (x, y), `weight` scaling this
        rank's share of the dp average as in DDPStrategy; returns the unscaled mean loss."""
        model, total = self.module, None
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            if self.mesh.fsdp:
                model.set_requires_gradient_sync(i == accum - 1)
            loss = lm_loss(model(xm), ym)
            (loss * (weight / accum)).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.dp_group is not None:
            self._average_grads_over_dp()
        return total / accum

    @torch.no_grad()
    def _average_grads_over_dp(self) -> None:
        """One flat all-reduce of every local gradient shard over the dp group, then / dp."""
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in self.module.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.mesh.dp
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """No-grad loss of the current model; collective, so called on every rank."""
        try:
            return eval_loss_of(self.module, x, y)
        finally:
            self._reshard()

    def _reshard(self) -> None:
        # FSDP keeps the root's parameters (embeddings, ln_f, head) unsharded after a forward
        # (its backward would all-gather them right away); outside training free them again.
        if self.mesh.fsdp:
            self.module.reshard()

    def role(self) -> str:
        m, c = self.mesh, self.coords
        if m.fsdp:
            return (f"fsdp shard {c['dp']} of {m.dp}: 1/{m.dp} of every parameter, gradient and "
                    f"optimizer state")
        t = c["tp"]
        per = self.heads // m.tp
        role = (f"tp rank {t} of {m.tp}: heads {t * per}-{(t + 1) * per - 1} of {self.heads}, "
                f"MLP columns {_span(4 * self.hidden, m.tp, t)}")
        if self.vocab % m.tp == 0:
            role += f", vocab {_span(self.vocab, m.tp, t)}"
        return role if m.dp == 1 else f"replica {c['dp']} of {m.dp}, {role}"

    def info(self) -> dict:
        self._reshard()  # count what this rank keeps between steps: its shards
        return {"strategy": self.name, "mesh": self.mesh.describe(), "coords": self.coords,
                "role": self.role(), "param_bytes": param_bytes(self.module),
                "full_param_bytes": self.full_param_bytes}
