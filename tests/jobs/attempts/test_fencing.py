"""Issue 16, section 3, fencing: a node written off as LOST may still run its ranks behind a
partition. The node check fences the attempt at the last step it accepted: the fence goes to Redis
for the ranks (dispatch.fence; trainyard/sdk/reporter.py exits on it), the relay drops the attempt's
later samples, and checkpoint_register (reports and the on-disk reconcile alike) refuses its later
checkpoints, so neither a step trained twice nor a stale resume point enters the job's line."""
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from jobs import services
from jobs.models import Attempt, Checkpoint, Job, MetricSample, Node

from tests.jobs.runs.test_consumers import sample
from tests.jobs.attempts.test_fault import report_ckpt, write_ckpt
from tests.jobs.runs.test_services import start, submit

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("ckpt_root", "relay_alive", "healthy_control_plane")]


def lose_node_b(attempt, django_capture_on_commit_callbacks):
    Node.objects.filter(name="node-b").update(last_heartbeat=timezone.now() - timedelta(seconds=60))
    with django_capture_on_commit_callbacks(execute=True):
        assert services.nodes_check() == ["node-b"]
    attempt.refresh_from_db()
    return attempt


def test_a_lost_nodes_attempt_is_fenced_at_its_last_accepted_step(user, nodes, sent, ckpt_root,
                                                                  django_capture_on_commit_callbacks):
    job = submit(user, checkpoint={"every_steps": 10, "keep": 5})
    attempt = start(job)
    services.telemetry_ingest([sample(attempt.pk, r, s) for s in range(1, 13) for r in (0, 1)], events=[])
    with django_capture_on_commit_callbacks(execute=True):
        good = report_ckpt(ckpt_root, job, attempt, 10)
    attempt = lose_node_b(attempt, django_capture_on_commit_callbacks)
    assert attempt.fenced_step == 12
    assert ("fence", attempt.pk, "node_lost:node-b") in sent
    assert job.events.filter(kind="fenced", attempt=attempt).count() == 1

    # Behind the partition the ranks trained on: steps 13-20 and a checkpoint at 20 reach the relay
    # (or lie on the shared disk for the reconcile) after the fence.
    services.telemetry_ingest([sample(attempt.pk, r, s) for s in range(11, 21) for r in (0, 1)], events=[])
    assert MetricSample.objects.filter(attempt=attempt).order_by("-step").first().step == 12
    assert Job.objects.get(pk=job.pk).step == 12
    assert Attempt.objects.get(pk=attempt.pk).last_step == 12
    stale = [write_ckpt(ckpt_root, job, attempt, 20), write_ckpt(ckpt_root, job, attempt, 30)]
    with django_capture_on_commit_callbacks(execute=True):
        services.telemetry_ingest([], events=[{"kind": "checkpoint", "rank": 0, "attempt": attempt.pk, "step": 20,
                                               "path": str(stale[0]), "size_bytes": 100, "blocking_s": 0.01,
                                               "save_s": 0.2}])
    with django_capture_on_commit_callbacks(execute=True):
        assert services.checkpoints_reconcile(job) == 0
    assert list(Checkpoint.objects.filter(job=job).values_list("step", flat=True)) == [10]
    assert not any(d.exists() for d in stale)  # refused and deleted: no stale resume point on disk either
    assert Path(good.path).is_dir()  # the checkpoint before the fence is kept
    assert Checkpoint.objects.get(job=job).pk == good.pk

    # Fencing is once: a second write-off (the other node lost too) keeps the first fence.
    Node.objects.filter(name="node-a").update(last_heartbeat=timezone.now() - timedelta(seconds=60))
    with django_capture_on_commit_callbacks(execute=True):
        services.nodes_check()
    assert Attempt.objects.get(pk=attempt.pk).fenced_step == 12


def test_an_attempt_not_fenced_keeps_its_late_data(user, nodes, ckpt_root, django_capture_on_commit_callbacks):
    """Late data of an attempt that ended normally (stopped, preempted) is still taken in."""
    job = submit(user, checkpoint={"every_steps": 10, "keep": 5})
    attempt = start(job)
    Attempt.objects.filter(pk=attempt.pk).update(status=Attempt.Status.ENDED, outcome="cancelled")
    services.telemetry_ingest([sample(attempt.pk, 0, s) for s in (1, 2, 3)], events=[])
    with django_capture_on_commit_callbacks(execute=True):
        report_ckpt(ckpt_root, job, attempt, 3)
    assert MetricSample.objects.filter(attempt=attempt).count() == 3
    assert Checkpoint.objects.filter(job=job).count() == 1
