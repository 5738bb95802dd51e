"""What the job sandbox (workers/sandbox.py, issue 21) costs: the SDK example (examples/sdk_ddp,
2 gloo ranks on the CPU) started by the real launcher (workers.launcher.Supervisor: procwrap,
torchrun, the ranks) with and without the sandbox, side by side, runs alternating plain, sandbox,
plain, sandbox ... so drift on a shared machine hits both alike.

Per run: start to every rank registered (the agent's `on_ranks`: procwrap, bwrap and setpriv,
torchrun, Python + torch import, the ranks' files), start to the first step's sample in the
stream, and the median step time (`step_s` of every rank after --warmup steps) and samples/s
from the ranks' own telemetry. Prints one JSON object: each side's medians over the pairs and the
ratios sandbox / plain. Needs root (the sandbox) and redis-server. Usage:
    python bench/sandbox.py [--pairs 3] [--steps 200] [--warmup 20]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from overhead import start_redis  # noqa: E402

from workers import sandbox  # noqa: E402
from workers.launcher import LaunchRequest, Supervisor, pick_free_port  # noqa: E402

BATCH = 32  # per rank (examples/sdk_ddp's default)


def one_run(work: Path, i: int, sandboxed: bool, redis_url: str, args) -> dict:
    run_dir = work / f"{'sbx' if sandboxed else 'plain'}-{i}"
    code = work / f"code-{i}-{int(sandboxed)}"
    shutil.copytree(REPO / "examples" / "sdk_ddp", code)
    stream = f"trainyard:job:1:a{i * 2 + int(sandboxed) + 1}"
    attempt = i * 2 + int(sandboxed) + 1
    spec = {"name": "bench-sandbox", "code": {"bundle": "sha256:" + "0" * 64}, "entrypoint": {"script": "train.py"},
            "train": {"steps": args.steps},
            "resources": {"nodes": 1, "procs_per_node": 2, "device": "cpu"}, "checkpoint": {"every_steps": 10**6},
            "config": {"hidden": 128, "batch": BATCH, "step_sleep_s": 0.0}}
    config = {"job_id": 1, "attempt_id": attempt, "node": "bench", "run_dir": str(run_dir), "redis_url": redis_url,
              "stream": stream, "data_root": str(work / "data"), "checkpoint_dir": str(work / "ckpt" / "job-1"),
              "spec": spec, "resume": None}
    req = LaunchRequest(job_id=1, attempt_id=attempt, node="bench", node_rank=0, nnodes=1, nproc=2, slots=(0, 1),
                        device="cpu", rdzv_host="127.0.0.1", rdzv_port=pick_free_port("127.0.0.1"),
                        local_addr="127.0.0.1", config=config, run_dir=str(run_dir), user_code=True,
                        code_dir=str(code), script=str(code / "train.py"))
    plan = None
    if sandboxed:
        mounts = sandbox.Mounts(run_dir=str(run_dir), checkpoint_dir=str(work / "ckpt" / "job-1"),
                                data_root=str(work / "data"), code_dir=str(code),
                                python_prefixes=sandbox.agent_python_prefixes())
        plan = sandbox.SandboxPlan.for_attempt(sandbox.SandboxConfig(), mounts, job_id=1, attempt_id=attempt)
    ranks_at, done = [], threading.Event()
    sup = Supervisor(req, on_ranks=lambda r: ranks_at.append(time.time()), on_log=lambda *a: None,
                     on_exit=lambda result: (done.set(), ranks_at.append(result)), sandbox=plan)
    t0 = time.time()
    assert sup.start()
    if not done.wait(600):
        sup.stop()
        sys.exit(f"run {i} ({'sandbox' if sandboxed else 'plain'}) did not end within 600 s")
    result = ranks_at[-1]
    if result.get("exit_code") != 0:
        sys.exit(f"run {i} failed: {json.dumps(result)[:3000]}")
    samples = [s for _, f in redis.Redis.from_url(redis_url).xrange(stream)
               if f[b"type"] == b"metrics" for s in json.loads(f[b"data"])]
    steady = [s for s in samples if s["step"] > args.warmup]
    step_s = statistics.median(s["step_s"] for s in steady)
    return {"start_to_ranks_s": round(ranks_at[0] - t0, 3),
            "start_to_first_step_s": round(min(s["ts"] for s in samples) - t0, 3),
            "step_s": round(step_s, 5), "samples_per_s": round(2 * BATCH / step_s, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    sandbox.probe(sandbox.SandboxConfig())
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-sandbox-") as tmp:
        work = Path(tmp)
        (work / "data").mkdir()
        proc, redis_url = start_redis(work)
        try:
            runs = {"plain": [], "sandbox": []}
            for i in range(args.pairs):
                for side in ("plain", "sandbox"):
                    runs[side].append(one_run(work, i, side == "sandbox", redis_url, args))
                    print(f"pair {i} {side}: {runs[side][-1]}", file=sys.stderr)
        finally:
            proc.terminate()
    med = {side: {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]} for side, rs in runs.items()}
    print(json.dumps({
        "workload": "examples/sdk_ddp, 2 gloo ranks x 1 thread on the CPU, through workers.launcher.Supervisor",
        "pairs": args.pairs, "steps": args.steps, "plain": med["plain"], "sandbox": med["sandbox"],
        "sandbox_over_plain": {k: round(med["sandbox"][k] / med["plain"][k], 3) for k in med["plain"]},
        "start_added_s": round(med["sandbox"]["start_to_ranks_s"] - med["plain"]["start_to_ranks_s"], 3),
        "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
