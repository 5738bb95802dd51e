"""`parallel: auto` at submit and the submit page's plan preview (jobs/autoplan.py): the planner's
best plan for the spec's GPT on this cluster is written into the stored spec, the job's plan keeps
the prediction and the runners-up, a spec that fits nowhere is a 400 naming the shortfall, and
POST /api/v1/plan/ {"spec": ...} answers what a submit would do."""
import pytest

from jobs import services
from trainyard.spec import SpecError, parse_job_spec

from .test_services import start, submit

pytestmark = pytest.mark.django_db

GPT = {"kind": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 256}


def test_auto_writes_the_best_plan_into_the_spec_and_keeps_the_prediction(user, nodes):
    job = submit(user, model=GPT, parallel="auto", resources={"nodes": 2, "procs_per_node": 2},
                 train={"global_batch": 32, "steps": 10})
    par, auto = job.spec["parallel"], job.plan["auto"]
    chosen = auto["chosen"]
    assert isinstance(par, dict) and par["dp"] * par["tp"] * par["pp"] == 4
    assert (par["dp"], par["tp"], par["pp"], par["fsdp"]) == (chosen["dp"], chosen["tp"], chosen["pp"], chosen["fsdp"])
    assert par["shard_optimizer"] == chosen["shard_optimizer"] and par["recompute"] == chosen["recompute"]
    # the micro-batch lands in grad_accum (pp 1) or microbatches (pp > 1)
    m = par["microbatches"] if par["pp"] > 1 else job.spec["train"]["grad_accum"]
    assert 32 // par["dp"] // m == chosen["micro_batch"]
    parse_job_spec(job.spec)  # the stored spec is a valid concrete spec
    assert job.plan["source"].startswith("auto: the planner's best of") and auto["candidates"] >= 2
    assert chosen["step_time_s"] > 0 and chosen["memory_gb_per_device"] > 0 and auto["flops_per_step"] > 0
    others = auto["runners_up"]
    assert others and all(r["why"].startswith(("slower by", "does not fit")) for r in others)
    slower = [r for r in others if r["step_time_s"] is not None]
    assert all(r["step_time_s"] >= chosen["step_time_s"] for r in slower)
    assert job.plan["mesh"] == {"pp": par["pp"], "dp": par["dp"], "tp": par["tp"]}
    attempt = start(job)  # runs through the normal path: the launch carries the concrete plan
    assert attempt is not None and attempt.job.spec["parallel"] == par


def test_auto_for_an_mlp_stays_data_parallel(user, nodes):
    job = submit(user, model={**GPT, "kind": "mlp"}, parallel="auto")
    assert job.spec["parallel"] == "auto" and "auto" not in job.plan and job.plan["dp"] == 2


def test_a_spec_that_fits_nowhere_is_refused_naming_the_smallest_shortfall(user, nodes, settings, client_for):
    settings.TRAINYARD_CPU_DEVICE_MEMORY_GB = 0.001
    big = {"kind": "gpt", "layers": 8, "hidden": 1024, "heads": 8, "seq_len": 256, "vocab": 8192}
    with pytest.raises(SpecError) as exc:
        submit(user, model=big, parallel="auto", train={"global_batch": 16})
    (msg,) = exc.value.errors["parallel"]
    assert msg.startswith("fits nowhere on this cluster: the closest plan (") and "GB more than the 0.001 GB" in msg
    resp = client_for(user).post("/api/v1/jobs/", {"name": "big", "model": big, "parallel": "auto",
                                                   "train": {"global_batch": 16}}, format="json")
    assert resp.status_code == 400 and "fits nowhere" in str(resp.json())
    from jobs.models import Job
    assert not Job.objects.exists()


def test_plan_preview_of_a_spec_matches_what_submit_chooses(user, nodes, client_for):
    spec = {"name": "p", "model": GPT, "parallel": "auto", "resources": {"nodes": 2, "procs_per_node": 2},
            "train": {"global_batch": 32}}
    resp = client_for(user).post("/api/v1/plan/", {"spec": spec}, format="json")
    assert resp.status_code == 200, resp.json()
    doc = resp.json()
    job = services.job_submit(user=user, spec=spec)
    assert doc["plans"][0] == job.plan["auto"]["chosen"]
    assert doc["runners_up"] == job.plan["auto"]["runners_up"] and doc["shortfall"] is None
    # an explicit plan: the planner's view of it rides along
    explicit = {**spec, "parallel": {"tp": 2}, "train": {"global_batch": 32}}
    doc = client_for(user).post("/api/v1/plan/", {"spec": explicit}, format="json").json()
    assert doc["spec_plan"]["tp"] == 2 and doc["spec_plan"]["dp"] == 2


def test_plan_preview_refuses_bad_specs_and_user_code(user, nodes, client_for, client):
    api = client_for(user)
    bad = api.post("/api/v1/plan/", {"spec": {"name": "x", "model": {**GPT, "heads": 3}}}, format="json")
    assert bad.status_code == 400 and "model" in str(bad.json())
    code = api.post("/api/v1/plan/", {"spec": {"name": "x", "entrypoint": {"module": "m"}}}, format="json")
    assert code.status_code == 400 and "built-in gpt" in str(code.json())
    assert client.post("/api/v1/plan/", {"spec": {"name": "x"}}, content_type="application/json").status_code in (401, 403)


def test_the_job_page_shows_the_chosen_plan_and_the_runners_up(user, nodes, client):
    job = submit(user, model=GPT, parallel="auto", resources={"nodes": 2, "procs_per_node": 2},
                 train={"global_batch": 32})
    client.force_login(user)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "Chosen by the planner" in page and job.plan["auto"]["chosen"]["explain"][:40] in page
    assert 'id="plan-pred-step"' in page and 'id="plan-runners"' in page and "slower by" in page
    assert client.get("/jobs/new/").content.decode().count('id="plan-preview"') == 1
