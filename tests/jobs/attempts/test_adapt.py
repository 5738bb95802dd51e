"""adapt auto after an OOM (services, DB, no processes): the job is re-planned to a plan that needs
less memory and requeued from its checkpoint without spending a restart; the history, the
"adapted" event and its figures; adapt advise and adapt_max keep today's failure; no plan left
fails with the closest plan and its shortfall; the knowledge base steers the next auto job."""
import pytest

from jobs import services
from jobs.models import Job

from tests.jobs.attempts.test_fault import report_ckpt
from tests.jobs.runs.test_services import start, submit

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("ckpt_root", "relay_alive")]

GPT = {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 256}
OOM_TEXT = ("RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 167772160 bytes. Error code 12 (Cannot allocate memory)")


def oom(attempt):
    for n in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=n, result={
            "node": n, "exit_code": 1, "stopped": False, "failures": [
                {"rank": 0, "timestamp": 1.0, "message": OOM_TEXT, "traceback": "Traceback ...\n" + OOM_TEXT}]
            if n == "node-a" else []})


def gpt_job(user, **kw):
    return submit(user, model=GPT, train={"steps": 100, "global_batch": 16}, max_restarts=0,
                  checkpoint={"every_steps": 10}, parallel={"recompute": "full"}, **kw)


def test_oom_with_adapt_auto_replans_with_a_smaller_micro_batch_and_requeues_free(user, nodes, ckpt_root):
    job = gpt_job(user, adapt="auto")
    assert job.spec["train"]["grad_accum"] == 1
    attempt = start(job)
    report_ckpt(ckpt_root, job, attempt, 10)
    oom(attempt)
    job.refresh_from_db()
    assert job.status == "QUEUED" and job.restarts == 0  # max_restarts 0: the first OOM of a plan is free
    # recompute was already on: the next rung is a smaller micro-batch, same global batch
    assert job.spec["parallel"]["recompute"] == "full" and job.spec["train"]["global_batch"] == 16
    assert job.spec["train"]["grad_accum"] == 2
    [entry] = job.adaptations
    assert entry["kind"] == "oom" and entry["rung"] == "micro-batch" and entry["counted"] is False
    assert entry["plan_before"]["micro_batch"] == 8 and entry["plan_after"]["micro_batch"] == 4
    assert entry["before"] == {"train.grad_accum": 1} and entry["after"] == {"train.grad_accum": 2}
    p = entry["predicted"]
    assert p["memory_gb_after"] < p["memory_gb_before"] and p["step_time_s_after"] > 0
    assert "DefaultCPUAllocator" in entry["evidence"] and entry["resume_step"] == 10
    ev = job.events.get(kind="adapted")
    assert ev.data["plan_after"] == entry["plan_after"] and "re-planned" in ev.message
    assert job.plan["planner"]["memory_gb_per_device"] == p["memory_gb_after"]
    # the next attempt resumes from the checkpoint with the new spec
    second = start(job)
    assert second.resumed_from.step == 10 and job.status == "RUNNING"


def test_oom_with_adapt_advise_fails_with_the_suggestion(user, nodes):
    job = gpt_job(user)
    oom(start(job))
    job.refresh_from_db()
    assert job.status == "FAILED" and "recompute" in job.status_reason and job.adaptations == []


def test_adapt_max_reached_fails_as_today(user, nodes):
    job = gpt_job(user, adapt="auto", adapt_max=1)
    oom(start(job))
    job.refresh_from_db()
    assert job.status == "QUEUED" and len(job.adaptations) == 1
    oom(start(job))
    job.refresh_from_db()
    assert job.status == "FAILED" and len(job.adaptations) == 1
    assert job.events.filter(kind="adapt_skipped").get().data["reason"].endswith("its adapt_max")


def test_no_plan_left_fails_with_the_closest_plan_and_its_shortfall(user, nodes):
    job = gpt_job(user, adapt="auto", adapt_max=50)
    while job.status == "QUEUED":
        oom(start(job))
        job.refresh_from_db()
    assert job.status == "FAILED" and "the closest" in job.status_reason and "more than the" in job.status_reason
    failed = job.events.get(kind="failed")
    assert failed.data["shortfall_gb"] >= 0 and failed.data["closest"]["dp"] >= 1
    rungs = [a["rung"] for a in job.adaptations]
    assert rungs[0] == "micro-batch" and len(rungs) >= 2
    mems = [a["predicted"]["memory_gb_after"] for a in job.adaptations]
    assert mems == sorted(mems, reverse=True) and len(set(mems)) == len(mems)  # each step needs less


def test_a_revert_back_to_a_plan_that_ran_out_counts_against_max_restarts(user, nodes):
    job = gpt_job(user, adapt="auto")
    oom(start(job))
    job.refresh_from_db()
    first = job.adaptations[0]
    # put the plan that ran out back (as a revert would) and run out again: not free this time
    spec = {**job.spec, "train": {**job.spec["train"], "grad_accum": 1}}
    Job.objects.filter(pk=job.pk).update(spec=spec)
    oom(start(job))
    job.refresh_from_db()
    assert job.status == "FAILED" and len(job.adaptations) == 1 and first["counted"] is False


def test_an_elastic_job_is_re_planned_with_its_dp_still_following_the_node_count(user, nodes, ckpt_root):
    job = submit(user, model=GPT, train={"steps": 100, "global_batch": 16}, max_restarts=0, adapt="auto",
                 checkpoint={"every_steps": 10}, parallel={"recompute": "full"},
                 resources={"nodes": {"min": 1, "max": 2}, "procs_per_node": 1})
    oom(start(job))
    job.refresh_from_db()
    assert job.status == "QUEUED" and job.spec["parallel"]["dp"] is None
    assert job.spec["train"]["grad_accum"] == 2 and job.plan.get("replanned")
    second = start(job)  # the next attempt runs the re-planned spec at the count it gets
    assert second.resumed_from is None and job.status == "RUNNING" and second.allocations.count() == 2
