"""A training script as a team outside Trainyard writes it: examples/own_model's minGPT-style model
or its Llama-style one (config.arch llama: q_proj ... down_proj), each with its own attention, MLP
and block list and nothing of workers/runtime, and dataset, and the SDK's
prepare / loader / micro_batches lines. config.mode "noprepare" skips prepare (the fail-fast
test); config.resume_check prints the loader's position after restore; config.meta builds the model
through run.init_device; config.slow_rank / slow_s make that rank sleep slow_s per sample of each
micro-batch after its backward (a slower device: the train.balance test)."""
import sys
import time
from pathlib import Path

import torch

import trainyard

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "own_model"))
from train import Windows, build, say  # noqa: E402  (the example's model and data)


def main():
    run = trainyard.init()
    torch.manual_seed(0)
    # config.meta: build through run.init_device (meta parameters under fsdp or tp, initialised after
    # sharding: not the single-process init, which the loss-equality tests compare against)
    with run.init_device() if run.config.get("meta") else run.device:
        model = build(run.config)
    if run.config.get("mode") == "noprepare":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        model, opt = run.prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
    loader = run.loader(Windows(), batch_size=None if run.spec else 8)  # None: train.global_batch / world
    start = run.restore({"model": model, "optim": opt, "data": loader})
    if run.config.get("resume_check"):
        say(f"user rank {run.rank} resumed at {start} consumed {loader.consumed}")
    for step in range(start + 1, (run.steps or 50) + 1):
        total = 0.0
        for x, y in run.micro_batches(loader):
            loss = model(x, y) / run.grad_accum
            loss.backward()
            total += loss.item()
            if run.rank == run.config.get("slow_rank"):
                time.sleep(run.config["slow_s"] * len(x))
        opt.step()
        opt.zero_grad()
        sample = run.log(step, loss=total, samples=loader.batch_size)
        say(f"user rank {run.rank} step {step} loss {total!r} bytes {sample.get('bytes_sent')} "
            f"ratio {sample.get('compression_ratio')} averaged {sample.get('averaged', '-')} "
            f"share {sample.get('share', '-')}")
        if run.should_checkpoint(step):
            run.checkpoint(step, {"model": model, "optim": opt, "data": loader})
    run.finish()


if __name__ == "__main__":
    main()
