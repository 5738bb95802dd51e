"""The harness for real: `python -m workers.calibrate --quick` on this machine (torchrun, 2 gloo
ranks), its document valid and fit by the control plane's fit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainyard.plan.calibration import evaluate, fit
from trainyard.plan.constants import DEFAULT_CPU
from trainyard.calibration import parse_measurements

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.procs


def test_quick_harness_writes_a_valid_document(tmp_path):
    out = tmp_path / "m.json"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "workers.calibrate", "--out", str(out), "--quick"],
                          cwd=REPO, text=True, capture_output=True, timeout=240)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["runs"] == 10 and summary["wall_s"]["total_s"] <= wall
    doc = json.loads(out.read_text())
    m = parse_measurements(doc)
    assert m.device.kind == "cpu" and m.device.procs == 2 and m.device.threads_per_proc == 1
    assert {c.op for c in m.collectives} == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    big = max(m.collectives, key=lambda c: (c.op == "all_reduce", c.bytes))
    small = min((c for c in m.collectives if c.op == "all_reduce"), key=lambda c: c.bytes)
    assert big.seconds > small.seconds  # 16 MiB takes longer than 4 KiB
    by = {(r.model.hidden, r.plan.dp, r.plan.tp, r.plan.pp, r.plan.fsdp, r.plan.schedule): r for r in m.runs}
    for h in (64, 128):
        ddp, fsdp = by[(h, 2, 1, 1, False, "1f1b")], by[(h, 2, 1, 1, True, "1f1b")]
        # FSDP keeps half of every parameter, gradient and moment on each of 2 ranks
        assert fsdp.memory.params_bytes == ddp.memory.params_bytes // 2
        assert fsdp.memory.optimizer_bytes == ddp.memory.optimizer_bytes // 2
        assert ddp.memory.optimizer_bytes == 2 * ddp.memory.params_bytes  # AdamW: m and v
        assert by[(h, 1, 1, 2, False, "gpipe")].memory.params_bytes < ddp.memory.params_bytes
        assert by[(h, 1, 2, 1, False, "1f1b")].memory.activation_bytes < ddp.memory.activation_bytes
    assert by[(128, 2, 1, 1, False, "1f1b")].step_time_s > by[(64, 2, 1, 1, False, "1f1b")].step_time_s
    k = fit(doc, DEFAULT_CPU, runs=range(0, 10, 2))
    e = evaluate(doc, k, range(1, 10, 2))
    assert e["runs"] == 5 and e["activation_error_max"] < 0.3


def test_a_harness_past_its_timeout_is_killed_with_its_ranks(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the ranks' argv then names tmp_path
    proc = subprocess.run([sys.executable, "-m", "workers.calibrate", "--out", str(tmp_path / "m.json"), "--quick",
                           "--timeout", "8"], cwd=REPO, env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 1 and "did not finish in 8 s" in proc.stderr
    assert not (tmp_path / "m.json").exists()
    left = [p for p in psutil.process_iter(["cmdline"]) if any(str(tmp_path) in a for a in p.info["cmdline"] or [])]
    assert left == []


def test_a_missing_output_directory_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "workers.calibrate", "--out", str(tmp_path / "no" / "m.json")],
                          cwd=REPO, text=True, capture_output=True, timeout=60)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
