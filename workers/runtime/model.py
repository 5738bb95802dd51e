"""The two model families a JobSpec can name: a small causal GPT and a residual MLP.

Both map (B, T) int64 token ids to (B, T, vocab) logits and are trained on next-token cross
entropy (`lm_loss`). The GPT follows nanoGPT: token + learned position embeddings, pre-LN
blocks (causal self-attention through F.scaled_dot_product_attention, then a 4x GELU MLP),
a final LayerNorm and an untied LM head.

Activation recomputation (parallel.recompute full, `build_model(cfg, recompute=True)`): every GPT
Block and every MLP residual layer runs its forward under torch.utils.checkpoint
(use_reentrant=False), so autograd keeps only each block's input and recomputes what is inside
in the backward pass (no dropout or other randomness inside: the recomputation is exact). It is
done inside the block's forward rather than by wrapping the module, so parameter names, the
tensor-parallel plan's FQNs, FSDP's units and the pipeline's stages are the same either way
(FSDP2's hooks run outside the checkpointed region, as with torchtitan's checkpoint_wrapper).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainyard.spec import ModelSpec


class CausalSelfAttention(nn.Module):
    """Separate q, k, v projections (not one fused qkv) so tensor parallelism can split each by
    output columns: a rank then holds whole heads of q, k and v (see sharded.py). Same
    parameter count and init as a fused hidden -> 3 x hidden Linear."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (B, T, C') -> (B, heads', T, head_dim), the layout SDPA expects; under tensor
        # parallelism C' = C / tp and heads' = heads / tp (this rank's heads), else the full model
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2)
                   for z in (self.q(x), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.recompute = False  # parallel.recompute full: keep only the input, recompute the rest

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelSpec):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg.hidden, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.apply(_init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2*layers) so the residual stream's
        # variance does not grow with depth at init.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds model.seq_len={self.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class MLP(nn.Module):
    """Per-position next-token predictor: no attention, so it sees only the current token."""

    def __init__(self, cfg: ModelSpec):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.apply(_init_weights)
        self.recompute = False  # parallel.recompute full: each residual layer recomputed in backward

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        recompute = self.recompute and torch.is_grad_enabled()
        for layer in self.layers:
            x = checkpoint(_residual, layer, x, use_reentrant=False) if recompute else _residual(layer, x)
        return self.head(self.ln_f(x))


def _residual(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x + F.gelu(layer(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(cfg: ModelSpec, *, recompute: bool = False) -> nn.Module:
    """The model `cfg` names; `recompute`: activation checkpointing of every block (module docstring)."""
    model = GPT(cfg) if cfg.kind == "gpt" else MLP(cfg)
    for block in model.blocks if isinstance(model, GPT) else (model,):
        block.recompute = recompute
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; `targets` are the inputs shifted by one position."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
