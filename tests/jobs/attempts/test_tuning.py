"""adapt auto after a sustained bottleneck (services, DB, no processes): the recommendation is armed,
applied at the next checkpoint (the attempt stops like a rollback and the job resumes with the new
spec), measured on the next attempt, then kept when faster or reverted at its next checkpoint when
slower; every step is on the timeline and in Job.adaptations. adapt advise is never touched."""
import pytest

from jobs import services
from jobs.attempts.policy import tuning as policy
from jobs.attempts.services.profiling import _applied_result
from jobs.models import AdaptationOutcome, Attempt

from tests.jobs.attempts.test_fault import report_ckpt
from tests.jobs.runs.test_services import ok_result, start, submit

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("ckpt_root", "relay_alive")]

GPT = {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 256}
CHANGE = {"comm.compression": "bf16"}


def comm_bound(attempt, step_s=0.2, since=0, last=40):
    profile = {"class": "communication", "class_since_step": since,
               "shares": {"compute": 0.5, "communication": 0.45, "input": 0.05}, "window": {"step_s": step_s},
               "recommendation": {"kind": "compression", "change": CHANGE, "before": {"comm.compression": "none"},
                                  "predicted_gain": 0.4, "predicted_step_s": 0.14, "text": "compress gradients"}}
    Attempt.objects.filter(pk=attempt.pk).update(profile=profile, last_step=last)
    attempt.refresh_from_db()
    return profile


def stopped(attempt):
    for alloc in attempt.allocations.select_related("node"):
        services.attempt_node_exit(attempt.pk, node_name=alloc.node.name,
                                   result={**ok_result(alloc.node.name, attempt.pk), "stopped": True})


def measured(attempt, step_s):
    profile = {"class": "compute", "shares": {"compute": 0.9, "communication": 0.1, "input": 0}, "window": {"step_s": step_s}}
    _applied_result(attempt, profile)


@pytest.mark.parametrize("after_s, outcome", [(0.15, "kept"), (0.25, "reverted")])
def test_a_sustained_bottleneck_is_applied_at_a_checkpoint_measured_and_kept_or_reverted(
        user, nodes, ckpt_root, after_s, outcome):
    job = submit(user, model=GPT, train={"steps": 200, "global_batch": 16}, adapt="auto",
                 checkpoint={"every_steps": 10})
    first = start(job)
    report_ckpt(ckpt_root, job, first, 10)
    comm_bound(first, last=policy.SUSTAIN_STEPS + 5)
    assert services.attempts_tune() == {first.pk: "arm"}
    job.refresh_from_db()
    assert job.adaptations[0]["outcome"] == "waiting" and job.events.filter(kind="adapt_waiting").exists()
    assert services.attempts_tune() == {}  # the latest checkpoint (10) is older than the arming step
    report_ckpt(ckpt_root, job, first, 30)
    assert services.attempts_tune() == {first.pk: "apply"}
    job.refresh_from_db()
    assert job.status == "STOPPING" and job.spec["comm"]["compression"] == "bf16"
    [entry] = job.adaptations
    assert entry["outcome"] == "measuring" and entry["applied"] and entry["resume_step"] == 30
    ev = job.events.get(kind="adapted")
    assert ev.data["cause"] == "bottleneck" and ev.data["evidence"]["shares"]["communication"] == 0.45
    assert ev.data["before"] == {"comm.compression": "none"} and ev.data["after"] == CHANGE
    stopped(first)
    second = start(job)
    assert second.resumed_from.step == 30
    measured(second, after_s)
    Attempt.objects.filter(pk=second.pk).update(last_step=45)
    action = services.attempts_tune()[second.pk]
    job.refresh_from_db()
    if outcome == "kept":
        assert action == "keep" and job.adaptations[0]["outcome"] == "kept"
        assert job.adaptations[0]["measured_gain"] > 0 and job.spec["comm"]["compression"] == "bf16"
        assert job.events.filter(kind="adapt_kept").exists()
        assert AdaptationOutcome.objects.get(job=job).outcome == "kept"  # the next job of this shape starts with it
        return
    assert action == "revert_arm" and job.adaptations[0]["outcome"] == "reverting"
    report_ckpt(ckpt_root, job, second, 50)
    assert services.attempts_tune() == {second.pk: "revert"}
    job.refresh_from_db()
    assert job.spec["comm"]["compression"] == "none" and job.adaptations[0]["outcome"] == "reverted"
    assert job.events.filter(kind="adapt_reverted").exists()
    assert AdaptationOutcome.objects.get(job=job).outcome == "reverted"
    stopped(second)
    third = start(job)
    comm_bound(third, last=policy.SUSTAIN_STEPS + 60, since=50)
    # the profile policy never offers a change that measured slower again; and this one is not re-armed
    # while a revert stands: the job's history holds the reverted entry


def test_adapt_advise_is_never_tuned(user, nodes, ckpt_root):
    job = submit(user, model=GPT, train={"steps": 200, "global_batch": 16}, checkpoint={"every_steps": 10})
    attempt = start(job)
    report_ckpt(ckpt_root, job, attempt, 30)
    comm_bound(attempt, last=policy.SUSTAIN_STEPS + 5)
    assert services.attempts_tune() == {}
    job.refresh_from_db()
    assert job.adaptations == [] and job.status == "RUNNING"
