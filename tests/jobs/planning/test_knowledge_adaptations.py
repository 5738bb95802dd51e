"""The knowledge base's adaptation outcomes against the database (services, no processes): an OOM
re-plan is recorded and keeps the next `parallel: auto` job of that configuration off the plan
that ran out (an elastic job's on the node count it ran on); a bottleneck change recorded as kept
starts the next `adapt: auto` job of that configuration with it (a reverted one, an advise job,
another world, a change a spec rule refuses: not); the selector the profiling code reads; the
/knowledge/ page; odd entries never raise."""
import pytest

from jobs.models import AdaptationOutcome, Job
from jobs.planning import autoplan
from jobs.planning import selectors as planning_selectors
from jobs.planning.services.knowledge import knowledge_adaptation
from trainyard.spec import parse_job_spec

from tests.jobs.attempts.test_adapt import GPT, oom
from tests.jobs.runs.test_services import start, submit

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("ckpt_root", "relay_alive")]

TWO_BY_ONE = {"nodes": 2, "procs_per_node": 1}


def auto_job(user, model=GPT, resources=TWO_BY_ONE, **kw):
    return submit(user, model=model, train={"steps": 100, "global_batch": 16}, max_restarts=0, adapt="auto",
                  checkpoint={"every_steps": 10}, parallel="auto", resources=resources, **kw)


def chosen(job) -> dict:
    c = job.plan["auto"]["chosen"]
    return {k: c[k] for k in ("dp", "tp", "pp", "micro_batch", "fsdp", "shard_optimizer", "recompute")}


def test_a_plan_that_ran_out_of_memory_keeps_the_next_auto_job_of_that_shape_off_it(user, nodes, settings):
    first = auto_job(user)
    ran_out = chosen(first)
    oom(start(first))
    first.refresh_from_db()
    assert first.status == "QUEUED" and first.adaptations[0]["plan_before"] == ran_out
    rec = AdaptationOutcome.objects.get()
    assert (rec.job, rec.kind, rec.attempt_number, rec.model_kind, rec.layers, rec.global_batch) == (
        first, "oom", 1, "gpt", 2, 16)
    assert (rec.nodes, rec.procs_per_node, rec.device_name) == (2, 1, "cpu")
    assert {k: getattr(rec, k) for k in ran_out} == ran_out
    assert rec.limit_gb == first.adaptations[0]["predicted"]["limit_gb"] > 0
    assert rec.device_memory_gb == settings.TRAINYARD_CPU_DEVICE_MEMORY_GB  # a CPU slot's share

    second = auto_job(user)
    assert chosen(second) != ran_out  # the planner's former best is out: the next auto job starts elsewhere
    doc = autoplan.plan_spec(parse_job_spec(second.spec | {"parallel": "auto"}))
    [moved] = [r for r in doc["rejected"] if "ran_out" in r]
    assert {k: moved[k] for k in ran_out} == ran_out and moved["ran_out"]["job"] == first.pk
    assert f"ran out of memory in job {first.pk} (attempt 1)" in moved["reason"]
    assert doc["knowledge"]["ran_out"] == 1 and all(
        {k: p[k] for k in ran_out} != ran_out for p in doc["plans"])

    # another world (one node, two processes) and another shape are not steered by it
    other_world = auto_job(user, resources={"nodes": 1, "procs_per_node": 2})
    other_shape = auto_job(user, model={**GPT, "layers": 4})
    for job in (other_world, other_shape):
        doc = autoplan.plan_spec(parse_job_spec(job.spec | {"parallel": "auto"}))
        assert doc["knowledge"]["ran_out"] == 0 and not any("ran_out" in r for r in doc["rejected"])


def test_a_device_with_more_memory_than_the_plan_ran_out_on_may_run_it_again(user, nodes, settings):
    first = auto_job(user)
    ran_out = chosen(first)
    oom(start(first))
    rec = AdaptationOutcome.objects.get()
    settings.TRAINYARD_CPU_DEVICE_MEMORY_GB = rec.device_memory_gb * 2
    doc = autoplan.plan_spec(parse_job_spec(first.spec | {"parallel": "auto"}))
    assert doc["knowledge"]["ran_out"] == 0 and any({k: p[k] for k in ran_out} == ran_out for p in doc["plans"])


def bottleneck(source, outcome="kept", change=None, before=None, gain=0.35):
    """Record a bottleneck entry of `source`'s first attempt as the lead's adaptation writes it."""
    change = change or {"comm.compression": "powersgd"}
    entry = {"kind": "bottleneck", "class": "communication", "attempt_number": 1, "at": "2026-12-06T00:00:00",
             "evidence": {"shares": {"comm": 0.6}}, "change": change,
             "before": before or dict.fromkeys(change, "none"), "after": change,
             "predicted": {"gain": 0.4, "step_s": 0.12}, "step_s_before": 0.2, "step_s_after": 0.2 / (1 + gain),
             "measured_gain": gain, "outcome": outcome}
    return knowledge_adaptation(source, source.attempts.first(), entry)


def fixed_job(user, adapt="auto", parallel=None, resources=TWO_BY_ONE):
    return submit(user, model=GPT, train={"steps": 100, "global_batch": 16}, adapt=adapt, resources=resources,
                  **({"parallel": parallel} if parallel else {}))


def test_a_kept_change_starts_the_next_adapt_auto_job_with_it(user, nodes):
    source = fixed_job(user)
    start(source)
    rec = bottleneck(source)
    assert (rec.kind, rec.outcome, rec.change, rec.before, rec.measured_gain) == (
        "bottleneck", "kept", {"comm.compression": "powersgd"}, {"comm.compression": "none"}, 0.35)
    assert rec.predicted_gain == 0.4 and rec.bottleneck_class == "communication" and rec.nodes == 2
    assert bottleneck(source).pk == rec.pk and AdaptationOutcome.objects.count() == 1  # the same entry again
    [seen] = planning_selectors.adaptation_outcomes(source.spec)
    assert seen["change"] == {"comm.compression": "powersgd"} and seen["outcome"] == "kept" and seen["job"] == source.pk

    job = fixed_job(user)
    assert job.spec["comm"]["compression"] == "powersgd"
    ev = job.events.get(kind="adapted")
    assert ev.data == {"cause": "knowledge", "source_job": source.pk, "change": {"comm.compression": "powersgd"},
                       "before": {"comm.compression": "none"}, "after": {"comm.compression": "powersgd"},
                       "measured_gain": 0.35}
    assert "comm.compression none -> powersgd" in ev.message and f"job {source.pk}" in ev.message
    assert "+35%" in ev.message

    # an advise job, another world, a job whose spec no longer has the replaced value: unchanged
    advise = fixed_job(user, adapt="advise")
    other_world = fixed_job(user, resources={"nodes": 1, "procs_per_node": 2})
    for j in (advise, other_world):
        assert j.spec["comm"]["compression"] == "none" and not j.events.filter(kind="adapted").exists()
    # a spec rule refuses the change (compression is a DDP hook: not under fsdp): skipped, as submitted
    fsdp = fixed_job(user, parallel={"fsdp": True})
    assert fsdp.spec["comm"]["compression"] == "none" and not fsdp.events.filter(kind="adapted").exists()


def test_a_reverted_change_is_never_applied(user, nodes):
    source = fixed_job(user)
    start(source)
    bottleneck(source, outcome="reverted", change={"comm.compression": "topk"}, gain=-0.1)
    job = fixed_job(user)
    assert job.spec["comm"]["compression"] == "none" and not job.events.filter(kind="adapted").exists()
    # kept once, reverted later (newest decides): not applied either
    later = fixed_job(user)  # not started (the cluster is busy): recorded on its spec's world
    bottleneck(source, outcome="kept")
    bottleneck(later, outcome="reverted", gain=-0.05)
    job = fixed_job(user)
    assert job.spec["comm"]["compression"] == "none" and not job.events.filter(kind="adapted").exists()
    assert [o["outcome"] for o in planning_selectors.adaptation_outcomes(job.spec)] == ["reverted", "kept",
                                                                                        "reverted"]


def test_the_knowledge_page_lists_the_outcomes(user, staff, nodes, client):
    source = fixed_job(user)
    start(source)
    bottleneck(source)
    oomed = auto_job(user)
    oom(start(oomed))
    client.force_login(user)
    html = client.get("/knowledge/").content.decode()
    assert "Adaptation outcomes" in html and 'id="adaptation-table"' in html
    assert "comm.compression none → powersgd (communication-bound)" in html and "+35.0%" in html
    assert f'<a href="/jobs/{source.pk}/">' in html and 'data-kind="oom"' in html and "ran out of memory with" in html
    Job.objects.filter(pk=source.pk).delete()  # kept when its job is deleted (staff still sees it)
    assert AdaptationOutcome.objects.count() == 2
    assert client.get("/knowledge/").content.decode().count("data-outcome=") == 1
    client.force_login(staff)
    html = client.get("/knowledge/").content.decode()
    assert html.count("data-outcome=") == 2 and '<span class="muted">deleted</span>' in html


@pytest.mark.parametrize("entry", [
    None, [], "oom", {}, {"kind": "elastic"}, {"kind": "oom"}, {"kind": "oom", "plan_before": "dp 2"},
    {"kind": "oom", "plan_before": {"dp": 0, "tp": 1, "pp": 1, "micro_batch": 4}},
    {"kind": "bottleneck", "change": {"comm.compression": "powersgd"}},  # not yet kept or reverted
    {"kind": "bottleneck", "change": {}, "outcome": "kept"},
    {"kind": "bottleneck", "change": "powersgd", "outcome": "kept"},
])
def test_an_entry_that_records_nothing_writes_nothing(user, nodes, entry):
    job = fixed_job(user)
    assert knowledge_adaptation(job, start(job), entry) is None
    assert not AdaptationOutcome.objects.exists()


def test_recording_never_raises(user, nodes):
    job = fixed_job(user)
    # odd figures are left out, not refused
    rec = knowledge_adaptation(job, None, {"kind": "bottleneck", "change": {"data.workers": 4}, "outcome": "kept",
                                           "measured_gain": float("nan"), "predicted": "x", "attempt_number": -1})
    assert rec.measured_gain is None and rec.predicted_gain is None and rec.attempt_number is None
    Job.objects.filter(pk=job.pk).update(spec={"model": {"kind": "gpt", "layers": "many"}})
    job.refresh_from_db()
    assert knowledge_adaptation(job, None, {"kind": "bottleneck", "change": {"a": 1}, "outcome": "kept"}) is None
    assert knowledge_adaptation(job, object(), {"kind": "oom", "plan_before": {"dp": 1, "tp": 1, "pp": 1,
                                                                                 "micro_batch": 2}}) is None
    assert AdaptationOutcome.objects.count() == 1


def test_an_elastic_jobs_oom_is_recorded_on_the_node_count_it_ran_on(user, nodes):
    from tests.jobs.attempts.test_adapt import OOM_TEXT
    from jobs import services

    busy = submit(user, train={"steps": 1_000_000, "global_batch": 16}, resources={"nodes": 1, "procs_per_node": 2})
    start(busy)
    job = submit(user, model=GPT, train={"steps": 100, "global_batch": 16}, max_restarts=0, adapt="auto",
                 parallel={"recompute": "full"}, resources={"nodes": {"min": 1, "max": 2}, "procs_per_node": 1})
    attempt = start(job)
    [alloc] = attempt.allocations.select_related("node")
    services.attempt_node_exit(attempt.pk, node_name=alloc.node.name, result={
        "node": alloc.node.name, "exit_code": 1, "stopped": False,
        "failures": [{"rank": 0, "timestamp": 1.0, "message": OOM_TEXT, "traceback": OOM_TEXT}]})
    job.refresh_from_db()
    [entry] = job.adaptations
    rec = AdaptationOutcome.objects.get()
    assert (rec.nodes, rec.procs_per_node) == (1, 1)  # where it ran out, not its max
    assert {k: getattr(rec, k) for k in ("dp", "tp", "micro_batch")} == {
        k: entry["plan_before"][k] for k in ("dp", "tp", "micro_batch")}
    for n, ran_out in ((1, 1), (2, 0)):
        spec = parse_job_spec({**job.spec, "parallel": "auto", "resources": {"nodes": n, "procs_per_node": 1}})
        assert autoplan.plan_spec(spec)["knowledge"]["ran_out"] == ran_out
