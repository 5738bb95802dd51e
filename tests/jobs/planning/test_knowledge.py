"""The knowledge base against the database: a record per ended attempt (any outcome, enough warm
steps), late samples, the nearest/best reads, the predictor at submit, GET /api/v1/knowledge/
(visibility, filters, 400s, the best section) and the /knowledge/ page."""
import pytest
from rest_framework.test import APIClient

from jobs.planning.services.knowledge import knowledge_record
from jobs.planning import selectors as planning_selectors
from jobs import services
from jobs.models import Job, KnowledgeRecord

from tests.jobs.runs.test_services import ok_result, start, submit

pytestmark = pytest.mark.django_db


def ingest(attempt, steps, step_s=0.1, world=2, mem=1_000_000):
    services.telemetry_ingest([
        {"attempt": attempt.pk, "rank": r, "step": s, "ts": 1.0 + s, "loss": 1.0, "step_s": step_s * (1 + r),
         "tokens_per_s": 16 * 128 / step_s, "mem_bytes": mem + r} for s in steps for r in range(world)], events=[])


def finish(attempt, code=0):
    for alloc in attempt.allocations.select_related("node"):
        services.attempt_node_exit(attempt.pk, node_name=alloc.node.name,
                                   result={**ok_result(alloc.node.name, attempt.pk), "exit_code": code})
    attempt.refresh_from_db()


def run_job(user, steps=12, step_s=0.1, **spec):
    job = submit(user, train={"steps": steps}, **spec)
    attempt = start(job)
    ingest(attempt, range(1, steps + 1), step_s)
    finish(attempt)
    return job, attempt


def test_a_finished_attempt_records_its_warm_steps_once(user, nodes):
    job, attempt = run_job(user)
    assert attempt.outcome == "succeeded"
    rec = KnowledgeRecord.objects.get()
    assert rec.job == job and rec.attempt == attempt
    assert rec.step_time_s == pytest.approx(0.2)  # the slower rank (rank 1: 2 x 0.1)
    assert rec.warm_steps == 9 and rec.mem_bytes == 1_000_001
    assert (rec.kind, rec.layers, rec.hidden, rec.global_batch, rec.nodes, rec.procs_per_node, rec.device_name) == (
        "gpt", 4, 128, 32, 2, 1, "cpu")
    assert (rec.dp, rec.tp, rec.pp, rec.micro_batch, rec.recompute, rec.shard_optimizer) == (2, 1, 1, 16, "none", False)
    assert rec.tokens_per_s == pytest.approx(32 * 128 / 0.2)
    # the user chose this plan; the planner predicted it at submit all the same (job.plan["planner"])
    assert rec.predicted_step_time_s == job.plan["planner"]["step_time_s"] > 0
    assert rec.predicted_memory_gb == job.plan["planner"]["memory_gb_per_device"] > 0
    # a duplicate exit report or a re-run of the writer changes nothing
    finish(attempt)
    knowledge_record(attempt)
    assert KnowledgeRecord.objects.count() == 1


def test_samples_that_arrive_after_the_end_update_the_record(user, nodes):
    job = submit(user, train={"steps": 20})
    attempt = start(job)
    ingest(attempt, range(1, 8))  # only 4 warm steps when the nodes report their exit
    finish(attempt)
    assert not KnowledgeRecord.objects.exists()
    ingest(attempt, range(8, 21), step_s=0.3)  # the relay commits the rest later
    rec = KnowledgeRecord.objects.get()
    assert rec.warm_steps == 17 and rec.step_time_s == pytest.approx(0.6)


def test_failed_and_preempted_attempts_record_too_but_not_with_too_few_steps(user, nodes):
    job = submit(user, train={"steps": 100}, max_restarts=0)
    attempt = start(job)
    ingest(attempt, range(1, 10))
    finish(attempt, code=1)
    assert attempt.outcome.startswith("failed") and KnowledgeRecord.objects.filter(attempt=attempt).exists()
    short = submit(user, train={"steps": 7})
    a2 = start(short)
    ingest(a2, range(1, 8))
    finish(a2)
    assert a2.outcome == "succeeded" and not KnowledgeRecord.objects.filter(attempt=a2).exists()


def test_the_planners_prediction_is_kept_beside_the_measurement(user, nodes):
    from jobs.models import Job

    job = submit(user, train={"steps": 10})
    Job.objects.filter(pk=job.pk).update(plan={**job.plan, "planner": {"step_time_s": 0.25, "memory_gb_per_device": 0.002}})
    attempt = start(job)
    ingest(attempt, range(1, 11))
    finish(attempt)
    rec = KnowledgeRecord.objects.get()
    assert rec.predicted_step_time_s == 0.25 and rec.predicted_memory_gb == 0.002
    body = APIClient()
    body.force_authenticate(user)
    r = body.get("/api/v1/knowledge/").json()["results"][0]
    assert r["error"]["step_time"] == pytest.approx(0.25)  # (0.25 - 0.2) / 0.2
    assert r["error"]["memory"] == pytest.approx(0.002 / 0.001000001 - 1)


def test_nearest_and_best_reads(user, nodes):
    run_job(user, step_s=0.1)
    run_job(user, step_s=0.05, model={"hidden": 256, "heads": 4})
    run_job(user, step_s=0.2, model={"layers": 8})
    cluster = {"nodes": 2, "devices_per_node": 1, "device": {"name": "cpu"}}
    near = planning_selectors.knowledge_nearest({"kind": "gpt", "layers": 4, "hidden": 192, "seq_len": 128,
                                                  "global_batch": 32}, cluster, limit=2)
    assert [(r.layers, r.hidden) for r in near] == [(4, 256), (4, 128)]  # 192/256 is nearer than 192/128
    assert near[0].distance < near[1].distance
    assert planning_selectors.knowledge_nearest({"kind": "gpt", "layers": 4}, {"device": "cuda"}) == []
    assert planning_selectors.knowledge_nearest({"kind": "mlp", "layers": 4}, cluster) == []
    best = planning_selectors.knowledge_best({"kind": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 128,
                                               "vocab": 256, "global_batch": 32}, cluster)
    assert best["plan"]["dp"] == 2 and best["runs"] == 1 and best["step_time_s"] == pytest.approx(0.2)
    assert planning_selectors.knowledge_best({"kind": "gpt", "layers": 3}, cluster) is None


def test_submit_predicts_from_the_nearest_record_when_no_run_had_the_same_spec(user, nodes):
    run_job(user, step_s=0.5, model={"hidden": 256, "heads": 4})  # a measured neighbour (another width)
    job = submit(user, train={"steps": 100}, model={"hidden": 256, "heads": 4}, checkpoint={"every_steps": 20})
    # same key as the measured one: its own history (a succeeded run) wins
    assert job.plan["prediction_source"] == "history:user"
    other = submit(user, train={"steps": 100, "global_batch": 64}, model={"hidden": 256, "heads": 4})
    assert other.plan["prediction_source"] == "knowledge: 1 run of nearest shape"
    assert other.predicted_s > 15 + 100 * 1.0 * 0.9  # 1.0 s measured (slowest rank), scaled up for 2x the batch


# ---------------------------------------------------------------- the API and the page

def test_the_api_needs_a_login():
    r = APIClient().get("/api/v1/knowledge/")
    assert r.status_code == 401


def test_records_of_other_teams_are_invisible_staff_sees_all(user, other, staff, teams, nodes, client_for):
    run_job(user)
    run_job(other, model={"layers": 2})
    mine = client_for(user).get("/api/v1/knowledge/").json()
    assert mine["count"] == 1 and mine["results"][0]["model"]["layers"] == 4
    theirs = client_for(other).get("/api/v1/knowledge/").json()
    assert theirs["count"] == 1 and theirs["results"][0]["model"]["layers"] == 2
    assert client_for(staff).get("/api/v1/knowledge/").json()["count"] == 2
    # the best section aggregates every record, without job ids or owners
    best = mine["best"]
    assert {b["model"]["layers"] for b in best} == {2, 4}
    assert all("job" not in b and "owner" not in b for b in best)
    row = mine["results"][0]
    assert row["measured"]["step_time_s"] == pytest.approx(0.2) and row["cluster"] == {
        "nodes": 2, "procs_per_node": 1, "world": 2, "device": "cpu"}
    planner = Job.objects.get(pk=row["job"]).plan["planner"]
    assert row["predicted"] == {"step_time_s": planner["step_time_s"], "memory_gb": planner["memory_gb_per_device"]}
    assert row["error"]["step_time"] == pytest.approx((planner["step_time_s"] - 0.2) / 0.2, abs=1e-3)


def test_a_team_mate_sees_the_teams_records(user, django_user_model, teams, nodes, client_for):
    run_job(user)
    mate = django_user_model.objects.create_user("carol", password="pw-carol-123")
    mate.groups.add(teams[0])
    assert client_for(mate).get("/api/v1/knowledge/").json()["count"] == 1


def test_filters_and_bad_filter_values(user, nodes, client_for):
    run_job(user)
    run_job(user, model={"kind": "mlp", "layers": 2})
    c = client_for(user)
    assert c.get("/api/v1/knowledge/?kind=mlp").json()["count"] == 1
    assert c.get("/api/v1/knowledge/?layers=4&hidden=128&device=cpu").json()["count"] == 1
    assert c.get("/api/v1/knowledge/?device=cuda").json()["count"] == 0
    assert c.get("/api/v1/knowledge/?kind=mlp").json()["best"][0]["model"]["kind"] == "mlp"
    for query, field in (("kind=rnn", "kind"), ("layers=0", "layers"), ("layers=-2", "layers"),
                         ("hidden=big", "hidden"), ("hidden=99999999999", "hidden"), ("device=%3Cscript%3E", "device")):
        r = c.get(f"/api/v1/knowledge/?{query}")
        assert r.status_code == 400, query
        assert list(r.json()["errors"]) == [field], r.json()
    r = c.get("/api/v1/knowledge/?kind=rnn&layers=x")
    assert set(r.json()["errors"]) == {"kind", "layers"}


def test_the_page_lists_records_best_plans_and_says_what_is_wrong(user, nodes, client):
    job, _ = run_job(user)
    client.force_login(user)
    html = client.get("/knowledge/").content.decode()
    assert 'href="/knowledge/"' in html and "Past configurations" in html
    assert f'data-job="{job.pk}"' in html and "200.0 ms" in html and "gpt 4×128, 4 heads" in html
    assert "dp 2, micro-batch 16" in html and "2×1 cpu" in html
    assert "Best known plan per model shape and cluster" in html and "1 run of 1 plan" in html
    r = client.get("/knowledge/?layers=zero")
    assert r.status_code == 400 and "layers: must be a whole number" in r.content.decode()
    client.logout()
    assert client.get("/knowledge/").status_code == 302


def test_the_calibrations_section_follows_the_model(user, staff, nodes, client):
    from jobs import models
    from jobs.planning.views import calibration_summary, evaluation_items

    assert evaluation_items({"spearman": 0.9123, "step_time": {"median_rel_error": 0.0712, "held_out": 6},
                             "ok": True, "note": "quick", "list": [1, 2]}) == [
        "spearman: 0.912", "step_time.median_rel_error: 0.0712", "step_time.held_out: 6", "ok: True", "note: quick"]
    assert evaluation_items(None) == []
    evaluation = {"held_out": [1, 4], "before": {"spearman": 0.5, "step_error_median": 0.41, "step_error_max": 0.9},
                  "after": {"spearman": 0.94, "step_error_median": 0.081, "step_error_max": 0.2, "per_run": []}}
    assert calibration_summary(evaluation) == ["Spearman 0.50 → 0.94", "step time error median 41% → 8%",
                                               "max 90% → 20%", "on 2 held-out runs"]
    assert calibration_summary({"spearman": 0.9}) == ["spearman: 0.9"]
    client.force_login(staff)
    html = client.get("/knowledge/").content.decode()
    if not hasattr(models, "Calibration"):  # the calibration part is not merged: no section
        assert 'id="calibrations"' not in html
        return
    models.Calibration.objects.create(device_name="cpu", kind="cpu", constants={}, measurements={}, peak_tflops=0.2,
                                      evaluation=evaluation, node="node-a")
    html = client.get("/knowledge/").content.decode()
    assert 'id="calibrations"' in html and "Spearman 0.50 → 0.94" in html and 'id="calibrate-form"' in html
    client.force_login(user)
    assert 'id="calibrate-form"' not in client.get("/knowledge/").content.decode()  # staff only


def test_the_device_type_is_what_the_nodes_reported_for_the_slots_used(user, nodes):
    from jobs.models import Node
    from jobs.planning.services.knowledge import device_name

    _, attempt = run_job(user)
    assert device_name(attempt, "cpu") == "cpu"
    assert device_name(attempt, "cuda") == "cuda"  # no node reported a CUDA name
    Node.objects.update(devices=[{"kind": "cuda", "index": 0, "name": "NVIDIA H200"},
                                 {"kind": "cuda", "index": 1, "name": "NVIDIA A100-SXM4-80GB"}])
    slots = {a.slot_ids[0] for a in attempt.allocations.all()}
    expected = {0: "NVIDIA H200", 1: "NVIDIA A100-SXM4-80GB"}
    assert len(slots) == 1 and device_name(attempt, "cuda") == expected[slots.pop()]


def test_a_long_attempt_is_measured_over_its_newest_steps(user, nodes, monkeypatch):
    from jobs.planning.services import knowledge as writer

    monkeypatch.setattr(writer, "WINDOW_STEPS", 12)
    job = submit(user, train={"steps": 40})
    attempt = start(job)
    ingest(attempt, range(1, 21), step_s=0.5)
    ingest(attempt, range(21, 41), step_s=0.1)
    finish(attempt)
    rec = KnowledgeRecord.objects.get()
    assert rec.warm_steps == 9 and rec.step_time_s == pytest.approx(0.2)  # steps 29-40, first 3 of them left out
