"""The Strategy for a mesh (torchtitan's `parallelize_*`): DDP for plain data parallelism, the
sharded strategy for FSDP and tensor parallelism, the pipeline for pp.

Its own module so that parallel.py (DDP and what every strategy shares), sharded.py and
pipeline.py import only downward: each of them imports parallel, this imports all three.
The JobSpec (trainyard/spec.py `unsupported_options`) already refused the combinations none of
them runs (compression or local SGD outside plain DDP, tp x pp, fsdp x tp, ...), so this only
dispatches on the mesh.
"""
from __future__ import annotations

import torch
from torch import nn

from trainyard.mesh import Mesh

from .parallel import DDPStrategy, MeteredStrategy
from .sharded import ShardedStrategy


def build_strategy(mesh: Mesh, rank: int, model: nn.Module, device: torch.device, *,
                   vocab: int, heads: int, hidden: int, microbatches: int, schedule: str,
                   hook_state=None, hook=None, counter=None):
    """The Strategy for `mesh`; `model` is the full model, built with the job seed on every rank.
    `hook_state`/`hook`: DDP's comm hook (sync.py); `counter` (comm.CommCounter) receives the
    bytes of the other strategies' collectives. vocab, heads, hidden: the model's shape (the
    sharded strategy's role text); microbatches, schedule: the pipeline's (parallel.*)."""
    if mesh.pp > 1:  # pp, or dp x pp
        # Imported here: torch.distributed.pipelining pulls in torch._dynamo (~0.6 s of a start, and
        # of every restart, that a job without pp does not need).
        from .pipeline import PipelineStrategy

        return MeteredStrategy(PipelineStrategy(model, mesh, rank, device, hidden=hidden,
                                                microbatches=microbatches, schedule=schedule),
                               counter)
    if mesh.tp > 1 or mesh.fsdp:  # tp, dp x tp, or fsdp
        return MeteredStrategy(ShardedStrategy(model, mesh, rank, device, vocab=vocab, heads=heads,
                                               hidden=hidden), counter)
    return DDPStrategy(model, mesh, rank, device, hook_state, hook)
