"""The notification tasks run only from their own queue (control.notify, which only the control plane
can write): a node pushing one onto `control` cannot make the control plane POST or mail anything."""
import pytest

from jobs import services, tasks
from jobs.core.celery_app import NOTIFY_TASKS
from jobs.core.celery_app import app as control_app
from jobs.models import SecurityEvent
from trainyard.keys import CONTROL_QUEUE, NOTIFY_QUEUE

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("name", NOTIFY_TASKS)
def test_notify_tasks_are_routed_to_their_own_queue(name):
    assert isinstance(control_app.tasks[name], tasks.NotifyTask)
    assert control_app.amqp.router.route({}, name)["queue"].name == NOTIFY_QUEUE


def test_a_notify_task_from_the_control_queue_is_refused_and_counted(monkeypatch):
    ran = []
    monkeypatch.setattr(services, "delivery_try", lambda delivery_id: ran.append(delivery_id) or "delivered")
    task = tasks.notify_deliver
    for queue in (CONTROL_QUEUE, "control.beat"):
        task.push_request(delivery_info={"routing_key": queue}, called_directly=False, is_eager=False)
        try:
            assert task(5) is None
        finally:
            task.pop_request()
    assert ran == [] and SecurityEvent.objects.get(kind="notify_off_queue", node="queue:control").count == 1
    task.push_request(delivery_info={"routing_key": NOTIFY_QUEUE}, called_directly=False, is_eager=False)
    try:
        assert task(5) == "delivered" and ran == [5]
    finally:
        task.pop_request()


def test_each_worker_stamps_the_liveness_of_the_queues_it_serves(monkeypatch):
    """The notifications' worker loads the same app (and its ControlStamp bootstep): were it to stamp
    trainyard:alive:control, a dead control worker would look alive on /metrics. It stamps `notify`."""
    from types import SimpleNamespace

    from jobs.fleet import liveness

    stamped, scheduled = [], []
    monkeypatch.setattr(liveness, "stamp", stamped.append)
    timer = SimpleNamespace(call_repeatedly=lambda *a: scheduled.append(a) or "tref", cancel=lambda t: None)
    queues = control_app.amqp.queues
    saved = queues._consume_from
    try:
        for selected, expected in ((["control.notify"], ["notify"]), (["control", "control.beat"], ["control"]),
                                   (["control.beat"], [])):
            queues.select(selected)
            step = liveness.ControlStamp.__new__(liveness.ControlStamp)
            step.tref = None
            step.start(SimpleNamespace(app=control_app, timer=timer))
            assert stamped == expected and (step.tref == "tref") == bool(expected)
            stamped.clear()
    finally:
        queues._consume_from = saved
