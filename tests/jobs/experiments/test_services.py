"""Experiments with the database (jobs/experiments/services): submit, the control worker's advance
(ASHA through the preemption path, ended trials, new trials, the end), stop, continue."""
import pytest

from jobs import services
from jobs.experiments.services import advance as advance_mod
from jobs.experiments.services import experiment_advance
from jobs.models import Experiment, ExperimentEvent, Job, JobEvent, Trial
from tests.jobs.attempts.test_fault import ok_exit, report_ckpt
from tests.jobs.experiments.conftest import SEARCH, TEMPLATE
from tests.jobs.runs.test_services import start
from trainyard.spec import SpecError

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("ckpt_root", "relay_alive")]


def losses(attempt, values: dict[int, float], rank=0, metric="loss"):
    """Samples as the relay stores them (its real ingest): {step: value} for one rank."""
    samples = [{"attempt": attempt.pk, "rank": rank, "step": step, "ts": 1000.0 + step,
                **({"loss": v} if metric == "loss" else {"loss": 9.9, "metrics": {metric: v}})}
               for step, v in values.items()]
    services.telemetry_ingest(samples, events=[])


def preempted_exit(attempt):
    """The ranks checkpointed and exited with PREEMPTED_EXIT_CODE (83) on both nodes."""
    for alloc in attempt.allocations.select_related("node"):
        services.attempt_node_exit(attempt.pk, node_name=alloc.node.name, result={
            "node": alloc.node.name, "exit_code": 83, "stopped": False, "failures": []})


def trials(e):
    return list(Trial.objects.filter(experiment=e).select_related("job").order_by("number"))


def second_behind_at_the_first_rung(e):
    """Both trials running; trial 0 reaches the step-10 rung first (1.0), trial 1 after it, worse
    (2.0): ASHA stops trial 1. Returns the trials and their attempts."""
    t0, t1 = trials(e)
    a0, a1 = start(t0.job), start(t1.job)
    losses(a0, {10: 1.0})
    experiment_advance(e.pk)
    losses(a1, {10: 2.0})
    experiment_advance(e.pk)
    return t0, t1, a0, a1


def test_submit_creates_the_first_trials_as_ordinary_jobs(submit_experiment, user, sent,
                                                          django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        e = submit_experiment(search={"max_trials": 5, "max_concurrent": 3})
    ts = trials(e)
    assert [t.number for t in ts] == [0, 1, 2]  # max_concurrent at once
    for t in ts:
        assert t.job.status == "QUEUED" and t.job.owner == user and t.job.name == f"lr search-t{t.number}"
        assert t.job.spec["train"]["lr"] == t.values["train.lr"] in (0.003, 1e-7)
        assert t.job.spec["train"]["steps"] == 40 and t.status == "running"
    assert e.search["space"] == SEARCH["space"] and e.spec == TEMPLATE and e.status == "running"
    assert ("tick",) in sent
    assert e.events.filter(kind="submitted").exists() and e.events.filter(kind="trial").count() == 3


@pytest.mark.parametrize("kw,field", [
    ({"search": {"space": {"train.lrx": {"choice": [1]}}}}, "search.space.train.lrx"),
    ({"search": {"algorithm": "grid", "space": {"train.lr": {"uniform": [0.1, 0.2]}}}}, "search.space.train.lr"),
    ({"search": {"space": {"model.layers": {"choice": [2, -1]}}}}, "search.space.model.layers"),
    ({"search": {"max_concurrent": 0}}, "search.max_concurrent"),
    ({"spec": {"name": "x", "train": {"steps": "many"}}}, "spec.train.steps"),
    ({"name": ""}, "name"),
    # job_submit refuses the trial (never fits the cluster): the experiment is not created either
    ({"spec": {"name": "x", "resources": {"nodes": 3}, "parallel": {"dp": 3}, "train": {"global_batch": 30}}},
     "resources"),
])
def test_bad_input_names_the_field_and_creates_nothing(submit_experiment, kw, field):
    with pytest.raises(SpecError) as info:
        submit_experiment(**kw)
    assert field in info.value.errors, info.value.errors
    assert (Experiment.objects.count(), Trial.objects.count(), Job.objects.count()) == (0, 0, 0)


def test_advance_ends_trials_and_makes_new_ones_until_max_trials_then_ends(submit_experiment, preempts):
    e = submit_experiment(search={"early_stopping": None})
    t0, t1 = trials(e)
    a0, a1 = start(t0.job), start(t1.job)
    losses(a0, {1: 3.0, 2: 2.5})
    assert experiment_advance(e.pk) == {"read": [0]}
    ok_exit(a0)
    done = experiment_advance(e.pk)
    assert done == {"trials_ended": [0], "created": [2]}
    t0.refresh_from_db()
    assert (t0.status, t0.metric, t0.steps) == ("succeeded", 2.5, 2)
    assert experiment_advance(e.pk) == {}  # a redelivered pass changes nothing
    ts = trials(e)
    a2 = start(ts[2].job)
    for a in (a1, a2):
        ok_exit(a)
    assert experiment_advance(e.pk) == {"trials_ended": [1, 2], "created": [3]}
    ok_exit(start(trials(e)[3].job))
    assert experiment_advance(e.pk)["ended"] == "succeeded"
    e.refresh_from_db()
    assert e.status == "succeeded" and e.finished_at and "4 succeeded" in e.status_reason
    ended = e.events.get(kind="ended")
    assert ended.data["best_job"] == t0.job_id and ended.data["best_metric"] == 2.5
    assert experiment_advance(e.pk) == {} and e.events.filter(kind="ended").count() == 1
    assert Trial.objects.filter(experiment=e).count() == 4


def test_asha_stops_the_worse_trial_through_the_preemption_path_and_it_can_continue(
        submit_experiment, preempts, ckpt_root, user, django_capture_on_commit_callbacks):
    e = submit_experiment()
    t0, t1 = trials(e)
    a0, a1 = start(t0.job), start(t1.job)
    losses(a0, {s: 3.0 - s * 0.1 for s in range(1, 12)})
    assert experiment_advance(e.pk) == {"read": [0]}  # the first at rung 0 goes on
    assert Trial.objects.get(pk=t0.pk).rung == 0
    losses(a1, {s: 5.5 for s in range(1, 11)})
    with django_capture_on_commit_callbacks(execute=True):
        done = experiment_advance(e.pk)
    assert done["early_stopped"] == [t1.number] and done["created"] == [2]  # its slots go to the next trial
    t1.refresh_from_db()
    assert t1.status == "early_stopped" and t1.rung == 0 and t1.rung_values == {"0": 5.5}
    assert "not in the top 1/2 of the 2 trials" in t1.status_reason
    a1.refresh_from_db()
    assert a1.stop_reason == "early_stop" and preempts == [(a1.pk, t1.status_reason)]
    assert Job.objects.get(pk=t1.job_id).status == "RUNNING"
    # the ranks checkpoint and exit like a preempted job's; the job ends (not back to the queue)
    ckpt = report_ckpt(ckpt_root, t1.job, a1, 10)
    preempted_exit(a1)
    a1.refresh_from_db()
    job = Job.objects.get(pk=t1.job_id)
    assert a1.outcome == "early_stopped" and job.status == "CANCELLED"
    assert "checkpoint at step 10" in job.status_reason
    assert JobEvent.objects.filter(job=job, kind="early_stopped", data__checkpoint=ckpt.pk).exists()
    assert experiment_advance(e.pk) == {}
    assert Trial.objects.get(pk=t1.pk).status == "early_stopped"
    # continued later: queued again, resuming from its checkpoint
    services.trial_continue(e, job_id=job.pk, user=user)
    job.refresh_from_db()
    assert job.status == "QUEUED" and Trial.objects.get(pk=t1.pk).status == "running"
    losses(a0, {s: 1.0 for s in range(12, 22)})  # trial 0 reaches rung 1 (step 20) first
    experiment_advance(e.pk)
    assert Trial.objects.get(pk=t0.pk).rung_values == {"0": 2.0, "1": 1.0}
    ok_exit(a0)
    experiment_advance(e.pk)
    attempt = start(job)
    assert attempt.number == 2 and attempt.resumed_from_id == ckpt.pk
    assert e.events.filter(kind="trial_continued").exists()
    # a person overruled ASHA: at the next rung it is behind again, and goes on
    losses(attempt, {s: 5.0 for s in range(11, 22)})
    done = experiment_advance(e.pk)
    assert "early_stopped" not in done and Trial.objects.get(pk=t1.pk).status == "running"
    assert Trial.objects.get(pk=t1.pk).rung_values == {"0": 5.5, "1": 5.0}


def test_early_stop_of_a_queued_trial_cancels_it_and_finishing_in_the_grace_period_succeeds(
        submit_experiment, preempts):
    e = submit_experiment()
    t0, t1, a0, a1 = second_behind_at_the_first_rung(e)
    assert Trial.objects.get(pk=t1.pk).status == "early_stopped"
    ok_exit(a1)  # it finished before it saw the stop: a finished trial
    experiment_advance(e.pk)
    assert Job.objects.get(pk=t1.job_id).status == "SUCCEEDED" and Trial.objects.get(pk=t1.pk).status == "succeeded"
    # a trial whose job is back in the queue (preempted by the scheduler) is cancelled at once
    t2 = trials(e)[2]
    Trial.objects.filter(pk=t2.pk).update(rung_values={"0": 9.0})
    experiment_advance(e.pk)
    t2.refresh_from_db()
    assert t2.status == "early_stopped" and Job.objects.get(pk=t2.job_id).status == "CANCELLED"


def test_a_crashed_pass_loses_nothing_and_the_next_suggests_the_same_trial_once(submit_experiment, monkeypatch):
    e = submit_experiment(search={"early_stopping": None, "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}}})
    t0, t1 = trials(e)
    ok_exit(start(t0.job))
    real = advance_mod.trial_create

    def crash(*a, **kw):  # the control worker dies after the trial's job was written, before commit
        real(*a, **kw)
        raise SystemExit("killed")
    monkeypatch.setattr(advance_mod, "trial_create", crash)
    with pytest.raises(SystemExit):
        experiment_advance(e.pk)
    assert Trial.objects.filter(experiment=e).count() == 2 and Job.objects.count() == 2
    assert Trial.objects.get(pk=t0.pk).status == "running"  # rolled back with the rest
    monkeypatch.setattr(advance_mod, "trial_create", real)
    assert experiment_advance(e.pk) == {"trials_ended": [0], "created": [2]}
    assert experiment_advance(e.pk) == {}
    ts = trials(e)
    assert [t.number for t in ts] == [0, 1, 2] and Job.objects.count() == 3
    assert len({t.values["train.lr"] for t in ts}) == 3


def test_stop_cancels_running_trials(submit_experiment, user, preempts):
    e = submit_experiment(search={"max_concurrent": 3})
    t0, t1, t2 = trials(e)
    start(t0.job)  # the tick starts two trials on the 4 slots; the third waits
    services.experiment_stop(e, user=user)
    e.refresh_from_db()
    assert e.status == "stopped" and [t.status for t in trials(e)] == ["cancelled"] * 3
    assert Job.objects.get(pk=t2.job_id).status == "CANCELLED"  # queued: at once
    assert Job.objects.get(pk=t0.job_id).status == "STOPPING"   # running: its processes stop
    assert e.events.filter(kind="ended").count() == 1
    assert experiment_advance(e.pk) == {} and Trial.objects.count() == 3
    from jobs.core.errors import TransitionError
    with pytest.raises(TransitionError):
        services.experiment_stop(e, user=user)


def test_continue_refuses_what_it_cannot_continue(submit_experiment, user):
    from jobs.core.errors import NotFound, TransitionError
    e = submit_experiment()
    t0, t1 = trials(e)
    with pytest.raises(TransitionError, match="only an early-stopped"):
        services.trial_continue(e, job_id=t0.job_id, user=user)
    with pytest.raises(NotFound):
        services.trial_continue(e, job_id=999999, user=user)
    Trial.objects.filter(pk=t0.pk).update(status="early_stopped")
    Job.objects.filter(pk=t0.job_id).update(status="CANCELLED")
    with pytest.raises(TransitionError, match="no checkpoint"):
        services.trial_continue(e, job_id=t0.job_id, user=user)
    assert Job.objects.get(pk=t0.job_id).status == "CANCELLED"


def test_a_metric_no_trial_reports_is_an_event_once(submit_experiment):
    e = submit_experiment(search={"metric": "val_loss"})
    t0, _ = trials(e)
    a0 = start(t0.job)
    losses(a0, {s: 1.0 for s in range(1, 9)})
    experiment_advance(e.pk)
    assert not e.events.filter(kind="metric_missing").exists()
    losses(a0, {s: 1.0 for s in range(9, 12)})
    experiment_advance(e.pk)
    losses(a0, {s: 1.0 for s in range(12, 14)})
    experiment_advance(e.pk)
    ev = ExperimentEvent.objects.filter(experiment=e, kind="metric_missing")
    assert ev.count() == 1 and "'val_loss'" in ev[0].message and "run.log(step, val_loss=...)" in ev[0].message


def test_user_metrics_from_run_log_drive_asha_in_max_mode(submit_experiment, preempts):
    e = submit_experiment(search={"metric": "accuracy", "mode": "max"})
    t0, t1 = trials(e)
    a0, a1 = start(t0.job), start(t1.job)
    losses(a0, {10: 0.9}, metric="accuracy")
    losses(a1, {10: 0.4}, metric="accuracy")
    done = experiment_advance(e.pk)
    assert done["early_stopped"] == [1]
    assert Trial.objects.get(pk=t0.pk).metric == 0.9


def test_attempts_check_task_advances_experiments(submit_experiment):
    from jobs import tasks
    e = submit_experiment(search={"early_stopping": None})
    t0, _ = trials(e)
    ok_exit(start(t0.job))
    out = tasks.attempts_check()
    assert out["experiments"][e.pk]["created"] == [2]


def test_the_experiment_ends_only_once_every_trials_job_has(submit_experiment, preempts, ckpt_root):
    e = submit_experiment(search={"max_trials": 2})
    t0, t1, a0, a1 = second_behind_at_the_first_rung(e)
    ok_exit(a0)
    experiment_advance(e.pk)
    # trial 1 is early_stopped but its job is still checkpointing: not the end yet
    assert Trial.objects.get(pk=t1.pk).status == "early_stopped" and Job.objects.get(pk=t1.job_id).status == "RUNNING"
    assert Experiment.objects.get(pk=e.pk).status == "running"
    report_ckpt(ckpt_root, t1.job, a1, 10)
    preempted_exit(a1)
    assert experiment_advance(e.pk)["ended"] == "succeeded"
    assert "1 succeeded, 1 early_stopped" in Experiment.objects.get(pk=e.pk).status_reason


def test_a_trial_whose_job_was_deleted_is_cancelled_and_replaced(submit_experiment):
    e = submit_experiment(search={"early_stopping": None})
    t0, _ = trials(e)
    Job.objects.filter(pk=t0.job_id).delete()
    assert experiment_advance(e.pk) == {"trials_ended": [0], "created": [2]}
    assert Trial.objects.get(pk=t0.pk).status == "cancelled"


def test_the_end_of_an_experiment_is_announced_to_notifications_after_commit(
        submit_experiment, user, sent, preempts, django_capture_on_commit_callbacks):
    e = submit_experiment()
    with django_capture_on_commit_callbacks(execute=True):
        services.experiment_stop(e, user=user)
    (call,) = [c for c in sent if c[0] == "notify" and c[1] == "experiment.ended"]
    fields = call[2]
    assert fields["user"] == e.owner_id and fields["team"] == e.team_id and fields["job"] is None
    assert fields["data"]["experiment"] == e.pk and fields["data"]["status"] == "stopped"
