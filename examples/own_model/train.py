"""Your own model on Trainyard's data plane: a minGPT-style GPT, or with config.arch "llama" a
Llama-style one (q_proj ... down_proj, RMSNorm, SwiGLU, grouped-query attention), each with its
own attention, MLP and block list and nothing of Trainyard's model code, trained with
`run.prepare`, `run.loader` and `run.micro_batches`. The JobSpec says what plan to run (job.yaml:
top-k compression and grad_accum; job-tp.yaml: tensor parallelism of the Llama-style model):
change comm, train.grad_accum or parallel there, not here.

    trainyard submit examples/own_model/job.yaml --code examples/own_model --watch
    torchrun --nproc-per-node 2 train.py      # or standalone: plain DDP, no telemetry
"""
import math
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

import trainyard


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MinGPT(nn.Module):
    def __init__(self, vocab: int = 64, block_size: int = 16, n_layer: int = 2, n_head: int = 2, n_embd: int = 32):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def reset_parameters(self):  # what run.prepare calls after building on the meta device
        nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape  # heads shaped by head_dim (-1): the layout tensor parallelism splits
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        groups = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim), RMSNorm(dim)
        self.self_attn, self.mlp = LlamaAttention(dim, n_heads, n_kv_heads), LlamaMLP(dim, 4 * dim)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int = 64, n_layer: int = 2, n_heads: int = 4, n_kv_heads: int = 2, dim: int = 32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([LlamaBlock(dim, n_heads, n_kv_heads) for _ in range(n_layer)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(config: dict) -> nn.Module:
    """The model config.arch names: "mingpt" (the default) or "llama"."""
    arch = config.get("arch", "mingpt")
    if arch not in ("mingpt", "llama"):
        raise ValueError(f"config.arch is {arch!r}: use mingpt or llama")
    return Llama(dim=config.get("width", 32)) if arch == "llama" else MinGPT()


class Windows(torch.utils.data.Dataset):
    """Fixed random token windows (input, next tokens)."""

    BLOCK = 16

    def __init__(self, n: int = 96, block_size: int = BLOCK, vocab: int = 64):
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, vocab, (n, block_size + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: the ranks share the pipe
    sys.stdout.flush()


def main():
    run = trainyard.init()
    torch.manual_seed(0)
    with run.init_device():
        model = build(run.config)
    # the JobSpec's plan, applied: DDP with its comm hook (compression, local SGD), ZeRO-1, recompute,
    # FSDP, or tensor parallelism (by the module names: q_proj ... down_proj)
    # seq_len: the tokens per sample, which parallel auto plans the model with
    model, opt = run.prepare(model, lambda params: torch.optim.AdamW(params, lr=run.config.get("lr", 1e-3)),
                             seq_len=Windows.BLOCK)
    loader = run.loader(Windows(), batch_size=None if run.spec else 8)  # None: train.global_batch / world
    start = run.restore({"model": model, "optim": opt, "data": loader})  # the loader resumes mid-epoch
    for step in range(start + 1, (run.steps or 50) + 1):
        total = 0.0
        for x, y in run.micro_batches(loader):
            loss = model(x, y) / run.grad_accum
            loss.backward()
            total += loss.item()
            if run.rank == run.config.get("slow_rank"):  # a slower device, to watch train.balance at work
                time.sleep(run.config.get("slow_s", 0.01) * len(x))
        opt.step()
        opt.zero_grad()
        time.sleep(run.config.get("step_sleep_s", 0))  # to watch it on the job page
        sample = run.log(step, loss=total, samples=loader.batch_size)
        say(f"rank {run.rank} step {step} loss {total!r} bytes {sample.get('bytes_sent')} "
            f"ratio {sample.get('compression_ratio')} averaged {sample.get('averaged', '-')}")
        if run.should_checkpoint(step):
            run.checkpoint(step, {"model": model, "optim": opt, "data": loader})
        if run.should_stop():
            break
    run.finish()


if __name__ == "__main__":
    main()
