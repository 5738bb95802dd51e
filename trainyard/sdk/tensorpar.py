"""Tensor parallelism for a user's own model (`run.prepare` under parallel.tp > 1): Megatron-style,
with torch.distributed.tensor.parallel over the "tp" dimension of a ("dp", "tp") mesh (tp
innermost, as trainyard.mesh.Mesh orders ranks), as workers/runtime/sharded.py does for the
built-in GPT.

The plan is keyed by module-name patterns (fnmatch on the module's full name): the Linear layers
that open a pair are split by output columns (ColwiseParallel: q, k, v, an MLP's up/gate), the
ones that close it by input rows (RowwiseParallel: attention output, an MLP's down), so each tp
rank computes heads/tp whole heads and 1/tp of the MLP's columns, with one all-reduce after each
row-parallel Linear. DEFAULT_TP_PLAN holds the common names (Llama's q_proj ... down_proj,
GPT-2's c_fc/c_proj, BERT's query/key/value/dense, Meta's wq ... w3); `prepare(model, ...,
tp_plan={pattern: "colwise" | "rowwise"})` replaces it. Everything else (embeddings, norms, the
output head) stays replicated: the backward all-reduces the gradient of every block input, so
those gradients come out identical on every tp rank.

The attention must shape its heads from what a rank holds: `view(B, T, -1, head_dim)` as Llama
and most Hugging Face models do, or from a head-count attribute on the module that owns q, k and
v (n_head, num_heads, n_kv_heads, ...), which prepare divides by tp. Refused at prepare with the
module named (a ConfigError: the job fails as a user error, no restart): a fused
nn.MultiheadAttention or fused q/k/v Linear (c_attn, qkv, query_key_value, in_proj), a head count
or a Linear width tp does not divide, a block with column-split layers and no row-split one, a
tp_plan pattern that matches no module.

dp x tp: after the last micro-batch every gradient (its local shard) is averaged over the dp
group in one flat all-reduce before the optimizer's step (what DDP does, without its overlap);
those bytes are metered, the tp collectives inside forward and backward are not (compute_s
holds them). Checkpoints: the parameters are DTensors under their plain names, so DCP reshards
on load: a tp checkpoint resumes under dp or fsdp and back.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from trainyard.mesh import Mesh

from .config import ConfigError

STYLES = ("colwise", "rowwise")
DEFAULT_TP_PLAN: dict[str, str] = {
    **{f"*.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_fc",
                                      "query", "key", "value", "intermediate.dense", "wq", "wk", "wv", "w1", "w3")},
    **{f"*.{n}": "rowwise" for n in ("o_proj", "down_proj", "c_proj", "output.dense", "wo", "w2")},
}
FUSED_QKV = ("c_attn", "qkv", "qkv_proj", "Wqkv", "query_key_value", "in_proj")
HEAD_COUNTS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "heads",
               "n_kv_heads", "n_kv_head", "num_key_value_heads", "num_kv_heads")


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _check_user_plan(model: nn.Module, plan: dict) -> None:
    names = [n for n, _ in model.named_modules()]
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"run.prepare: tp_plan[{pattern!r}] is {style!r}; a style is one of {', '.join(STYLES)}")
        if not any(fnmatchcase(n, pattern) for n in names):
            raise ConfigError(f"run.prepare: tp_plan pattern {pattern!r} matches no module of the model "
                              f"(patterns match full names such as {names[-1]!r})")


def _refuse_fused(model: nn.Module, styles: dict[str, str]) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            raise ConfigError(f"run.prepare: parallel.tp cannot split {name!r}, a fused nn.MultiheadAttention "
                              f"(q, k and v in one in_proj weight): write the attention with separate q_proj, "
                              f"k_proj, v_proj and o_proj Linear layers, or use parallel.fsdp or dp")
        if (isinstance(module, nn.Linear) and name.rpartition(".")[2] in FUSED_QKV and name not in styles
                and any(_parent(s) == _parent(name) for s in styles)):
            raise ConfigError(f"run.prepare: parallel.tp cannot split {name!r}: it computes q, k and v in one "
                              f"Linear ({module.in_features} -> {module.out_features}), whose columns are not "
                              f"whole heads; split it into q, k and v Linear layers, or give a tp_plan that "
                              f"leaves this attention replicated, or use parallel.fsdp or dp")


def plan_styles(model: nn.Module, tp: int, blocks: list[str], user_plan: dict | None = None) -> dict[str, str]:
    """Module full name -> "colwise" | "rowwise" for `model` under `tp` (see the module docstring);
    `blocks` are the full names of the model's repeated blocks (the default plan splits only
    inside them). Raises ConfigError naming the module tp cannot split."""
    if user_plan is not None:
        _check_user_plan(model, user_plan)
    plan = user_plan if user_plan is not None else DEFAULT_TP_PLAN
    styles = {}
    for name, module in model.named_modules():
        inside = user_plan is not None or any(name.startswith(b + ".") for b in blocks)
        style = next((s for p, s in plan.items() if fnmatchcase(name, p)), None)
        if style is not None and inside and isinstance(module, (nn.Linear, nn.Embedding)):
            styles[name] = style
    _refuse_fused(model, styles)
    if not styles:
        raise ConfigError(f"run.prepare: parallel.tp {tp} found no Linear layer to split (the default plan "
                          f"knows q_proj/k_proj/v_proj/o_proj/gate_proj/up_proj/down_proj, c_fc/c_proj, "
                          f"query/key/value/dense, wq/wk/wv/wo/w1/w2/w3 inside the blocks): pass "
                          f"prepare(..., tp_plan={{'layers.*.attn.q': 'colwise', ...}})")
    _check_divisible(model, styles, tp)
    for block in blocks:
        mine = {s for n, s in styles.items() if n.startswith(block + ".")}
        if mine == {"colwise"}:
            raise ConfigError(f"run.prepare: parallel.tp splits layers of {block!r} by columns but none by rows, "
                              f"so their outputs would stay split: add the closing projection to tp_plan as rowwise")
    return styles


def _check_divisible(model: nn.Module, styles: dict[str, str], tp: int) -> None:
    for name, style in styles.items():
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear):
            width = module.out_features if style == "colwise" else module.in_features
            what = "output features" if style == "colwise" else "input features"
        else:
            width, what = (module.embedding_dim, "embedding width") if style == "colwise" else \
                (module.num_embeddings, "rows")
        if width % tp:
            raise ConfigError(f"run.prepare: parallel.tp {tp} does not divide the {width} {what} of {name!r} "
                              f"({style}): use a tp that divides it")
    for owner in sorted({_parent(n) for n, s in styles.items() if s == "colwise"}):
        module = model.get_submodule(owner)
        for attr in HEAD_COUNTS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % tp:
                raise ConfigError(f"run.prepare: parallel.tp {tp} does not divide {owner or 'the model'}.{attr} = "
                                  f"{value}: each tensor-parallel rank computes whole heads; use a tp that divides it")


def localise_heads(model: nn.Module, styles: dict[str, str], tp: int) -> list[str]:
    """Divide the head counts of the modules that own column-split layers by tp (each rank holds
    heads/tp of them); returns the attributes changed, as "module.attr"."""
    changed = []
    for owner in sorted({_parent(n) for n, s in styles.items() if s == "colwise"}):
        module = model.get_submodule(owner)
        for attr in HEAD_COUNTS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attr, value // tp)
                changed.append(f"{owner}.{attr}")
    return changed


class TensorParallel:
    """The tp (or dp x tp) plan applied to `model` in place; see the module docstring."""

    def __init__(self, model: nn.Module, mesh: Mesh, device: torch.device, *, blocks: list[str],
                 user_plan: dict | None = None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from .groups import track_group

        self.mesh = mesh
        self.styles = plan_styles(model, mesh.tp, blocks, user_plan)
        self.heads = localise_heads(model, self.styles, mesh.tp)
        self.device_mesh = init_device_mesh(device.type, (mesh.dp, mesh.tp), mesh_dim_names=("dp", "tp"))
        for dim in ("dp", "tp"):  # the run's collective timeout from the first step
            track_group(self.device_mesh.get_group(dim))
        self.dp_group = self.device_mesh["dp"].get_group() if mesh.dp > 1 else None
        kinds = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, self.device_mesh["tp"], {n: kinds[s]() for n, s in self.styles.items()})
        self.module = model

    @torch.no_grad()
    def average_over_dp(self, counter: Any) -> None:
        """One flat all-reduce of every local gradient shard over the dp group, then / dp; counted
        and timed on `counter` as a blocking collective."""
        if self.dp_group is None:
            return
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        start = counter.clock.mark()
        flat = _flatten_dense_tensors(grads)
        counter.count(flat)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.mesh.dp
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
        counter.blocking.append((start, counter.clock.mark(), True))

    def role(self, rank: int, heads: int | None) -> str:
        c, tp = self.mesh.coords(rank), self.mesh.tp
        t = c["tp"]
        kinds = {s: sorted({n.rpartition(".")[2] for n, v in self.styles.items() if v == s}) for s in STYLES}
        role = (f"tp rank {t} of {tp}: 1/{tp} of {len(self.styles)} layers (by columns: "
                f"{', '.join(kinds['colwise']) or '-'}; by rows: {', '.join(kinds['rowwise']) or '-'})")
        if heads and heads % tp == 0:
            per = heads // tp
            role += f", heads {t * per}-{(t + 1) * per - 1} of {heads}"
        return role if self.mesh.dp == 1 else f"replica {c['dp']} of {self.mesh.dp}, {role}"
