"""What a rank holds, in bytes: parameters, gradients, optimizer state (local shards: a DTensor
counts its local part) and the activations one micro-batch's forward saves for its backward.

Activations are counted with torch.autograd.graph.saved_tensors_hooks: every tensor autograd
saves during the forward (and the loss) is recorded when it is saved, by its storage, so views
of one storage count once; tensors that are parameters or views of parameters (a Linear saves
its weight, FSDP its all-gathered weight) are not activations and are left out.
"""
from __future__ import annotations

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def grad_bytes(module: nn.Module) -> int:
    return sum(_local(p.grad).numel() * p.grad.element_size()
               for p in module.parameters() if p.grad is not None)


def _is_param(t: torch.Tensor) -> bool:
    base = t
    while base is not None:
        if isinstance(base, nn.Parameter):
            return True
        base = getattr(base, "_base", None)
    return False


class SavedTensors:
    """Context manager: the unique storages autograd saves inside it, parameters excluded."""

    def __init__(self):
        self.storages: dict[int, int] = {}  # data_ptr -> bytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _is_param(t):
            local = _local(t)
            storage = local.untyped_storage()
            if storage.nbytes():
                self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "SavedTensors":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
