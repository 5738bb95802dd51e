"""GPU checks for issue 14's findings 1, 2, 3, 8 and 9 (fixed with CPU tests; these run the same
mechanisms on CUDA/NCCL), plus versions and the 2-GPU data-plane runs.

- versions: torch, CUDA, NCCL, driver, the devices.
- future_order (1): a 1-rank NCCL all-gather into a sentinel-filled buffer, read through each
  kind of future: the work's own future (carries the device) and an explicit wait() must never
  show the sentinel; collect_all's (no device) is reported, it may.
- compression_ratio1 (1): DDP on one GPU with every compression at its lossless setting
  (topk ratio 1.0, powersgd at full rank) trains like none (fp16/bf16 within rounding).
- pinned_batch (8): a pinned WindowBatch is one contiguous page-locked block, and its
  host-to-device copy is a pinned memcpy (the profiler's memcpy kind), not pageable.
- oom_diagnosis, device_assert_diagnosis (3): a real CUDA OOM and a device-side assert under
  torchrun, read as the agent reads them, are classed oom (not retried) and user_error.
- abort_nccl (2, 2 GPUs): a rank that raises while its peer waits in an NCCL collective ends the
  run within 30 s with its error file (destroy would block on NCCL).
- topk_nccl_vs_gloo (1, 2 GPUs): top-k at 0.01 on NCCL trains like on gloo.
- tp_pp_cuda (9, 2 GPUs): tp=2 and pp=2 train on CUDA; under tp the replicated parameters end
  bitwise equal on both ranks (the run's val loss is equal on both).
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time

from bench.gpu.common import need_cuda, redis_server, run_training, torchrun, workdir


def versions() -> dict:
    import torch
    out = {"ok": True, "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = q.stdout.strip().splitlines()
    return out


def future_order() -> dict:
    need_cuda()
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), device_id=torch.device("cuda", 0))
    n, trials, sentinel = 64 * 2 ** 20, 20, -7.0
    inp = torch.ones(n, device="cuda")
    seen = {}
    for mode in ("work_future", "wait", "collect_all"):
        hits = 0
        for _ in range(trials):
            out = torch.full((n,), sentinel, device="cuda")
            torch.cuda._sleep(2_000_000)  # the collective queues behind this on the NCCL stream
            work = dist.all_gather_into_tensor(out, inp, async_op=True)
            if mode == "work_future":
                got = work.get_future().then(lambda _f, o=out: o.min().item()).wait()
            elif mode == "wait":
                work.wait()
                got = out.min().item()
            else:
                got = torch.futures.collect_all([work.get_future()]).then(lambda _f, o=out: o.min().item()).wait()
            hits += got == sentinel
        torch.cuda.synchronize()
        seen[mode] = hits
    dist.destroy_process_group()
    return {"ok": seen["work_future"] == 0 and seen["wait"] == 0, "sentinel_reads_of": trials,
            "sentinel_reads": seen, "note": "collect_all carries no device: it may read early (informative)"}


def compression_ratio1() -> dict:
    runs, ratios = {}, {}  # ratios: dense / sent bytes, to show each compression really ran
    settings = {"none": {}, "fp16": {"compression": "fp16"}, "bf16": {"compression": "bf16"},
                "topk": {"compression": "topk", "ratio": 1.0}, "powersgd": {"compression": "powersgd", "rank": 64}}
    with workdir() as d, redis_server(d) as url:
        for i, (name, comm) in enumerate(settings.items()):
            r = run_training(d, url, name, nproc=1, job_id=i + 1, train={"steps": 20, "global_batch": 8},
                             comm={"start_step": 2, **comm}, checkpoint={"every_steps": 1000, "async": True, "keep": 1})
            if r["rc"] != 0:
                return {"ok": False, "error": f"{name} exited {r['rc']}", "tail": r["tail"]}
            runs[name] = [s["loss"] for (_r, _s), s in sorted(r["samples"].items())]
            later = [s.get("compression_ratio") or 1.0 for (_r, step), s in r["samples"].items() if step > 2]
            ratios[name] = round(sum(later) / max(1, len(later)), 3)
    base = runs["none"]
    diff = {k: max(abs(a - b) / abs(b) for a, b in zip(v, base)) for k, v in runs.items() if k != "none"}
    tol = {"topk": 1e-4, "powersgd": 1e-2, "fp16": 2e-2, "bf16": 5e-2}
    # PowerSGD at full rank saves nothing, so torch's hook all-reduces those matrices dense
    active = all(ratios[k] != 1.0 for k in diff if k != "powersgd")
    return {"ok": all(len(v) == len(base) == 20 for v in runs.values()) and all(diff[k] <= tol[k] for k in diff)
            and active, "compression_ratio": ratios, "max_rel_loss_diff_vs_none": diff, "tolerance": tol, "final_loss": {k: v[-1] for k, v in runs.items()}}


def pinned_batch() -> dict:
    need_cuda()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from workers.runtime.data import WindowBatch, pin_batch, to_device
    window = torch.randint(0, 256, (64, 2049))
    batch = pin_batch(WindowBatch(window))
    x, y = batch
    contiguous_pinned = batch.window.is_pinned() and batch.window.is_contiguous()
    views = x.data_ptr() == batch.window.data_ptr() and y.data_ptr() == batch.window.data_ptr() + x.element_size()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        xd, yd = to_device(batch, "cuda")
        torch.cuda.synchronize()
    kinds = sorted({e.name for e in prof.events() if "Memcpy" in e.name})
    exact = torch.equal(xd.cpu(), x) and torch.equal(yd.cpu(), y)
    return {"ok": contiguous_pinned and views and exact and any("Pinned" in k for k in kinds)
            and not any("Pageable" in k for k in kinds), "window_pinned_contiguous": contiguous_pinned,
            "x_y_view_the_window": views, "memcpy_kinds": kinds, "exact": exact}


def _diagnose_case(case: str) -> dict:
    need_cuda()
    from jobs.attempts.policy.diagnosis import diagnose
    from workers.launcher_logs import read_error_file, tail_lines
    with workdir() as d:
        logs = d / "logs"
        proc = torchrun("bench.gpu.fail_case", [case], nproc=1, cwd=d, log_dir=logs, timeout_s=90)
        rank_dir = next(logs.glob("*/attempt_0/0"), None)
        if rank_dir is None:
            return {"ok": False, "error": "no rank log dir", "tail": (proc.stdout + proc.stderr)[-2000:]}
        err = read_error_file(str(rank_dir / "error.json"))
        failure = {"rank": 0, **(err or {"signal": "SIGABRT", "message": "", "timestamp": time.time()})}
        report = {"node": "gpu", "exit_code": proc.returncode, "failures": [failure],
                  "log_tail": {"0": tail_lines(str(rank_dir / "stderr.log"), 60)}}
        diag = diagnose([report])
    return {"rc": proc.returncode, "error_file": err is not None, "class": diag.failure_class,
            "retry": diag.retry, "message": diag.message[:300]}


def oom_diagnosis() -> dict:
    r = _diagnose_case("oom")
    return {"ok": r["rc"] != 0 and r["class"] == "oom" and not r["retry"], **r}


def device_assert_diagnosis() -> dict:
    r = _diagnose_case("assert")
    return {"ok": r["rc"] != 0 and r["class"] == "user_error" and not r["retry"], **r}


def abort_nccl() -> dict:
    need_cuda()
    from workers.runtime import chaos as chaos_mod
    with workdir() as d, redis_server(d) as url:
        chaos = d / "chaos"
        chaos.mkdir()
        (chaos / "job-1.json").write_text(json.dumps({"raise_at_step": 3, "raise_rank": 1}))
        start = time.monotonic()
        try:
            r = run_training(d, url, "abort", nproc=2, train={"steps": 10_000, "global_batch": 16},
                             extra_env={chaos_mod.ENV: str(chaos)}, timeout_s=90)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": "the run hung after rank 1 raised (over 90 s)"}
        wall = time.monotonic() - start
    raised = "chaos: raising" in r["tail"]
    return {"ok": r["rc"] != 0 and raised and wall < 60 and "ChaosError" in r["tail"], "rc": r["rc"],
            "wall_s": round(wall, 1), "raised": raised}


def topk_nccl_vs_gloo() -> dict:
    need_cuda()
    import os
    out = {}
    with workdir() as d, redis_server(d) as url:
        for i, dev in enumerate(("cuda", "cpu")):
            os.environ["GPU_CHECKS_DEVICE"] = dev
            r = run_training(d, url, dev, nproc=2, job_id=i + 1, train={"steps": 40, "global_batch": 16},
                             comm={"start_step": 2, "compression": "topk", "ratio": 0.01})
            if r["rc"] != 0:
                return {"ok": False, "error": f"{dev} exited {r['rc']}", "tail": r["tail"]}
            out[dev] = [s["loss"] for (rank, _s), s in sorted(r["samples"].items()) if rank == 0]
    os.environ["GPU_CHECKS_DEVICE"] = "cuda"
    late = lambda v: sum(v[-10:]) / 10  # noqa: E731
    rel = abs(late(out["cuda"]) - late(out["cpu"])) / late(out["cpu"])
    return {"ok": all(math.isfinite(v) for v in out["cuda"]) and rel < 0.05 and late(out["cuda"]) < out["cuda"][0],
            "mean_loss_last10": {k: late(v) for k, v in out.items()}, "rel_diff": rel}


def tp_pp_cuda() -> dict:
    out = {}
    with workdir() as d, redis_server(d) as url:
        for i, (name, par) in enumerate({"tp": {"dp": 1, "tp": 2, "pp": 1}, "pp": {"dp": 1, "tp": 1, "pp": 2}}.items()):
            r = run_training(d, url, name, nproc=2, job_id=i + 1, train={"steps": 20, "global_batch": 16},
                             parallel={**par, "fsdp": False, "microbatches": 4, "schedule": "1f1b"})
            val = sorted({line.split()[8] for line in r["finished"]})
            out[name] = {"rc": r["rc"], "val_loss_by_rank": val, "tail": r["tail"][-600:] if r["rc"] else ""}
    tp_equal = len(out["tp"]["val_loss_by_rank"]) == 1
    return {"ok": out["tp"]["rc"] == 0 and out["pp"]["rc"] == 0 and tp_equal, "tp_replicas_equal": tp_equal, **out}


CHECKS = [
    ("versions", 0, versions),
    ("future_order", 1, future_order),
    ("compression_ratio1", 1, compression_ratio1),
    ("pinned_batch", 1, pinned_batch),
    ("oom_diagnosis", 1, oom_diagnosis),
    ("device_assert_diagnosis", 1, device_assert_diagnosis),
    ("abort_nccl", 2, abort_nccl),
    ("topk_nccl_vs_gloo", 2, topk_nccl_vs_gloo),
    ("tp_pp_cuda", 2, tp_pp_cuda),
]
