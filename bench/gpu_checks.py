"""GPU checks for the CUDA/NCCL paths (issue 14): one JSON line per check.

    python bench/gpu_checks.py                 # every check, each in its own process
    python bench/gpu_checks.py --only versions,pinned_batch --timeout 120
    python bench/gpu_checks.py --list
    python bench/gpu_checks.py --device cpu    # dry run of the device-neutral checks on CPU/gloo

The checks live in bench/gpu/*.py: each module defines `CHECKS = [(name, min_gpus, fn)]`; `fn()`
returns a JSON-able dict with at least "ok". Each check runs in a fresh interpreter (a CUDA
context, an NCCL communicator or a crash in one never leaks into the next) with its own
timeout. A check that needs more GPUs than the machine has is printed as skipped with the
reason, so the script runs anywhere; on a machine without CUDA only `versions` runs. The last
line is a summary: checks passed, failed, skipped. Exit status 1 when any check failed.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECK_DIR = REPO / "bench" / "gpu"
DEVICE_ENV = "GPU_CHECKS_DEVICE"  # bench/gpu/common.py reads it: cuda (default) or cpu


def load_checks() -> dict[str, tuple[int, str]]:
    """name -> (min_gpus, module path), from every bench/gpu module with CHECKS."""
    found: dict[str, tuple[int, str]] = {}
    for path in sorted(CHECK_DIR.glob("*.py")):
        if path.name.startswith("_"):
            continue
        module = _import(path)
        for name, min_gpus, _fn in getattr(module, "CHECKS", []):
            if name in found:
                raise SystemExit(f"check {name!r} is defined twice ({found[name][1]} and {path})")
            found[name] = (int(min_gpus), str(path))
    return found


def _import(path: Path):
    """bench.gpu.<stem>, imported as a package module so the checks share bench.gpu.common."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if path.resolve().parent == CHECK_DIR:
        return importlib.import_module(f"bench.gpu.{path.stem}")
    spec = importlib.util.spec_from_file_location(f"gpu_check_{path.stem}", path)  # a module elsewhere
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_count() -> int:
    """GPUs visible, asked in a child so this process never creates a CUDA context."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return 0


def run_one(name: str, path: str, timeout_s: float, env: dict) -> dict:
    """Run one check in a child; its last stdout line is the result."""
    start = time.monotonic()
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--module", path]
    try:
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        return {"check": name, "ok": False, "error": f"timed out after {timeout_s:.0f} s",
                "stderr_tail": tail.decode("utf-8", "replace") if isinstance(tail, bytes) else tail}
    wall = round(time.monotonic() - start, 2)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        result = {"ok": False, "error": f"exit code {proc.returncode} with no result",
                  "stderr_tail": proc.stderr[-2000:]}
    if proc.returncode != 0 and result.get("ok"):
        result = {**result, "ok": False, "error": f"exit code {proc.returncode}"}
    return {"check": name, **result, "wall_s": wall}


def child(name: str, path: str) -> None:
    module = _import(Path(path))
    fn = next(f for n, _g, f in module.CHECKS if n == name)
    from bench.gpu.common import Skip  # REPO is on sys.path only from _import on
    try:
        result = fn()
    except Skip as s:
        result = {"ok": None, "skipped": str(s)}
    except Exception as e:  # a check's crash is its result, not the runner's
        import traceback
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(result, default=str), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated check names")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per check (default 150)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: dry-run the checks that can run on CPU/gloo, GPU counts ignored")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--module", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.module)
        return 0
    checks = load_checks()
    if args.list:
        for name, (gpus, path) in checks.items():
            print(json.dumps({"check": name, "min_gpus": gpus, "module": os.path.relpath(path, REPO)}))
        return 0
    wanted = args.only.split(",") if args.only else list(checks)
    unknown = [n for n in wanted if n not in checks]
    if unknown:
        ap.error(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(checks)}")
    have = gpu_count() if args.device == "cuda" else None
    env = {**os.environ, DEVICE_ENV: args.device, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for name in wanted:
        need, path = checks[name]
        if have is not None and need > have:
            result = {"check": name, "ok": None, "skipped": f"needs {need} GPU(s), this machine has {have}"}
        else:
            result = run_one(name, path, args.timeout, env)
        counts["passed" if result.get("ok") else "skipped" if result.get("ok") is None else "failed"] += 1
        print(json.dumps(result, default=str), flush=True)
    print(json.dumps({"summary": counts, "gpus": have, "device": args.device}), flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
