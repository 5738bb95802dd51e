"""Planner benchmark: search time at scale and the honest check against published training runs.
Prints one JSON object on stdout (progress on stderr); pure Python, a few seconds.

    python bench/planner_published.py           # search time + published-runs figures
    python bench/planner_published.py --fit     # also re-fit DEFAULT_GPU on the training rows

`search`: a 1T GPT (128 layers, hidden 25600, 160 heads, seq 2048, vocab 51200, batch 3072) on
384 x 8 A100-80GB: `plan()` wall time, min and median of `--repeat` runs (target < 100 ms), with
the plans and rejected counts and the best plan.

`published`: trainyard/plan/published.py's rows (each with its source) with DEFAULT_GPU, fit on
the TRAIN rows only (trainyard/plan/fit.py): per split, mean and max |error| of the throughput
predicted for the published layout against the measured one, whether the published (tp, pp) is
among the planner's three best distinct layouts, and the regret of the planner's pick where a
group of rows measured several layouts of one model on one cluster and batch (Megatron-LM 2021
Table 2's five PTD-P / ZeRO-3 pairs).
Targets on the held-out rows: mean <= 12%, max <= 25%, top-3 >= 80%. `out_of_scope` rows (the
run used techniques the model does not cost) are reported apart.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainyard.plan import DEFAULT_GPU, parse_plan_request, plan  # noqa: E402
from trainyard.plan.fit import FIT_START, evaluate, fit, split  # noqa: E402

TRILLION = {"model": {"layers": 128, "hidden": 25600, "heads": 160, "seq_len": 2048, "vocab": 51200},
            "cluster": {"nodes": 384, "devices_per_node": 8,
                        "device": {"name": "A100-80GB", "memory_gb": 80, "peak_tflops": 312},
                        "intra_node_gbs": 300, "inter_node_gbs": 200},
            "global_batch": 3072}


def search_section(repeat: int) -> dict:
    req = parse_plan_request(TRILLION)
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = plan(req, DEFAULT_GPU)
        times.append(time.perf_counter() - t0)
    best = out["plans"][0]
    return {"model": "1T GPT", "devices": 3072, "repeat": repeat, "min_ms": round(min(times) * 1000, 2),
            "median_ms": round(statistics.median(times) * 1000, 2), "plans": len(out["plans"]),
            "rejected_listed": len(out["rejected"]),
            "best": {k: best[k] for k in ("dp", "tp", "pp", "micro_batch", "fsdp", "shard_optimizer", "recompute",
                                          "schedule", "step_time_s", "tflops_per_device", "memory_gb_per_device")},
            "target_ms": 100}


def published_section(constants) -> dict:
    train, held, out = split()
    result = {}
    for name, rows in (("train", train), ("held_out", held), ("out_of_scope", out)):
        e = evaluate(rows, constants)
        result[name] = {**{k: v for k, v in e.items() if k != "rows"},
                        "rows": [{k: r[k] for k in ("id", "error", "published_layout", "top3_layouts",
                                                    "published_in_top3")} for r in e["rows"]]}
    result["targets"] = {"held_out_mean_abs_error": 0.12, "held_out_max_abs_error": 0.25, "top3_rate": 0.8}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--fit", action="store_true", help="re-fit DEFAULT_GPU on the training rows and print it")
    args = ap.parse_args()
    print("search: 1T GPT on 3,072 devices", file=sys.stderr)
    report = {"search": search_section(args.repeat)}
    constants = DEFAULT_GPU
    if args.fit:
        print("fitting on the training rows", file=sys.stderr)
        constants = fit(split()[0], FIT_START)
        report["fitted_constants"] = constants.to_dict()
    print("published runs", file=sys.stderr)
    report["published"] = published_section(constants)
    report["constants_source"] = constants.source
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
