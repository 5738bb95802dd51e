"""Calibration of the planner's cost model on this machine, before vs after, as JSON.

    python bench/calibration.py [--measurements FILE] [--oversubscribed FILE]

Measures this machine with the calibration harness (`python -m workers.calibrate`, 2 ranks; or
reads `--measurements`), fits the constants on two thirds of the runs
(jobs/planning/services/calibration.py, the same as `manage.py calibrate`) and prints, for the runs held
out of the fit, predicted vs measured step time (Spearman, median and max relative error) and
memory under the default constants ("before") and the calibrated ones ("after"), with their
ratio. `--oversubscribed FILE` (a harness document measured with `--procs 4` on a 2-core
machine: `python -m workers.calibrate --out FILE --procs 4`) is evaluated with the same
2-rank constants, reported separately: four ranks time-share two cores, which the cost model
does not describe, so those figures say how far the 2-rank calibration carries, not how good it is.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

from trainyard.plan.calibration import evaluate  # noqa: E402
from jobs.planning.services.calibration import calibration_fit  # noqa: E402

KEYS = ("spearman", "step_error_median", "step_error_max", "states_error_max", "activation_error_max")


def brief(e: dict) -> dict:
    return {k: round(e[k], 4) for k in KEYS if e.get(k) is not None}


def measure(procs: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "m.json"
        argv = [sys.executable, "-m", "workers.calibrate", "--out", str(out)]
        if procs:
            argv += ["--procs", str(procs)]
        subprocess.run(argv, cwd=ROOT, check=True, timeout=1800, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measurements", type=Path, help="a 2-rank harness document (default: measure now)")
    ap.add_argument("--oversubscribed", type=Path, help="a harness document measured with --procs 4")
    args = ap.parse_args()
    doc = json.loads(args.measurements.read_text()) if args.measurements else measure()
    constants, ev = calibration_fit(doc)
    before, after = brief(ev["before"]), brief(ev["after"])
    report = {"device": doc["device"]["name"], "runs": len(doc["runs"]), "held_out": len(ev["held_out"]),
              "before": before, "after": after,
              "ratio_after_to_before": {k: round(after[k] / before[k], 3) for k in after
                                        if before.get(k) and k != "spearman"},
              "constants_source": constants.source}
    if args.oversubscribed:
        over = json.loads(args.oversubscribed.read_text())
        report["oversubscribed"] = {"procs": over["device"]["procs"], "runs": len(over["runs"]),
                                    "with_2_rank_constants": brief(evaluate(over, constants))}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
