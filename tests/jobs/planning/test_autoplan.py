"""`parallel: auto` at submit and the submit page's plan preview (jobs/planning/autoplan.py): the planner's
best plan for the spec's GPT on this cluster is written into the stored spec, the job's plan keeps
the prediction and the runners-up, a spec that fits nowhere is a 400 naming the shortfall, and
POST /api/v1/plan/ {"spec": ...} answers what a submit would do."""
import pytest

from jobs import services
from trainyard.spec import SpecError, parse_job_spec, validate_job_spec

from tests.jobs.runs.test_services import start, submit

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
    assert job.plan["planner"]["step_time_s"] == chosen["step_time_s"]  # the chosen plan's own figures
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
    job = services.job_submit(user=user, spec=services.submitted_spec(spec))
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


def _run(user, spec: dict, step_s: float, world: int):
    """A job run to its end with `step_s` a step on every rank (telemetry through the real ingest)."""
    from tests.jobs.planning.test_knowledge import finish

    job = services.job_submit(user=user, spec=services.submitted_spec(spec))
    attempt = start(job)
    services.telemetry_ingest([
        {"attempt": attempt.pk, "rank": r, "step": s, "ts": 1.0 + s, "loss": 1.0, "step_s": step_s, "mem_bytes": 1000}
        for s in range(1, 13) for r in range(world)], events=[])
    finish(attempt)
    return job


def test_a_plan_measured_here_beats_the_models_favourite(user, nodes):
    from jobs.models import KnowledgeRecord
    from trainyard.plan.job import spec_parallel

    spec = {"name": "a", "model": GPT, "parallel": "auto", "resources": {"nodes": 2, "procs_per_node": 1},
            "train": {"global_batch": 32, "steps": 12}}
    first = services.job_submit(user=user, spec=services.submitted_spec(spec))
    chosen, runner = first.plan["auto"]["chosen"], None
    assert chosen["step_time_source"] == "model" and first.plan["auto"]["knowledge"]["records"] == 0
    doc = services.job_submit(user=user, spec=services.submitted_spec(spec))  # the same again: nothing measured yet, same choice
    assert doc.plan["auto"]["chosen"] == chosen
    for queued in (first, doc):  # (they would hold the slots the measured run needs)
        services.job_cancel(queued, user=user)
    from jobs.planning.autoplan import plan_spec
    plans = plan_spec(validate_job_spec({**first.spec, "parallel": "auto"}))["plans"]
    runner = next(p for p in plans if (p["dp"], p["tp"], p["micro_batch"], p["fsdp"], p["shard_optimizer"])
                  != (chosen["dp"], chosen["tp"], chosen["micro_batch"], chosen["fsdp"], chosen["shard_optimizer"]))
    par, accum = spec_parallel(runner, 32)
    # the runner-up, run for real: measured at a tenth of the favourite's predicted step time
    _run(user, {**spec, "parallel": par, "train": {"global_batch": 32, "steps": 12, "grad_accum": accum}},
         chosen["step_time_s"] / 10, 2)
    assert KnowledgeRecord.objects.count() == 1
    again = services.job_submit(user=user, spec=services.submitted_spec(spec))
    best = again.plan["auto"]["chosen"]
    assert best["step_time_source"] == "measured" and best["measured_runs"] == 1
    assert best["step_time_s"] == pytest.approx(chosen["step_time_s"] / 10)
    assert (best["dp"], best["tp"], best["micro_batch"], best["fsdp"]) == (
        runner["dp"], runner["tp"], runner["micro_batch"], runner["fsdp"])
    assert "Measured on this cluster" in best["explain"]
    # the unmeasured plans are the model scaled by how it erred on that run (0.1 x, within bounds)
    k = again.plan["auto"]["knowledge"]
    assert k["measured_plans"] == 1 and k["scale_from"] == 1
    assert k["scale"] == pytest.approx(max(0.2, (chosen["step_time_s"] / 10) / runner["model_step_time_s"]), rel=1e-3)


@pytest.mark.parametrize("resources,sync", [({"nodes": 1, "procs_per_node": 1}, "allreduce"),
                                            ({"nodes": 1, "procs_per_node": 2}, "local_sgd"),
                                            ({"nodes": 2, "procs_per_node": 2}, "hierarchical"),
                                            ({"nodes": 2, "procs_per_node": 2}, "allreduce")])
def test_every_auto_choice_is_a_spec_the_runtime_accepts(user, nodes, resources, sync):
    """The planner searches only what the spec's rules let the runtime run (no ZeRO-1 over one
    replica or under model averaging, no tp x pp, FSDP only alone): each choice, and each
    runner-up, is a valid concrete spec."""
    from jobs.planning.autoplan import plan_spec
    from trainyard.plan.job import spec_parallel

    spec = {"name": "s", "model": GPT, "parallel": "auto", "resources": resources, "comm": {"sync": sync},
            "train": {"global_batch": 16}}
    job = submit(user, **{k: v for k, v in spec.items() if k != "name"})
    assert job.plan["auto"]["chosen"]["step_time_s"] > 0
    for p in plan_spec(validate_job_spec({**job.spec, "parallel": "auto"}))["plans"]:
        par, accum = spec_parallel(p, 16)
        parse_job_spec({**spec, "parallel": par, "train": {"global_batch": 16, "grad_accum": accum}})
