"""Your own model on Trainyard's data plane: a minGPT-style GPT (its own attention, MLP and block
list; nothing of Trainyard's model code) trained with `run.prepare`, `run.loader` and
`run.micro_batches`. The JobSpec (job.yaml) says what plan to run: change comm.compression,
comm.sync, train.grad_accum, parallel.shard_optimizer or parallel.recompute there, not here.

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


class Windows(torch.utils.data.Dataset):
    """Fixed random token windows (input, next tokens)."""

    def __init__(self, n: int = 96, block_size: int = 16, vocab: int = 64):
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
        model = MinGPT()
    # the JobSpec's plan, applied: DDP with its comm hook (compression, local SGD), ZeRO-1, recompute
    model, opt = run.prepare(model, lambda params: torch.optim.AdamW(params, lr=run.config.get("lr", 1e-3)))
    loader = run.loader(Windows(), batch_size=None if run.spec else 8)  # None: train.global_batch / world
    start = run.restore({"model": model, "optim": opt, "data": loader})  # the loader resumes mid-epoch
    for step in range(start + 1, (run.steps or 50) + 1):
        total = 0.0
        for x, y in run.micro_batches(loader):
            loss = model(x, y) / run.grad_accum
            loss.backward()
            total += loss.item()
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
