"""The parallel plan on the job: described at submit, and what each rank really holds as the
runtime reports it (`rank_plan` events through the relay), in the API and on the job page."""
import pytest

from jobs import services

from tests.jobs.runs.test_services import start, submit

pytestmark = pytest.mark.django_db


def test_submit_stores_the_plan_with_mesh_meaning_and_roles(user, nodes):
    job = submit(user, parallel={"dp": 1, "tp": 2}, resources={"nodes": 1, "procs_per_node": 2})
    assert job.plan["mesh"] == {"pp": 1, "dp": 1, "tp": 2} and job.plan["source"] == "spec"
    assert job.plan["dims"][0]["name"] == "tp" and "heads" in job.plan["dims"][0]["meaning"]
    assert [r["role"] for r in job.plan["roles"]] == ["replica 0/1, tp 0/2: heads 0-1",
                                                      "replica 0/1, tp 1/2: heads 2-3"]


def test_rank_plan_events_reach_the_attempt_the_api_and_the_page(user, nodes, client_for, client):
    job = submit(user, parallel={"dp": 1, "pp": 2, "microbatches": 4})
    attempt = start(job)
    events = [{"kind": "rank_plan", "rank": r, "attempt": attempt.pk, "strategy": "pp",
               "coords": {"pp": r, "dp": 0, "tp": 0}, "role": f"stage {r} of 2",
               "param_bytes": 1000 + r, "optim_bytes": 2000 + r, "mesh": {"ignored": True}}
              for r in (0, 1)]
    services.telemetry_ingest([], events=events)
    services.telemetry_ingest([], events=[{"kind": "rank_plan", "rank": "bad", "attempt": attempt.pk}])
    attempt.refresh_from_db()
    assert attempt.rank_plans["1"] == {"strategy": "pp", "coords": {"pp": 1, "dp": 0, "tp": 0},
                                       "role": "stage 1 of 2", "param_bytes": 1001, "optim_bytes": 2001}
    ranks = client_for(user).get(f"/api/v1/jobs/{job.pk}/").json()["attempts"][0]["ranks"]
    assert [(r["rank"], r["role"], r["param_bytes"]) for r in ranks] == [
        (0, "stage 0 of 2", 1000), (1, "stage 1 of 2", 1001)]
    client.force_login(user)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "Parallel plan" in page and "mesh pp=2 × dp=1 × tp=1" in page
    assert "pipeline stages: each holds a contiguous slice of the layers" in page
    assert "stage 1 of 2 · params 1001" in page and "4 micro-batches, 1f1b" in page


def test_the_submit_form_offers_the_strategies_and_explains_an_impossible_one(user, nodes, client):
    from jobs.models import Job

    client.force_login(user)
    page = client.get("/jobs/new/").content.decode()
    for label in ("Tensor parallel", "Pipeline stages", "Gradient compression", "Synchronization",
                  "Batch balancing"):
        assert label in page
    r = client.post("/jobs/new/", {"spec": '{"name": "x", "parallel": {"tp": 2, "dp": 1}, '
                                           '"comm": {"compression": "topk"}}'})
    assert r.status_code == 400 and "gradient compression is a DDP comm hook" in r.content.decode()
    assert Job.objects.count() == 0
    r = client.post("/jobs/new/", {"spec": '{"name": "y", "parallel": {"tp": 2, "dp": 1}, '
                                           '"resources": {"nodes": 1, "procs_per_node": 2}}'})
    assert r.status_code == 302 and Job.objects.get().plan["strategy"] == "tp 2"


AUTO = {"chosen": {"dp": 1, "tp": 2, "pp": 1, "micro_batch": 8, "fsdp": False, "shard_optimizer": False,
                   "recompute": "none", "step_time_s": 0.0118, "memory_gb_per_device": 0.001, "tflops_per_device": 0.01,
                   "explain": "tp 2 splits the heads"},
        "runners_up": [{"label": "dp 2 · tp 1 · pp 1 · micro-batch 4", "step_time_s": 0.0121,
                        "why": "slower by 2.5% (0.0121 s vs 0.0118 s a step)"}],
        "candidates": 5, "searched": 6, "constants_source": "default (cpu)", "flops_per_step": 1.0e9}


def test_a_user_models_parallel_auto_is_planned_by_its_ranks_and_shown_on_the_page(user, nodes, sent, client,
                                                                                   django_capture_on_commit_callbacks):
    """The Launch carries the planner's inputs (this cluster's device facts, the constants); what rank
    0's run.prepare chose comes back in its rank_plan and becomes the job's plan.auto, as for a
    built-in job planned at submit. A job that did not ask for auto cannot write one."""
    user_job = submit(user, model=None, data=None, entrypoint={"script": "/opt/train.py"}, parallel="auto",
                      resources={"nodes": 1, "procs_per_node": 2})
    assert user_job.spec["parallel"] == "auto" and "run.prepare" in user_job.plan["source"]
    inputs = user_job.plan["auto_inputs"]
    assert inputs["device"]["name"] == "cpu" and inputs["constants"]["matmul_eff"]
    with django_capture_on_commit_callbacks(execute=True):
        attempt = start(user_job)
    launches = [c[2] for c in sent if c[0] == "launch"]
    assert launches and all(p["planner"] == inputs for p in launches)
    plain = submit(user, model=None, data=None, entrypoint={"script": "/opt/train.py"},
                   resources={"nodes": 1, "procs_per_node": 2})
    plain_attempt = start(plain)
    services.telemetry_ingest([], events=[{"kind": "rank_plan", "rank": 0, "attempt": a.pk, "strategy": "tp",
                                           "role": "tp rank 0 of 2", "auto": AUTO}
                                          for a in (attempt, plain_attempt)])
    user_job.refresh_from_db()
    plain.refresh_from_db()
    assert user_job.plan["auto"]["chosen"]["tp"] == 2 and user_job.plan["auto"]["device"]["name"] == "cpu"
    assert user_job.plan["source"].startswith("auto: run.prepare's best of 5 plans")
    assert "auto" not in plain.plan and "auto" not in (attempt.rank_plans or {}).get("0", {})
    client.force_login(user)
    page = client.get(f"/jobs/{user_job.pk}/").content.decode()
    assert "Chosen by the planner" in page and "tp 2 splits the heads" in page
    assert "slower by 2.5%" in page
