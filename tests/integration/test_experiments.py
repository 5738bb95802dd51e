"""Issue 25 end to end on the real cluster: a 6-trial random search with ASHA over the built-in GPT,
two trials at once. The trials with a tiny learning rate are stopped at a rung through the
preemption path (checkpoint, exit), the best trial finishes, and the API shows it as best; the
control worker is SIGKILLed mid-experiment and restarted, and no trial is lost or made twice.
And a grid search over user code (examples/sdk_ddp through the SDK, `config.lr` varied): the
trial its run.log losses put behind is stopped at a rung, then continued from its checkpoint."""
from __future__ import annotations

import time

import pytest

from tests.test_entrypoint import pack_dir

from .test_user_code import EXAMPLES, sdk_spec, upload

pytestmark = [pytest.mark.procs, pytest.mark.timeout(900)]

GOOD, TINY = 3e-3, 1e-7

TEMPLATE = {
    "name": "lr-search",
    "model": {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 2, "seq_len": 64},
    "train": {"steps": 400, "global_batch": 16},
    "resources": {"nodes": 1, "procs_per_node": 1}, "parallel": {"dp": 1},
    "checkpoint": {"every_steps": 10, "keep": 2},
}
# Seed 4 draws GOOD, TINY, TINY, TINY, TINY, GOOD (tests/jobs/experiments/test_searcher.py pins the
# sampler's reproducibility). Reduction 8 keeps only the leader at each rung (rungs at steps 20 and
# 160) with at most 6 peers, so the outcome does not hang on which of two concurrent trials reports
# first: trials 2-4 start after trial 0 passed step 20 and are stopped there; trial 1 races trial 0.
SEARCH = {"metric": "loss", "mode": "min", "algorithm": "random", "max_trials": 6, "max_concurrent": 2, "seed": 4,
          "space": {"train.lr": {"choice": [GOOD, TINY]}},
          "early_stopping": {"asha": {"min_steps": 20, "reduction": 8}}}


def test_random_search_with_asha_stops_the_worse_trials_and_finds_the_best(cluster):
    t0 = time.monotonic()
    status, e = cluster.request("POST", "/api/v1/experiments/", {"name": "lr", "spec": TEMPLATE, "search": SEARCH})
    assert status == 201, e
    eid = e["id"]
    values = [t["values"]["train.lr"] for t in e["trials"]]
    assert len(values) == 2

    def experiment():
        return cluster.get(f"/api/v1/experiments/{eid}/")

    def state() -> str:
        d = experiment()
        return "\n".join([f"experiment {eid}: {d['status']} {d['status_reason']}"]
                         + [f"  trial {t['number']} job {t['job']} {t['values']} {t['status']} metric {t['metric']} "
                            f"steps {t['steps']} rung {t['rung']} ({t['status_reason']})" for t in d["trials"]]
                         + [f"  {ev['kind']}: {ev['message']}" for ev in d["events"][-12:]])

    # the control worker dies while the first trials run; a new one picks the experiment up
    cluster.wait_for(lambda: any(t["steps"] > 0 for t in experiment()["trials"]), 240, "a trial's first metrics")
    cluster.kill_proc("control")
    time.sleep(2)
    cluster.start_proc("control")

    def ended():
        d = experiment()
        return d["status"] != "running" and d
    try:
        done = cluster.wait_for(ended, 600, "the experiment to end", interval_s=1.0)
    except AssertionError as exc:
        raise AssertionError(f"{state()}\n{exc}") from None
    took = time.monotonic() - t0
    trials = done["trials"]
    report = state()
    assert done["status"] == "succeeded", report
    # no trial lost, none made twice: numbers 0..5, six distinct jobs, each the trial of this experiment
    assert [t["number"] for t in trials] == list(range(6)), report
    assert len({t["job"] for t in trials}) == 6
    for t in trials:
        assert cluster.job(t["job"])["experiment"] == eid
    assert [t["values"]["train.lr"] for t in trials] == [GOOD, TINY, TINY, TINY, TINY, GOOD], report
    stopped = [t for t in trials if t["status"] == "early_stopped"]
    assert [t["number"] for t in stopped if t["number"] in (2, 3, 4)] == [2, 3, 4], report
    for t in stopped:
        assert t["rung"] is not None, report
        job = cluster.job(t["job"])
        assert job["status"] == "CANCELLED" and "early stopped" in job["status_reason"], job["status_reason"]
        assert job["attempts"][-1]["outcome"] == "early_stopped"
        assert job["step"] < TEMPLATE["train"]["steps"]
        ckpts = cluster.get(f"/api/v1/jobs/{t['job']}/checkpoints/")["results"]
        assert ckpts, f"early-stopped job {t['job']} has no checkpoint\n{report}"
    assert all(t["status"] in ("succeeded", "early_stopped") for t in trials), report
    best = done["best"]
    finished = {t["job"]: t for t in trials if t["status"] == "succeeded"}
    assert best["job"] in finished and best["values"]["train.lr"] == GOOD, report
    assert cluster.job(best["job"])["status"] == "SUCCEEDED"
    assert best["metric"] == min(t["metric"] for t in trials if t["metric"] is not None)
    # the good trials learned; the tiny-lr ones stayed near ln 256 = 5.55 until they were stopped
    assert best["metric"] < 4.0 and all(t["metric"] > 5.0 for t in stopped if t["values"]["train.lr"] == TINY), report
    assert any(ev["kind"] == "ended" for ev in done["events"])
    print(f"experiment {eid}: {len(stopped)} of 6 trials stopped early, best {best['metric']:.3f}, {took:.0f} s")


def test_a_grid_over_user_code_stops_the_worse_trial_which_then_continues_from_its_checkpoint(cluster):
    status, body = upload(cluster, pack_dir(EXAMPLES / "sdk_ddp"))
    assert status in (200, 201), body
    spec = sdk_spec("sdk-grid", body["bundle"], steps=200, every=10, nodes=1, sleep=0.03)
    # seed 1 orders the grid GOOD then TINY; one trial at a time, so the second meets the first's rungs
    search = {"metric": "loss", "mode": "min", "algorithm": "grid", "max_trials": 10, "max_concurrent": 1, "seed": 1,
              "space": {"config.lr": {"choice": [GOOD, TINY]}},
              "early_stopping": {"asha": {"min_steps": 20, "reduction": 2}}}
    status, e = cluster.request("POST", "/api/v1/experiments/", {"name": "sdk-grid", "spec": spec, "search": search})
    assert status == 201, e
    eid = e["id"]

    def experiment():
        return cluster.get(f"/api/v1/experiments/{eid}/")
    done = cluster.wait_for(lambda: (d := experiment())["status"] != "running" and d, 480, "the grid to end",
                            interval_s=1.0)
    first, second = done["trials"]
    assert len(done["trials"]) == 2, done  # the grid's two points, then it stops
    assert (first["values"], second["values"]) == ({"config.lr": GOOD}, {"config.lr": TINY}), done
    assert done["status"] == "succeeded" and first["status"] == "succeeded", done
    assert second["status"] == "early_stopped" and second["rung"] is not None, done
    assert done["best"]["job"] == first["job"] and done["best"]["metric"] < second["metric"]
    job = cluster.job(second["job"])
    assert job["spec"]["config"]["lr"] == TINY and job["status"] == "CANCELLED" and job["step"] < 200
    stopped_at = job["step"]
    # continued later: the job is queued again and resumes from its checkpoint, to its last step
    status, _ = cluster.request("POST", f"/api/v1/experiments/{eid}/trials/{second['job']}/continue/")
    assert status == 202
    assert experiment()["status"] == "running"
    job = cluster.wait_status(second["job"], {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
    assert job["status"] == "SUCCEEDED" and job["step"] == 200, cluster.job_state(second["job"])
    resumed = job["attempts"][-1]["resumed_from_step"]
    assert resumed is not None and 0 < resumed <= stopped_at, job["attempts"]
    done = cluster.wait_for(lambda: (d := experiment())["status"] != "running" and d, 60, "the experiment to end again")
    assert [t["status"] for t in done["trials"]] == ["succeeded", "succeeded"], done
