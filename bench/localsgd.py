"""Local SGD on a slow link, side by side: every-step gradient all-reduce against post-local SGD
averaging the models every 4 and every 8 steps.

Same setup as bench/compression.py: two gloo ranks of the Trainyard runtime, one per network
namespace, a veth link limited to --rate each way (tc tbf, bench/netns.py), the ~10.7M-parameter
GPT on the demo corpus, telemetry over a unix socket. Every config runs --steps steps with
comm.start_step = --start-step (local SGD: dense gradient all-reduce until then). From rank 0's
samples: steps_per_s = (steps - start_step) / (ts[steps] - ts[start_step]), the wall rate over
the steps after start_step (averaging steps are slow and the others fast, so a median step
would flatter local SGD); bytes_per_step = mean bytes_sent over those steps; loss = mean over both
ranks of the last 4 steps' losses (with the defaults the last step of both local SGD configs
averages the models: s - 1 - start_step = 32); val_loss = rank 0's loss on fixed held-out
windows after the last step (replicas equal then); steps_sending = steps after start_step that sent
bytes. Ratios are config / allreduce.

Without network namespaces the ranks run on loopback: then only bytes and loss are reported.
Prints one JSON object on stdout (progress on stderr). ~7 min on 2 cores with the defaults (403 s measured).
Usage: python bench/localsgd.py [--rate 100mbit] [--steps 37] [--start-step 4]
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compression import _null, _ratio, spec as base_spec  # noqa: E402
from netns import (job_val_loss, link_job_args, measure_throughput, netns_available, netns_link, run_job,  # noqa: E402
                   unix_redis)

LAST = 4


def configs(args) -> dict[str, dict]:
    return {"allreduce": {"sync": "allreduce"},
            **{f"local_sgd_{p}": {"sync": "local_sgd", "period": p} for p in args.periods}}


def figures(samples: list[dict], start: int, steps: int) -> dict:
    rank0 = sorted((s for s in samples if s["rank"] == 0), key=lambda s: s["step"])
    if len(rank0) != steps or len(samples) != 2 * steps:
        sys.exit(f"expected {steps} samples per rank, got {len(samples)} in all")
    ts = {s["step"]: s["ts"] for s in rank0}
    after = [s for s in rank0 if s["step"] > start]
    last = [s["loss"] for s in samples if s["step"] > steps - LAST]
    return {"steps_per_s": round((steps - start) / (ts[steps] - ts[start]), 4),
            "bytes_per_step": int(sum(s["bytes_sent"] for s in after) / len(after)),
            "steps_sending": sum(1 for s in after if s["bytes_sent"] > 0),
            "loss": round(sum(last) / len(last), 4), "first_loss": round(rank0[0]["loss"], 4)}


def main() -> None:
    ap = link_job_args(steps=37, start_step=4)
    ap.add_argument("--periods", default="4,8", type=lambda v: [int(p) for p in v.split(",")])
    ap.add_argument("--timeout-s", type=float, default=600)
    args = ap.parse_args()
    ok, why = netns_available()
    if not ok:
        print(f"network namespaces unavailable ({why}): loopback, bytes and loss only",
              file=sys.stderr)
    cfgs = configs(args)
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-") as tmp, unix_redis(Path(tmp)) as url:
        with (netns_link(rate=args.rate) if ok else _null()) as link:
            link_bps = measure_throughput(link) * 8 if link is not None else None
            for job_id, (name, comm) in enumerate(cfgs.items(), start=1):
                t = time.monotonic()
                samples = run_job(link, base_spec(args, comm), Path(tmp), url, job_id, args.timeout_s)
                results[name] = figures(samples, args.start_step, args.steps)
                results[name]["val_loss"] = job_val_loss(Path(tmp), job_id)
                print(f"{name}: {results[name]} ({time.monotonic() - t:.0f} s)", file=sys.stderr)
    base = results["allreduce"]
    ratios = {name: {"bytes": round(r["bytes_per_step"] / base["bytes_per_step"], 4),
                     "loss": round(r["loss"] / base["loss"], 4),
                     "val_loss": _ratio(r["val_loss"], base["val_loss"]),
                     **({"steps_per_s": round(r["steps_per_s"] / base["steps_per_s"], 3)} if ok else {})}
              for name, r in results.items()}
    if not ok:
        for r in results.values():
            r.pop("steps_per_s")
    print(json.dumps({
        "link": {"namespaces": ok, "rate": args.rate if ok else None,
                 "measured_mbit_s": round(link_bps / 1e6, 1) if link_bps else None,
                 "why_not": None if ok else why},
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "seq_len": args.seq_len, "vocab": 256},
        "steps": args.steps, "start_step": args.start_step, "global_batch": args.global_batch,
        "configs": cfgs, "results": results, "ratios_to_allreduce": ratios,
        "bench_s": round(time.monotonic() - t0, 1),
    }, indent=1))


if __name__ == "__main__":
    main()
