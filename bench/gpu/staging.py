"""GPU checks for async checkpoint staging (issue 14, finding 6): trainyard/sdk/staging.py.

- staging_one_gpu (1 GPU): one rank on the last GPU (so on a multi-GPU host "device 0" would
  be wrong) trains a ~100 MB model (weights + AdamW moments) and makes three async saves, each
  overlapped with the next step's forward and backward as the trainer runs it; each checkpoint
  reloads into a fresh model bit for bit, and the CUDA (and CPU) RNG draws after each load equal
  those after its save. Reported: pinned and staged bytes against the state's, the stager's
  current CUDA device on the save thread (must be the rank's), the blocking seconds per save,
  and which devices hold a primary CUDA context in this process (only the rank's).
- staging_two_ranks (2 GPUs): torchrun with 2 ranks, DDP over NCCL, three async saves. Each rank
  reports the bytes it staged and pinned (about half of the replicated state, not all of it) and
  which devices hold a primary context in its process (the CUDA driver's
  cuDevicePrimaryCtxGetState, immune to PID namespaces); the check also reads
  `nvidia-smi --query-compute-apps` while the ranks wait, and requires that no rank's pid shows
  on the other rank's GPU.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _active_contexts() -> list[int]:
    """Devices on which this process holds an active primary context (CUDA driver API)."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuInit(0)
    count = ctypes.c_int()
    lib.cuDeviceGetCount(ctypes.byref(count))
    active = []
    for i in range(count.value):
        dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        lib.cuDeviceGet(ctypes.byref(dev), i)
        lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on))
        if on.value:
            active.append(i)
    return active


class _Events:
    def __init__(self):
        self.events = []

    def event(self, kind, **fields):
        self.events.append((kind, fields))


def _model(device, seed):
    import torch
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(8)]  # 8.4 M params: ~100 MB with AdamW
    return torch.nn.Sequential(*layers).to(device)


def _step(model, opt, device):
    import torch
    model(torch.randn(64, 1024, device=device)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt):
    osd = opt.state_dict()
    return ([v.detach().cpu().clone() for v in model.state_dict().values()],
            [v.detach().cpu().clone() for st in osd["state"].values() for v in st.values()])


def _equal(a, b):
    import torch
    return all(len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)) for x, y in zip(a, b))


def _draws(device):
    import torch
    return [torch.rand(4, device=device).cpu().tolist(), torch.rand(2).tolist()]


def _record_stager_device(saver, seen: list) -> None:
    """Wrap this Checkpointer's stager to note the current CUDA device on the thread staging."""
    import torch
    stage = saver._stager.stage

    def recording(flat):
        seen.append(torch.cuda.current_device())
        return stage(flat)

    saver._stager.stage = recording


def _three_saves(saver, model, opt, device, work: Path, rank: int) -> dict:
    """Three async saves overlapped with the next step; reloads; the figures both checks report."""
    import torch
    saved, pinned = [], []
    for step in (1, 2, 3):
        _step(model, opt, device)
        at_save = _snapshot(model, opt)
        saver.save(step, model.module if hasattr(model, "module") else model, opt)
        draws = _draws(device)
        model(torch.randn(64, 1024, device=device)).pow(2).mean().backward()  # overlaps the copy
        saver.wait_for_staging()
        opt.step()
        opt.zero_grad()
        saved.append((step, at_save, draws))
        pinned.append(saver._stager.pinned_bytes)
    staged = saver._stager.staged_bytes
    saver.close()
    exact, rng = [], []
    for step, at_save, draws in saved:
        fresh = _model(device, 100 + step)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        _step(fresh, fresh_opt, device)
        resumed = saver.load(work / "ckpt" / f"step-{step:08d}-a1", fresh, fresh_opt, seed=0)
        exact.append(resumed.step == step and _equal(_snapshot(fresh, fresh_opt), at_save))
        rng.append(resumed.rng_restored and _draws(device) == draws)
    state = sum(t.numel() * t.element_size() for part in _snapshot(model, opt) for t in part)
    return {"rank": rank, "state_bytes": state, "staged_bytes": staged, "pinned_bytes": pinned,
            "pin_limit_bytes": saver._stager.pin_limit_bytes, "exact": exact, "rng": rng,
            "contexts": _active_contexts()}


def one_gpu() -> dict:
    import torch
    import torch.distributed as dist

    from trainyard.sdk import checkpoint as ck
    from trainyard.spec import CheckpointSpec
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seen: list = []
    with tempfile.TemporaryDirectory(prefix="staging-check-") as tmp:
        work = Path(tmp)
        events = _Events()
        saver = ck.Checkpointer(CheckpointSpec(every_steps=1), work / "ckpt", job_id=1, attempt_id=1,
                                rank=0, world_size=1, device=device, reporter=events)
        _record_stager_device(saver, seen)
        model = _model(device, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = _three_saves(saver, model, opt, device, work, 0)
    dist.destroy_process_group()
    out.update(device=device.index, stager_thread_devices=seen, thread=threading.current_thread().name,
               blocking_s=[f["blocking_s"] for _, f in events.events])
    out["ok"] = (out["exact"] == [True] * 3 and out["rng"] == [True] * 3 and seen == [device.index] * 3
                 and 0 < out["pinned_bytes"][-1] <= out["staged_bytes"] and out["contexts"] == [device.index])
    return out


def _worker(out_dir: Path) -> None:
    """One torchrun rank of staging_two_ranks."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainyard.sdk import checkpoint as ck
    from trainyard.spec import CheckpointSpec
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    saver = ck.Checkpointer(CheckpointSpec(every_steps=1), out_dir / "ckpt", job_id=1, attempt_id=1,
                            rank=rank, world_size=dist.get_world_size(), device=device, reporter=_Events())
    model = _model(device, 0)
    ddp = DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = _three_saves(saver, ddp, opt, device, out_dir, rank)
    result["pid"] = os.getpid()
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(result))
    deadline = time.monotonic() + 60  # hold the contexts while the check reads nvidia-smi
    while not (out_dir / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    dist.destroy_process_group()


def _smi(*query: str) -> list[list[str]]:
    done = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=30)
    return [[c.strip() for c in line.split(",")] for line in done.stdout.splitlines() if line.strip()]


def _wait_ready(proc, out_dir: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if all((out_dir / f"rank-{r}.json").exists() for r in range(2)):
            return True
        time.sleep(0.5)
    return False


def two_ranks() -> dict:
    with tempfile.TemporaryDirectory(prefix="staging-check-") as tmp:
        out_dir = Path(tmp)
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(Path(__file__).resolve()), "--worker", str(out_dir)]
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        try:
            ready = _wait_ready(proc, out_dir, 90)
            uuids = {u: int(i) for i, u in _smi("--query-gpu=index,uuid")} if ready else {}
            apps = _smi("--query-compute-apps=pid,gpu_uuid") if ready else []
            (out_dir / "go").touch()
            output, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if not ready:
            return {"ok": False, "error": "ranks did not report", "output": output[-3000:]}
        ranks = [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        r["smi_devices"] = sorted({uuids.get(u) for p, u in apps if p == str(r["pid"])}, key=str)
    share_ok = all(0.3 * r["state_bytes"] < r["staged_bytes"] < 0.7 * r["state_bytes"]
                   and 0 < r["pinned_bytes"][-1] <= r["staged_bytes"] for r in ranks)
    own_ctx = all(r["contexts"] == [r["rank"]] for r in ranks)
    smi_ok = all(r["smi_devices"] in ([], [r["rank"]]) for r in ranks)  # [] where pids are namespaced
    exact = all(r["exact"] == [True] * 3 and r["rng"] == [True] * 3 for r in ranks)
    return {"ok": share_ok and own_ctx and smi_ok and exact and proc.returncode == 0, "ranks": ranks,
            "share_ok": share_ok, "own_context_only": own_ctx, "smi_ok": smi_ok, "exact": exact,
            "smi_saw_pids": any(r["smi_devices"] for r in ranks), "returncode": proc.returncode}


CHECKS = [("staging_one_gpu", 1, one_gpu), ("staging_two_ranks", 2, two_ranks)]

if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(Path(sys.argv[2]))
