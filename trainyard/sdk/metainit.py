"""`run.init_device()`: build a model whose parameters live on the meta device (no memory), so a
model larger than one rank's memory can be built under parallel.fsdp or parallel.tp; run.prepare
shards it and then materialises only this rank's shards (`materialise`).

Only parameters go to meta (as accelerate's init_empty_weights does): buffers (a causal mask, a
rotary table) are computed at construction as usual and put back after the shards are allocated.
Parameters built on meta have no values, so prepare initialises them after sharding: the model's
own `init_weights()` if it defines one (torchtitan's convention; a model whose init goes beyond
each module's default should define it), else every module's `reset_parameters()` (PyTorch's
default init of each layer). Under plain data parallelism (and `parallel: auto`, whose plan is
not known yet) every rank holds the whole model, so init_device is just this rank's device.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside the context is created on the meta device."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def init_context(spec: Any, device: torch.device) -> Any:
    """What `with run.init_device():` enters: meta parameters under fsdp or tp, else `device`."""
    plan = spec.plan if spec is not None and spec.parallel != "auto" else None
    if plan is not None and (plan.fsdp or plan.tp > 1):
        return params_on_meta()
    return device


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def uninitialisable(model: nn.Module) -> list[str]:
    """Modules holding parameters of their own that nothing would initialise after materialising:
    no reset_parameters(), and the model has no init_weights()."""
    if callable(getattr(model, "init_weights", None)):
        return []
    return [f"{name or 'the model'} ({type(m).__name__})" for name, m in model.named_modules()
            if any(True for _ in m.parameters(recurse=False)) and not callable(getattr(m, "reset_parameters", None))]


def save_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers (real: only parameters were built on meta), to restore after to_empty."""
    return {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}


def materialise(model: nn.Module, device: torch.device, buffers: dict[str, torch.Tensor]) -> str:
    """Allocate this rank's shards on `device`, put the buffers back and initialise the parameters;
    returns how they were initialised (for the rank's role)."""
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
        init = getattr(model, "init_weights", None)
        if callable(init):
            init()
            return "the model's init_weights()"
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    return "each module's reset_parameters()"
