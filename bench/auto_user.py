"""`parallel: auto` for a user's own model: the planner's pick against every other feasible plan,
each measured, side by side in one run (the regret of the pick).

The model is examples/own_model/train.py's Llama-style model (config.arch llama, q_proj ...
down_proj, so tp can split it) at --width, 2 gloo ranks on the CPU under `torchrun
--standalone`, one thread per rank. The plans are what run.prepare's parallel auto searches
(trainyard/sdk/autoplan.py, with the default CPU constants: no calibration here): every feasible
one is run as a concrete JobSpec through run.prepare, telemetry into a redis-server started here;
its time is rank 0's median step_s after --warmup. The auto run itself (parallel: auto) is run
too, to show it picks and applies the same plan.

regret = measured step time of the pick / the fastest measured plan's - 1 (0: the pick was best);
rank_of_pick: 1 = fastest measured. Spearman's rho of predicted against measured over all plans.

Prints one JSON object. Usage:
    python bench/auto_user.py [--steps 40] [--warmup 10] [--width 64] [--max-plans 24]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import REPO, start_redis  # noqa: E402  (bench/ helpers)

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples" / "own_model"))
from train import Llama  # noqa: E402

from trainyard.plan.calibration import spearman  # noqa: E402
from trainyard.plan.choice import label  # noqa: E402
from trainyard.plan.job import spec_parallel  # noqa: E402
from trainyard.sdk.autoplan import plan_user_model, request  # noqa: E402
from trainyard.sdk.prepare import describe, find_blocks  # noqa: E402
from trainyard.spec import parse_job_spec  # noqa: E402

WORLD, BATCH, SEQ = 2, 16, 16
TRAIN = REPO / "examples" / "own_model" / "train.py"


def spec_json(steps: int, width: int, parallel, grad_accum: int = 1) -> dict:
    return {"name": "auto-bench", "entrypoint": {"script": str(TRAIN)},
            "config": {"arch": "llama", "width": width, "seq_len": SEQ},
            "train": {"steps": steps, "global_batch": BATCH, "seed": 1, "grad_accum": grad_accum},
            "resources": {"nodes": 1, "procs_per_node": WORLD, "device": "cpu"},
            "checkpoint": {"every_steps": 1_000_000}, "parallel": parallel}


def all_plans(args) -> tuple[dict, list[dict]]:
    """(the auto document, every feasible plan best first) as run.prepare would search them."""
    model = Llama(dim=args.width)
    name, blocks = find_blocks(model)
    d = {**describe(model, name, blocks), "seq_len": SEQ}
    spec = parse_job_spec(spec_json(args.steps, args.width, "auto"))
    _, auto = plan_user_model(spec, d, None, lambda tp: True)
    from trainyard.plan.inputs import parse_plan_request
    from trainyard.plan.job import runtime_supports
    from trainyard.plan.search import plan

    doc = plan(parse_plan_request(request(spec, d, None)), None,
               runnable=lambda c: c.pp == 1 and runtime_supports(spec, c))
    return auto, doc["plans"][:args.max_plans]


def run_one(args, work: Path, url: str, name: str, spec: dict) -> tuple[float, list[dict]]:
    """rank 0's median step_s after the warm-up, and the run's rank_plan events."""
    run_dir = work / name
    run_dir.mkdir()
    stream = f"trainyard:job:1:{name}"
    cfg = {"job_id": 1, "attempt_id": len(list(work.iterdir())), "node": "bench", "run_dir": str(run_dir),
           "redis_url": url, "stream": stream, "data_root": str(work), "checkpoint_dir": str(work / f"ck-{name}"),
           "resume": None, "spec": spec}
    (run_dir / "config.json").write_text(json.dumps(cfg))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TRAINYARD_RUN_CONFIG=str(run_dir / "config.json"))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
                    str(TRAIN)], env=env, check=True, capture_output=True, timeout=900, cwd=run_dir)
    client = redis.Redis.from_url(url)
    try:
        entries = client.xrange(stream)
    finally:
        client.close()
    samples, events = [], []
    for _, fields in entries:
        payload = json.loads(fields[b"data"])
        (samples.extend if fields[b"type"] == b"metrics" else events.append)(payload)
    times = [s["step_s"] for s in samples if s["rank"] == 0 and s["step"] > args.warmup and s.get("step_s")]
    return statistics.median(times), [e for e in events if e.get("kind") == "rank_plan"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--max-plans", type=int, default=24)
    args = ap.parse_args()
    auto, plans = all_plans(args)
    pick = {k: auto["chosen"][k] for k in ("dp", "tp", "pp", "micro_batch", "fsdp", "shard_optimizer", "recompute")}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server, url = start_redis(work)
        try:
            rows = []
            for i, p in enumerate(plans):
                par, accum = spec_parallel(p, BATCH)
                measured, _ = run_one(args, work, url, f"plan{i}", spec_json(args.steps, args.width, par, accum))
                rows.append({"plan": label(p), "predicted_s": p["step_time_s"], "measured_s": round(measured, 6),
                             "pick": all(p.get(k) == v for k, v in pick.items())})
            auto_s, auto_plans = run_one(args, work, url, "auto", spec_json(args.steps, args.width, "auto"))
        finally:
            server.terminate()
            server.wait(timeout=10)
    fastest = min(r["measured_s"] for r in rows)
    picked = next((r for r in rows if r["pick"]), None)
    order = sorted(rows, key=lambda r: r["measured_s"])
    applied = next((e.get("auto", {}).get("chosen") for e in auto_plans if e.get("rank") == 0), None)
    print(json.dumps({
        "bench": "auto_user", "model": f"Llama-style width {args.width}, 2 blocks", "world": WORLD,
        "global_batch": BATCH, "plans_measured": len(rows), "pick": label(auto["chosen"]),
        "pick_measured_s": picked["measured_s"] if picked else None, "fastest_measured_s": fastest,
        "fastest_plan": order[0]["plan"],
        "regret": round(picked["measured_s"] / fastest - 1, 4) if picked else None,
        "rank_of_pick": order.index(picked) + 1 if picked else None,
        "spearman_predicted_vs_measured": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
        "auto_run": {"applied": label(applied) if applied else None, "measured_s": round(auto_s, 6)},
        "plans": rows}, indent=1))


if __name__ == "__main__":
    main()
