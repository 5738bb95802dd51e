"""python -m workers.calibrate --out FILE [--quick]: measure this node (harness.py), write the
measurement document to FILE (0644, replaced atomically), print the wall times; exit 1 with
the failing part's output on stderr when a part fails."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: the thread count of a slot

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.calibrate",
                                 description="Measure this node for the planner's cost model.")
    ap.add_argument("--out", required=True, type=Path, help="where to write the measurement JSON")
    ap.add_argument("--quick", action="store_true", help="a smaller sweep (about a minute)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds for the distributed part")
    ap.add_argument("--procs", type=int, default=None,
                    help="ranks of the distributed part (default: the node's devices; on CPU 2). More ranks "
                         "than cores oversubscribes the node: for reporting, not for fitting")
    args = ap.parse_args(argv)
    if args.procs is not None and not 1 <= args.procs <= 64:
        ap.error("--procs must be between 1 and 64")
    if args.timeout is not None and args.timeout <= 0:
        ap.error("--timeout must be positive")
    if not args.out.parent.is_dir():
        ap.error(f"--out: directory {args.out.parent} does not exist")
    from .harness import HarnessError, measure
    t0 = time.perf_counter()
    try:
        doc, walls = measure(args.quick, args.timeout, log=lambda s: print(s, file=sys.stderr, flush=True),
                             procs=args.procs)
    except HarnessError as e:
        print(f"calibration failed: {e}", file=sys.stderr)
        return 1
    walls["total_s"] = time.perf_counter() - t0
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(args.out)
    print(json.dumps({"out": str(args.out), "runs": len(doc["runs"]),
                      "wall_s": {k: round(v, 1) for k, v in walls.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
