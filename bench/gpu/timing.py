"""GPU checks for issue 14, finding 7: step-time telemetry on CUDA.

The trainer brackets each phase with CUDA events on the current stream and synchronises once,
at the end of the step (workers/runtime/trainer.py); a sharded strategy's collectives are timed
by parallel.CollectiveMeter with the same events (comm_s). These checks build the built-in
trainer in this process on one GPU (a 1-rank NCCL group), inject delays and read the samples
`train_step` returns:
- timing_delays_land_in_their_fields: fsdp and ddp. Forward sleeps on the host (time.sleep,
  FORWARD_S: the device idles through it, the step starts synchronised) and the optimizer
  enqueues a GPU sleep (torch.cuda._sleep, OPTIM_S): each must land in compute_s / optim_s
  within TOL_S. (A host sleep in the optimizer would be hidden behind the GPU work still queued
  from forward and backward: device time counts a host stall only where the device idled.) Under fsdp the forward also all-reduces (as tensor
  parallelism does) behind a GPU sleep of COLLECTIVE_S, as a late peer would make it wait: in
  the metered steps it must land in comm_s (not compute_s), and the phases must add up to
  step_s; under ddp the gradient bucket's all-reduce is the late collective (step 3: step 2
  still has DDP's bucket rebuild). The samples' allocated, reserved and free memory must be present and consistent.
- fsdp2_one_rank_trains: FSDP2 on one rank, 6 steps: finite, falling loss, comm_s reported. On one
  rank FSDP2 skips its all-gathers and reduce-scatters (torch's _fsdp_param_group.py: world
  size 1), so comm_s is 0 here; the figure is reported, not asserted positive.
- fsdp2_two_ranks_comm_s: two GPUs, torchrun: FSDP2's real all-gathers and reduce-scatters are
  timed: comm_s > 0 in the metered steps, finite loss.

Run by bench/gpu_checks.py (CHECKS: name, minimum GPUs, function returning a dict with "ok").
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FORWARD_S, OPTIM_S, COLLECTIVE_S = 0.05, 0.04, 0.06
TOL_S = 0.015  # data_s, and the phases' sum against step_s
# compute_s and optim_s also hold the tiny model's own work (and, in compute_s, host overhead the
# device idled through): each may exceed its delay by this much, never fall short of it. A
# collective's wait leaking into compute_s would add COLLECTIVE_S, more than the slack.
SLACK_S = {"compute_s": 0.03, "optim_s": 0.02}


def _cycles_per_s() -> float:
    """torch.cuda._sleep spins for a number of GPU clock cycles: measure their rate."""
    import torch

    torch.cuda._sleep(1000)  # warm the kernel up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / (start.elapsed_time(end) / 1000.0)


def _gpu_sleep(seconds: float, rate: float) -> None:
    import torch

    torch.cuda._sleep(int(seconds * rate))


def _late_collectives(rate: float):
    """A dispatch mode: every collective first waits COLLECTIVE_S on the GPU (on the stream the
    collective waits for), as if a peer joined it late."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LateCollectives(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
                self.calls += 1
                _gpu_sleep(COLLECTIVE_S, rate)
            return func(*args, **(kwargs or {}))

    return LateCollectives()


def _trainer(tmp: Path, parallel: dict, device, steps: int = 100, rank: int = 0, world: int = 1):
    import torch

    from tests.workers.runtime.conftest import SMALL_MODEL, make_launch_config
    from trainyard.sdk.reporter import Reporter
    from workers.runtime.config import parse_run_config
    from workers.runtime.data import build_batches
    from workers.runtime.trainer import DistEnv, Trainer, check_world

    cfg = parse_run_config(make_launch_config(
        tmp, "redis://127.0.0.1:9/0", model=SMALL_MODEL, parallel={"dp": world, **parallel},
        resources={"nodes": 1, "procs_per_node": world, "device": "cuda"},
        train={"steps": steps, "global_batch": 4 * world, "lr": 3e-3},
        checkpoint={"every_steps": 1000, "async": False}))
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    mesh = check_world(cfg, env)
    batches, val = build_batches(cfg.data, cfg.model, cfg.launch.data_root, rank=rank,
                                 world_size=world, batch=4, seed=0, pin_memory=True)
    # nothing listens on port 9: the reporter buffers the samples; close() gives up at once
    reporter = Reporter(cfg.launch.redis_url, cfg.launch.stream, rank=rank,
                        attempt=cfg.launch.attempt_id)
    assert torch.device(device).type == "cuda"
    return Trainer(cfg, env, mesh, device, reporter, batches, val), reporter


def _one_rank_group():
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    return device


def _memory_ok(sample: dict) -> tuple[bool, dict]:
    import torch

    m = sample.get("metrics") or {}
    total = torch.cuda.get_device_properties(0).total_memory
    alloc, reserved, free = (m.get(k) for k in ("mem_allocated_bytes", "mem_reserved_bytes",
                                                "mem_free_bytes"))
    figures = {"mem_bytes": sample.get("mem_bytes"), "allocated": alloc, "reserved": reserved,
               "free": free, "total": total}
    if None in (alloc, reserved, free):
        return False, figures
    ok = (0 < alloc <= reserved <= total and 0 < free < total and reserved + free <= total
          and sample["mem_bytes"] >= alloc)
    return ok, figures


def _delays(plan: str, rate: float) -> dict:
    import torch
    import torch.distributed as dist

    device = _one_rank_group()
    fsdp = plan == "fsdp"
    with tempfile.TemporaryDirectory() as tmp:
        trainer, reporter = _trainer(Path(tmp), {"fsdp": fsdp}, device)
        try:
            def forward_hook(*_):
                time.sleep(FORWARD_S)
                if fsdp:  # as tensor parallelism's forward does: a collective, metered
                    dist.all_reduce(torch.ones(4, device=device))

            trainer.model.register_forward_hook(forward_hook)
            trainer.opt.register_step_pre_hook(lambda *_: _gpu_sleep(OPTIM_S, rate))
            samples, late = [], _late_collectives(rate)
            with late:
                for step in range(1, 5):
                    samples.append(trainer.train_step(step))
        finally:
            reporter.close(timeout_s=0.1)
            dist.destroy_process_group()
    # set-up done; fsdp: still a metered step (MeteredStrategy.METERED_STEPS = 2); ddp: past the
    # bucket rebuild of step 2
    checked = 2 if fsdp else 3
    s = samples[checked - 1]
    fields = {k: round(s[k], 4) for k in ("data_s", "compute_s", "comm_s", "optim_s", "step_s")}
    parts = s["data_s"] + s["compute_s"] + s["comm_s"] + s["optim_s"]
    checks = {
        "compute_s": FORWARD_S - 0.002 <= s["compute_s"] <= FORWARD_S + SLACK_S["compute_s"],
        "optim_s": OPTIM_S - 0.002 <= s["optim_s"] <= OPTIM_S + SLACK_S["optim_s"],
        "data_s": s["data_s"] < TOL_S,
        # ddp: the bucket's 1-rank all-reduce, COLLECTIVE_S late; fsdp: the forward's collective
        "comm_s": abs(s["comm_s"] - COLLECTIVE_S) < 0.01,
        "parts_add_up": abs(parts - s["step_s"]) < TOL_S,
    }
    mem_ok, mem = _memory_ok(s)
    checks["memory"] = mem_ok
    return {"ok": all(checks.values()), "checks": checks, "step": checked, "fields": fields, "memory": mem,
            "late_collectives": late.calls,
            "all_steps": [{k: round(x[k], 4) for k in fields} for x in samples]}


def check_delays() -> dict:
    import torch

    rate = _cycles_per_s()
    out = {"cycles_per_s": round(rate), "torch": torch.__version__,
           "expected": {"compute_s": FORWARD_S, "optim_s": OPTIM_S, "comm_s": COLLECTIVE_S}}
    for plan in ("ddp", "fsdp"):
        out[plan] = _delays(plan, rate)
    out["ok"] = out["ddp"]["ok"] and out["fsdp"]["ok"]
    return out


def _train(steps: int, rank: int = 0, world: int = 1) -> list[dict]:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    with tempfile.TemporaryDirectory() as tmp:
        trainer, reporter = _trainer(Path(tmp), {"fsdp": True}, device, steps=steps, rank=rank,
                                     world=world)
        try:
            samples = [trainer.train_step(step) for step in range(1, steps + 1)]
        finally:
            reporter.close(timeout_s=0.1)
            dist.destroy_process_group()
    return [{k: s[k] for k in ("loss", "comm_s", "compute_s", "step_s", "bytes_sent")} for s in samples]


def check_fsdp_one_rank() -> dict:
    _one_rank_group()
    samples = _train(6)
    losses = [s["loss"] for s in samples]
    ok = all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] \
        and all(s["comm_s"] >= 0.0 for s in samples)
    return {"ok": ok, "losses": losses, "comm_s": [s["comm_s"] for s in samples],
            "note": "1 rank: FSDP2 skips its collectives, comm_s 0 is expected"}


def check_fsdp_two_ranks() -> dict:
    """torchrun, 2 ranks on 2 GPUs: FSDP2's collectives timed in the metered steps."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, "--worker", tmp]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,  # torchrun and its workers: one group
                                env={**os.environ, "PYTHONPATH": str(Path.cwd())})
        try:
            _, stderr = proc.communicate(timeout=100)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
        results = {p.name: json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))}
    if proc.returncode != 0 or len(results) != 2:
        return {"ok": False, "rc": proc.returncode, "stderr_tail": stderr[-3000:]}
    ok = all(all(math.isfinite(s["loss"]) for s in r) and r[1]["comm_s"] > 0
             for r in results.values())
    return {"ok": ok, "ranks": {k: [{"loss": round(s["loss"], 4), "comm_s": round(s["comm_s"], 5),
                                     "compute_s": round(s["compute_s"], 4)} for s in r]
                                for k, r in results.items()}}


def _worker(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    samples = _train(4, rank=rank, world=world)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(samples))


CHECKS = [
    ("timing_delays_land_in_their_fields", 1, check_delays),
    ("fsdp2_one_rank_trains", 1, check_fsdp_one_rank),
    ("fsdp2_two_ranks_comm_s", 2, check_fsdp_two_ranks),
]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _worker(sys.argv[2])
