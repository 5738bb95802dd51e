"""From the writers to the deliveries: each hooked writer hands its event over after commit (the
`sent` fixture records the send), and notify_fanout makes one delivery per subscription that may
hear it: own and team's jobs, staff events to staff only."""
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from jobs import services
from jobs.attempts.services.events import job_event
from jobs.core.dispatch import send_notify as real_send_notify  # imported before the `sent` fixture patches it
from jobs.models import Delivery, Node, Subscription
from jobs.notify import services as notify
from tests.jobs.runs.test_services import start, submit

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("ckpt_root", "relay_alive")]


def notified(sent, event=None):
    return [c[2] | {"event": c[1]} for c in sent if c[0] == "notify" and (event is None or c[1] == event)]


def subscribe(user, events, team=None):
    return Subscription.objects.create(user=user, team=team, channel="webhook", url="http://127.0.0.1:9/h",
                                       events=events, secret_salt="s")


def fan(message) -> set[int]:
    return set(Delivery.objects.filter(pk__in=notify.notify_fanout(message)).values_list("subscription_id", flat=True))


def fail_user_error(attempt):
    for n in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=n, result={
            "node": n, "exit_code": 1, "stopped": False, "failures": [
                {"rank": 0, "timestamp": 1.0, "message": "ValueError: bad lr", "traceback": ""}] if n == "node-a" else []})


def test_a_failed_job_reaches_its_owner_and_its_team_not_others(user, other, staff, teams, nodes, sent,
                                                                django_capture_on_commit_callbacks):
    vision, nlp = teams
    mine, team, bobs, root = (subscribe(user, ["job.ended"]), subscribe(user, ["job.ended"], vision),
                              subscribe(other, ["job.ended"]), subscribe(staff, ["job.ended", "node.lost"]))
    hung_only = subscribe(user, ["job.hung"])
    other.groups.add(nlp)
    with django_capture_on_commit_callbacks(execute=True):
        job = submit(user, max_restarts=0)
        fail_user_error(start(job))
    (message,) = notified(sent, "job.ended")
    assert (message["job"], message["kind"], message["failure_class"]) == (job.pk, "failed", "user_error")
    assert fan(message) == {mine.pk, team.pk}
    d = Delivery.objects.get(subscription=mine)
    assert d.text.startswith(f'job {job.pk} "t" failed (user_error)') and d.body["job"]["owner"] == "alice"
    assert not Delivery.objects.filter(subscription__in=[bobs, root, hung_only]).exists()


def test_the_fanout_sends_each_first_try_after_commit(user, nodes, sent, django_capture_on_commit_callbacks):
    sub = subscribe(user, ["job.ended"])
    job = submit(user)
    with django_capture_on_commit_callbacks(execute=True):
        ids = notify.notify_fanout({"event": "job.ended", "job": job.pk, "kind": "cancelled", "message": ""})
    assert ids == list(Delivery.objects.filter(subscription=sub).values_list("pk", flat=True))
    assert [c for c in sent if c[0] == "delivery"] == [("delivery", ids[0], 0)]


@pytest.mark.parametrize("kind, event", [("succeeded", "job.ended"), ("cancelled", "job.ended"),
                                         ("hang_detected", "job.hung"), ("restart", "job.restarted"),
                                         ("running", None), ("checkpoint_pinned", None)])
def test_which_job_events_are_notifications(user, nodes, sent, django_capture_on_commit_callbacks, kind, event):
    job = submit(user)
    with transaction.atomic():
        job_event(job, kind, "why")
        assert not notified(sent)  # nothing before the commit
    with django_capture_on_commit_callbacks(execute=True):
        job_event(job, kind, "why")
    assert [m["event"] for m in notified(sent)] == ([event] if event else [])


def test_a_lost_node_is_heard_by_staff_only(user, staff, nodes, sent, healthy_control_plane, settings,
                                            django_capture_on_commit_callbacks):
    root, alice = subscribe(staff, ["node.lost"]), subscribe(user, ["job.ended", "quota.changed"])
    Node.objects.filter(name="node-b").update(last_heartbeat=timezone.now() - timedelta(hours=1))
    with django_capture_on_commit_callbacks(execute=True):
        assert services.nodes_check() == ["node-b"]
    (message,) = notified(sent, "node.lost")
    assert message["node"] == "node-b" and "no heartbeat since" in message["reason"]
    assert fan(message) == {root.pk}
    assert Delivery.objects.get(subscription=root).body["node"]["status"] == "LOST"
    assert alice.pk not in fan(message | {"event": "node.quarantined"})


def test_a_quota_change_is_heard_by_the_team(user, other, staff, teams, sent, django_capture_on_commit_callbacks):
    alice, bob = subscribe(user, ["quota.changed"]), subscribe(other, ["quota.changed"])
    with django_capture_on_commit_callbacks(execute=True):
        services.quotas_update(actor=staff, entries={"team": "vision", "max_slots": 4})
        services.quotas_update(actor=staff, entries={"team": "vision", "max_slots": 2})
    first, second = notified(sent, "quota.changed")
    assert fan(second) == {alice.pk}
    assert Delivery.objects.get(subscription=alice).text == "quota of team:vision: max_slots 4 -> 2"
    assert fan(first) == {alice.pk} and not Delivery.objects.filter(subscription=bob).exists()


def test_notify_event_is_sent_after_commit_and_reaches_the_owner(user, other, sent, django_capture_on_commit_callbacks):
    alice, bob = subscribe(user, ["experiment.ended"]), subscribe(other, ["experiment.ended"])
    with pytest.raises(ValueError, match="unknown notification event"):
        notify.notify_event("experiment.done", user=user, data={})
    with django_capture_on_commit_callbacks(execute=True):
        with transaction.atomic():
            notify.notify_event("experiment.ended", user=user, data={
                "experiment": 3, "name": "lr sweep", "status": "SUCCEEDED", "best": {"job": 9, "metric": 1.25}})
            assert not notified(sent)
    (message,) = notified(sent)
    assert fan(message) == {alice.pk}
    d = Delivery.objects.get(subscription=alice)
    assert d.text == 'experiment 3 "lr sweep" ended: SUCCEEDED, best 1.25 (job 9)' and d.body["data"]["experiment"] == 3
    assert not Delivery.objects.filter(subscription=bob).exists()


def test_a_send_failure_never_fails_the_writer(user, nodes, monkeypatch, django_capture_on_commit_callbacks):
    """dispatch.send_notify itself (not the fixture's recorder) with a broker that refuses."""
    from jobs.core import celery_app, dispatch

    tried = []

    def refuse(*args, **kwargs):
        tried.append(args[0])
        raise OSError("connection refused")

    monkeypatch.setattr(celery_app.app, "send_task", refuse)
    monkeypatch.setattr(dispatch, "send_notify", real_send_notify)
    job = submit(user)
    with django_capture_on_commit_callbacks(execute=True):
        job_event(job, "succeeded", "done")  # no exception
    assert job.events.filter(kind="succeeded").exists() and tried == ["jobs.tasks.notify_fanout"]


def test_unknown_or_vanished_subjects_fan_out_to_nothing(user):
    subscribe(user, list(("job.ended",)))
    assert notify.notify_fanout({"event": "job.exploded"}) == []
    assert notify.notify_fanout({"event": "job.ended", "job": 999999, "kind": "failed"}) == []
    assert notify.notify_fanout({"event": "node.lost", "node": "nope"}) == []


def test_each_subscription_keeps_only_its_newest_deliveries(user, monkeypatch):
    from jobs.notify.services import fanout

    monkeypatch.setattr(fanout, "KEEP_DELIVERIES", 3)
    sub, other_sub = subscribe(user, ["experiment.ended"]), subscribe(user, ["job.ended"])
    kept = Delivery.objects.create(subscription=other_sub, event="job.ended", text="x")
    ids = [notify.notify_fanout({"event": "experiment.ended", "user": user.pk, "data": {"text": str(i)}})[0]
           for i in range(5)]
    assert list(Delivery.objects.filter(subscription=sub).values_list("id", flat=True)) == ids[:-4:-1]
    assert Delivery.objects.filter(pk=kept.pk).exists()
