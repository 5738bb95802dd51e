"""Recovery time after a rank is SIGKILLed and after a node is lost, on a real single-machine
Trainyard (the integration tests' Cluster: redis, daphne, Celery control worker + beat, relay, two
sandboxed node agents), for the demo model, before and after issue 24's fast paths, side by side.

- kill: SIGKILL rank 1 of a 2-node job (1 rank per node) -> the first completed step of the next
  attempt (its first metrics sample's timestamp, taken by the rank when the step finished).
- node_loss: a 1-node job (2 ranks) whose node's agent and processes are killed; from the moment
  the control plane declares the node lost (the attempt's `fenced` event, written in that
  transaction) -> the first completed step of the next attempt, on the other node.

Breakdown of the kill, from the job's timeline and the run directories:
- detection: SIGKILL -> the attempt ended (torchrun notices the dead worker, the agents report the
  exits, the control plane stops the other node and classifies the failure)
- scheduling: attempt ended -> the next attempt placed (a tick runs on every attempt end)
- launcher_start: placed -> torchrun's rendezvous done on node-a (its per-rank log directory appears:
  Celery delivery, then procwrap, bwrap, the launcher's Python + imports and the rendezvous; with a
  standby only the hand-over and the rendezvous)
- rank_start: rendezvous done -> the rank wrote its ranks/<lr>.json (a fresh interpreter importing
  torch and the runtime, or a fork of the warm launcher)
- to_first_step: the rank's start -> the first new step (data, process group, model, checkpoint
  load, one step); checkpoint_load is the runtime's own load time (rank 0)

Sides: `before` runs every rank as a fresh interpreter under plain torchrun (TRAINYARD_WARM_RANKS=0,
the code path before this issue); `after` forks the built-in runtime's ranks from a launcher that
imported it before the rendezvous (workers/warmrun.py, with torch's rendezvous polls capped at 50 ms),
and a restart on the same nodes runs in the standby launcher the agent started for it while the
failed attempt trained (workers/standby.py). The lazy import of the pipeline (pp only) is in both
sides. A node loss restarts on the other node, where no standby of the job waits: it shows the warm
launcher alone. `--sides before|after` runs one side only; `--no-sandbox` runs both unsandboxed.

Lost work per failure: on the checkpoint-restart path (both sides above) every rank goes back to
the latest checkpoint, so the steps between it and the kill are trained again (`lost_steps`). The
`heal` case (trainyard.sdk.heal on torchft, examples/heal/train.py; not launched by the cluster
yet) runs two replicas under their own torchruns with a lighthouse, SIGKILLs one replica's rank,
and measures the kill -> the healed replica's first committed step, the steps the job lost (its
committed step never goes back: 0 by construction, checked), and the steps the survivor trained
again (the one its peer died in, if any). `--no-heal` leaves it out.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.integration.cluster import Cluster, attempt_processes  # noqa: E402

SPEC = {"name": "bench-recovery", "train": {"steps": 100000}, "checkpoint": {"every_steps": 20, "keep": 2},
        "max_restarts": 3}
NODE_SPEC = dict(SPEC, name="bench-node-loss", resources={"nodes": 1, "procs_per_node": 2})
TARGET_KILL_S, TARGET_NODE_LOSS_S = 5.0, 10.0


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _first_sample_ts(c: Cluster, job_id: int, attempt_id: int) -> float | None:
    rows = c.get(f"/api/v1/jobs/{job_id}/metrics/?attempt={attempt_id}&limit=1")
    return rows[0]["ts"] if rows else None


def _events(c: Cluster, job_id: int) -> list[dict]:
    return c.get(f"/api/v1/jobs/{job_id}/events/?page_size=500")["results"]


def _at(events: list[dict], kind: str, attempt: int) -> float:
    return _ts(next(e for e in events if e["kind"] == kind and e["attempt"] == attempt)["created_at"])


def _mtime(pattern: str, c: Cluster) -> float | None:
    found = sorted(c.dir.glob(pattern))
    return found[0].stat().st_mtime if found else None


def _next_attempt(c: Cluster, job_id: int) -> tuple[dict, float]:
    second = c.wait_for(lambda: len((j := c.job(job_id))["attempts"]) > 1 and j["attempts"][1], 120,
                        "the next attempt")
    first_new = c.wait_for(lambda: _first_sample_ts(c, job_id, second["id"]), 180, "the first new step")
    return c.job(job_id)["attempts"][1], first_new  # with its ranks


def _cancel(c: Cluster, job_id: int) -> None:
    c.request("POST", f"/api/v1/jobs/{job_id}/cancel/")
    c.wait_status(job_id, {"CANCELLED", "FAILED", "SUCCEEDED"}, 60)


def kill_case(c: Cluster, log=print) -> dict:
    job = c.submit(SPEC)
    first = c.wait_running_ranks(job["id"], 2, 180)["attempts"][0]["id"]
    c.wait_for(lambda: c.get(f"/api/v1/jobs/{job['id']}/checkpoints/")["count"] > 0, 300, "a checkpoint")
    victim = next(r for r in c.job(job["id"])["attempts"][0]["ranks"] if r["rank"] == 1)
    log(f"killing rank 1 (pid {victim['pid']}) of job {job['id']}")
    t_kill = time.time()
    psutil.Process(victim["pid"]).send_signal(signal.SIGKILL)
    second, first_new = _next_attempt(c, job["id"])
    events = _events(c, job["id"])
    ended, placed = _at(events, "attempt_ended", first), _at(events, "attempt_started", second["id"])
    # torchrun's per-attempt log directory, in the attempt's run directory or in the standby it ran in
    logs = sorted(c.dir.glob(f"agents/node-a/*/logs/attempt-{second['id']}_*"))
    rdzv_done = _mtime(f"{logs[0].relative_to(c.dir)}/attempt_0", c) if logs else None
    rank_up = _mtime(f"{logs[0].parent.parent.relative_to(c.dir)}/ranks/0.json", c) if logs else None
    resumed = next((e for e in events if e["kind"] == "resumed" and e["attempt"] == second["id"]), None)
    _cancel(c, job["id"])
    total = first_new - t_kill
    return {
        "kill_to_first_resumed_step_s": round(total, 2),
        "breakdown_s": {"detection": round(ended - t_kill, 2), "scheduling": round(placed - ended, 2),
                        "launcher_start": rdzv_done and round(rdzv_done - placed, 2),
                        "rank_start": rdzv_done and rank_up and round(rank_up - rdzv_done, 2),
                        "to_first_step": rank_up and round(first_new - rank_up, 2),
                        "checkpoint_load": resumed and round(resumed["data"].get("load_s") or 0, 2)},
        "resumed_from_step": second["resumed_from_step"],
        "lost_steps": c.job(job["id"])["attempts"][0]["last_step"] - (second["resumed_from_step"] or 0),
        "same_nodes": {r["node"] for r in second["ranks"]} == {"node-a", "node-b"},
    }


def node_loss_case(c: Cluster, log=print) -> dict:
    job = c.submit(NODE_SPEC)
    running = c.wait_running_ranks(job["id"], 2, 180)
    first = running["attempts"][0]
    node = first["ranks"][0]["node"]
    c.wait_for(lambda: c.get(f"/api/v1/jobs/{job['id']}/checkpoints/")["count"] > 0, 300, "a checkpoint")
    log(f"killing {node} (its agent and the processes of attempt {first['id']})")
    c.kill_proc(node)  # the machine dies: its agent and everything it started
    for p in attempt_processes(first["id"]):
        try:
            p.kill()
        except psutil.Error:
            pass
    second, first_new = _next_attempt(c, job["id"])
    events = _events(c, job["id"])
    declared = _at(events, "fenced", first["id"])
    placed = _at(events, "attempt_started", second["id"])
    _cancel(c, job["id"])
    c.start_proc(node)
    total = first_new - declared
    return {"node_loss_to_first_resumed_step_s": round(total, 2),
            "breakdown_s": {"declared_to_placed": round(placed - declared, 2),
                            "placed_to_first_step": round(first_new - placed, 2)},
            "lost_node": node, "resumed_on": sorted({r["node"] for r in second["ranks"]})}


def heal_case(log=print, steps: int = 200, kill_after_step: int = 60) -> dict:
    from tests.workers.runtime import heal_procs

    with tempfile.TemporaryDirectory(prefix="trainyard-bench-heal-") as tmp:
        run = heal_procs.kill_one_replica(Path(tmp), steps=steps, kill_after_step=kill_after_step)
    log(f"heal: codes {run.codes}, healed {run.heal}")
    survivor = heal_procs.committed(run.replicas[0])
    steady = survivor == list(range(survivor[0], steps)) if survivor else False
    return {"model": "MLP 64-256-8 (examples/heal/train.py), gloo, CPU, 2 replicas x 1 rank",
            "exit_codes": run.codes, "killed_after_step": run.killed_step,
            "healed_at_step": run.heal and run.heal["step"],
            "state_apply_ms": run.heal and round(run.heal["load_s"] * 1000, 2),
            "kill_to_first_healed_step_s": run.kill_to_first_healed_step_s and round(run.kill_to_first_healed_step_s, 2),
            "lost_steps": 0 if steady else None,  # the job's committed step never went back
            "survivor_retried_steps": len(heal_procs.retried(run.replicas[0])),
            "same_parameters_at_the_end": run.digests[0] is not None and run.digests[0] == run.digests[1]}


def measure(log=print, sandboxed: bool = True, fast: bool = True, node_loss: bool = False) -> dict:
    """One side on a fresh cluster: the kill (and, with node_loss, the node loss) case."""
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-") as tmp:
        c = Cluster(Path(tmp))
        c.env["TRAINYARD_WARM_RANKS"] = "1" if fast else "0"
        if not sandboxed:
            c.env["TRAINYARD_INSECURE_NO_SANDBOX"] = "1"
        try:
            c.start()
            t0 = time.time()
            job = c.submit(dict(SPEC, name="bench-cold", train={"steps": 3}))
            c.wait_status(job["id"], {"SUCCEEDED"}, 180)
            out = {"model": "demo gpt (spec defaults), gloo, CPU", "sandboxed": sandboxed,
                   "warm_ranks": fast, "cold_job_3_steps_s": round(time.time() - t0, 2), "kill": kill_case(c, log)}
            if node_loss:
                out["node_loss"] = node_loss_case(c, log)
            return out
        finally:
            c.stop()


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", choices=["both", "before", "after"], default="both")
    ap.add_argument("--no-sandbox", action="store_true")
    ap.add_argument("--no-node-loss", action="store_true", help="the kill case only")
    ap.add_argument("--no-heal", action="store_true", help="leave out the heal-in-place case")
    args = ap.parse_args()
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    sides = {"before": [False], "after": [True], "both": [False, True]}[args.sides]
    out: dict = {"machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start"}
    for fast in sides:
        out["after" if fast else "before"] = measure(log=log, sandboxed=not args.no_sandbox, fast=fast,
                                                     node_loss=not args.no_node_loss)
    if not args.no_heal:
        out["heal"] = heal_case(log=log)
    side = out.get("after") or out["before"]
    out["target"] = {"kill_s": TARGET_KILL_S, "node_loss_s": TARGET_NODE_LOSS_S,
                     "kill_met": side["kill"]["kill_to_first_resumed_step_s"] < TARGET_KILL_S}
    if "node_loss" in side:
        out["target"]["node_loss_met"] = side["node_loss"]["node_loss_to_first_resumed_step_s"] < TARGET_NODE_LOSS_S
    if len(sides) == 2:
        b, a = out["before"], out["after"]
        out["side_by_side"] = {"kill_to_first_resumed_step_s": [b["kill"]["kill_to_first_resumed_step_s"],
                                                                a["kill"]["kill_to_first_resumed_step_s"]]}
        if "heal" in out:
            out["side_by_side"]["lost_steps_per_failure"] = {
                "checkpoint_restart_before": b["kill"]["lost_steps"], "checkpoint_restart_after": a["kill"]["lost_steps"],
                "heal_in_place": out["heal"]["lost_steps"]}
        if "node_loss" in a:
            out["side_by_side"]["node_loss_to_first_resumed_step_s"] = [
                b["node_loss"]["node_loss_to_first_resumed_step_s"], a["node_loss"]["node_loss_to_first_resumed_step_s"]]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
