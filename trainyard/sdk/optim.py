"""The run's optimizer: AdamW over what the strategy's module holds, or, with
parallel.shard_optimizer, ZeRO-1 (torch.distributed.optim.ZeroRedundancyOptimizer) over the
strategy's data-parallel group.

ZeRO-1: the parameters a dp rank holds (all of them under DDP; its stage's under dp x pp; its
tensor-parallel shards under dp x tp) are partitioned between the dp ranks by whole tensors,
largest first, each to the rank with the fewest elements so far; each rank's local AdamW keeps
the state (exp_avg, exp_avg_sq, step) of its partition only, so a rank holds about 1/dp of the
optimizer state. Gradients are averaged as before (DDP's buckets, or the strategy's dp
all-reduce), every rank updates its own partition, then each partition is broadcast from its
owner over the dp group. The math is AdamW's, parameter by parameter: the losses are the
unsharded run's (tests/workers/runtime/test_recompute_zero.py). The broadcasts run inside opt.step(), so
their time is in optim_s and their bytes are not in bytes_sent (which counts gradient traffic).

Checkpoints: `state_optimizer` is the optimizer holding this rank's state (the local AdamW for
ZeRO). The checkpoint saves it with get_optimizer_state_dict over the strategy's module, keyed
by parameter FQN as an unsharded run's, so each rank writes the entries of the parameters it
owns and DCP's metadata holds every entry once: a ZeRO checkpoint resumes under ZeRO, under
plain AdamW or another plan, and the reverse (each rank loads the entries it owns).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from trainyard.spec import TrainSpec

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01


class ZeroOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer whose parameter broadcasts also handle DTensor parameters (dp x tp):
    torch's broadcasts `param.data`, which for a DTensor is not a plain tensor gloo or NCCL can
    send; this broadcasts the local shard (a view of the parameter's storage) instead. Plain
    tensors go exactly as in torch."""

    def _broadcast_params_from_rank(self, rank: int):
        src = dist.get_global_rank(self.process_group, rank)
        return [dist.broadcast(_local(p.data), src=src, group=self.process_group, async_op=True)
                for group in self._partition_parameters()[rank] for p in group["params"]]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def param_bytes(module: nn.Module) -> int:
    """Bytes of parameters this rank really stores (a DTensor counts its local shard only)."""
    return sum(_local(p).numel() * p.element_size() for p in module.parameters())


def optim_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += _local(v).numel() * v.element_size()
    return total


def build_optimizer(module: nn.Module, train: TrainSpec, *, shard: bool,
                    dp_group=None) -> torch.optim.Optimizer:
    """AdamW over `module`'s parameters; with `shard`, ZeRO-1 over `dp_group` (None: every rank)."""
    params = list(module.parameters())
    if not shard:
        return torch.optim.AdamW(params, lr=train.lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return ZeroOptimizer(params, torch.optim.AdamW, process_group=dp_group, lr=train.lr, betas=BETAS,
                         weight_decay=WEIGHT_DECAY)


def state_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: what checkpoints save and optim_bytes counts."""
    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
