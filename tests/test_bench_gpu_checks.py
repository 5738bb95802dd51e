"""bench/gpu_checks.py runs anywhere: without a GPU every check that needs one is printed as
skipped with the reason, `versions` runs, each check in its own process; every check module
imports cleanly and names its checks once."""
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_checks  # noqa: E402


def test_every_check_module_imports_and_names_unique_checks():
    checks = gpu_checks.load_checks()
    assert "versions" in checks and len(checks) >= 9
    for name, (gpus, path) in checks.items():
        assert gpus >= 0 and path.endswith(".py"), name


@pytest.mark.procs
def test_without_a_gpu_gpu_checks_are_skipped_with_the_reason_and_the_run_is_green():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_checks.py"), "--only",
                           "versions,future_order,abort_nccl"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    by = {r.get("check"): r for r in lines}
    assert proc.returncode == 0, proc.stderr
    assert by["versions"]["ok"] is True and by["versions"]["torch"].startswith("2.")
    if not by["versions"]["cuda_available"]:
        assert by["future_order"] == {"check": "future_order", "ok": None,
                                      "skipped": "needs 1 GPU(s), this machine has 0"}
        assert by["abort_nccl"]["skipped"] == "needs 2 GPU(s), this machine has 0"
        assert lines[-1]["summary"] == {"passed": 1, "failed": 0, "skipped": 2}


@pytest.mark.procs
def test_a_check_that_raises_or_times_out_is_a_failed_line_not_a_crash(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import time\n"
                   "def boom():\n    raise RuntimeError('kaput')\n"
                   "def slow():\n    time.sleep(30)\n"
                   "CHECKS = [('boom', 0, boom), ('slow', 0, slow)]\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    r = gpu_checks.run_one("boom", str(bad), 60, env)
    assert r["ok"] is False and r["error"] == "RuntimeError: kaput" and "boom" in r["traceback"], r
    r = gpu_checks.run_one("slow", str(bad), 2, env)
    assert r == {"check": "slow", "ok": False, "error": "timed out after 2 s", "stderr_tail": ""}, r
