"""Recovery time after a rank is SIGKILLed, on a real single-machine Trainyard (the integration
tests' Cluster: redis, daphne, Celery control worker + beat, relay, two node agents), for the demo
model. Breakdown from the job's own timeline:

- detection: SIGKILL -> the attempt ended (torchrun notices the dead worker, stops its peers, the
  agents report the exits, the control plane classifies the failure)
- scheduling: attempt ended -> the next attempt placed (a tick runs on every attempt end)
- process_start: placed -> every rank registered (Celery delivery, torchrun, Python + torch import)
- checkpoint_load: the runtime's own load time of the checkpoint (rank 0)
- to_first_step: ranks registered -> the first new step's sample (rendezvous, model build, load, step)

The baseline, side by side: the same job's cold start (submit -> first step) on the same cluster.
Run twice, side by side (issue 21): with the job sandbox (workers/sandbox.py, the default) and
with TRAINYARD_INSECURE_NO_SANDBOX=1, so the output says what the sandbox adds to a recovery
(`--sandbox on|off` runs one side only).
"""
from __future__ import annotations

import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.integration.cluster import Cluster  # noqa: E402

SPEC = {"name": "bench-recovery", "train": {"steps": 100000}, "checkpoint": {"every_steps": 20, "keep": 2},
        "max_restarts": 3}


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _first_sample_ts(c: Cluster, job_id: int, attempt_id: int) -> float | None:
    rows = c.get(f"/api/v1/jobs/{job_id}/metrics/?attempt={attempt_id}&limit=1")
    return rows[0]["ts"] if rows else None


def measure(log=print, sandboxed: bool = True) -> dict:
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-") as tmp:
        c = Cluster(Path(tmp))
        if not sandboxed:
            c.env["TRAINYARD_INSECURE_NO_SANDBOX"] = "1"
        try:
            c.start()
            t_submit = time.time()
            job = c.submit(SPEC)
            running = c.wait_running_ranks(job["id"], 2, 180)
            first = running["attempts"][0]["id"]
            cold_first = c.wait_for(lambda: _first_sample_ts(c, job["id"], first), 180, "the first step")
            c.wait_for(lambda: c.get(f"/api/v1/jobs/{job['id']}/checkpoints/")["count"] > 0, 300, "a checkpoint")
            victim = next(r for r in c.job(job["id"])["attempts"][0]["ranks"] if r["rank"] == 1)
            log(f"killing rank 1 (pid {victim['pid']}) of job {job['id']}")
            t_kill = time.time()
            psutil.Process(victim["pid"]).send_signal(signal.SIGKILL)
            second = c.wait_for(lambda: len((j := c.job(job["id"]))["attempts"]) > 1 and j["attempts"][1], 120,
                                "the next attempt")
            first_new = c.wait_for(lambda: _first_sample_ts(c, job["id"], second["id"]), 180, "the first new step")
            events = c.get(f"/api/v1/jobs/{job['id']}/events/?page_size=500")["results"]

            def at(kind: str, attempt: int) -> dict:
                return next(e for e in events if e["kind"] == kind and e["attempt"] == attempt)

            ended = _ts(at("attempt_ended", first)["created_at"])
            placed = _ts(at("attempt_started", second["id"])["created_at"])
            ranks_up = _ts(at("running", second["id"])["created_at"])
            resumed = next((e for e in events if e["kind"] == "resumed" and e["attempt"] == second["id"]), None)
            c.request("POST", f"/api/v1/jobs/{job['id']}/cancel/")
            c.wait_status(job["id"], {"CANCELLED", "FAILED", "SUCCEEDED"}, 60)
        finally:
            c.stop()
    total = first_new - t_kill
    cold = cold_first - t_submit
    return {
        "model": "demo gpt (spec defaults), 2 ranks x 1 proc, gloo, CPU", "sandboxed": sandboxed,
        "kill_to_first_new_step_s": round(total, 2),
        "breakdown_s": {"detection": round(ended - t_kill, 2), "scheduling": round(placed - ended, 2),
                        "process_start": round(ranks_up - placed, 2),
                        "checkpoint_load": resumed and resumed["data"].get("load_s"),
                        "to_first_step": round(first_new - ranks_up, 2)},
        "resumed_from_step": second["resumed_from_step"],
        "baseline_cold_start_s": round(cold, 2),
        "ratio_to_cold_start": round(total / cold, 3),
        "target_s": 15.0, "target_met": total < 15.0,
    }


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sandbox", choices=["both", "on", "off"], default="both")
    args = ap.parse_args()
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    sides = {"on": [True], "off": [False], "both": [False, True]}[args.sandbox]
    out = {("sandbox" if s else "no_sandbox"): measure(log=log, sandboxed=s) for s in sides}
    if len(out) == 2:
        a, b = out["sandbox"], out["no_sandbox"]
        out["sandbox_added_s"] = {
            "kill_to_first_new_step": round(a["kill_to_first_new_step_s"] - b["kill_to_first_new_step_s"], 2),
            "process_start": round(a["breakdown_s"]["process_start"] - b["breakdown_s"]["process_start"], 2),
            "cold_start": round(a["baseline_cold_start_s"] - b["baseline_cold_start_s"], 2)}
        out["ratio_sandbox_to_no_sandbox"] = round(a["kill_to_first_new_step_s"] / b["kill_to_first_new_step_s"], 3)
    print(json.dumps(out, indent=2))
