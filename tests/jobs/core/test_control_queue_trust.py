"""What the control worker trusts from its queues (issue 21, section 4). Every node's Redis user may
LPUSH onto `control`, so anything arriving there may be a node's: before, a node could push the
periodic tasks (schedule_tick, nodes_check, ... unsigned, run at once) and Celery's builtins
(`celery.map` runs any registered task with arguments of the sender's choosing). Now beat's tasks go
to `control.beat`, which only the control plane can write, and run only from there, and the builtins
are not registered. tests/integration/test_bus_acl_procs.py does the same through a real control
worker."""
from __future__ import annotations

import pytest

from jobs import services, tasks
from jobs.core.celery_app import BEAT_TASKS, CONTROL_ONLY_TASKS, NOTIFY_TASKS
from jobs.core.celery_app import app as control_app
from jobs.models import SecurityEvent
from trainyard.keys import CONTROL_BEAT_QUEUE, CONTROL_QUEUE
from trainyard.launch import (CALIBRATION_REPORT_TASK, HEARTBEAT_TASK, NODE_EXIT_TASK, RANKS_TASK,
                              SCHEDULE_TICK_TASK)

pytestmark = pytest.mark.django_db


def run_as_delivered(task, queue: str):
    """Run `task` as the control worker would after popping it from `queue` (the request Celery's
    tracer pushes; trainyard.celery_redis stamps the queue into delivery_info)."""
    task.push_request(delivery_info={"exchange": "", "routing_key": queue}, called_directly=False, is_eager=False)
    try:
        return task()
    finally:
        task.pop_request()


def test_a_periodic_task_from_the_control_queue_is_refused_and_counted(monkeypatch):
    ran = []
    monkeypatch.setattr(services, "schedule_tick", lambda: ran.append("tick") or [])
    assert run_as_delivered(tasks.schedule_tick, CONTROL_QUEUE) is None
    assert run_as_delivered(tasks.schedule_tick, "node.gpu-1") is None
    assert ran == []
    row = SecurityEvent.objects.get(kind="periodic_on_control", node="queue:control")
    assert row.count == 1 and SCHEDULE_TICK_TASK in row.detail
    assert run_as_delivered(tasks.schedule_tick, CONTROL_BEAT_QUEUE) == [] and ran == ["tick"]
    assert tasks.schedule_tick() == [] and ran == ["tick", "tick"]  # called in-process: runs


@pytest.mark.parametrize("name", BEAT_TASKS + CONTROL_ONLY_TASKS)
def test_every_periodic_task_is_beat_only_and_routed_to_control_beat(name):
    task = control_app.tasks[name]
    assert isinstance(task, tasks.BeatTask)
    assert control_app.amqp.router.route({}, name)["queue"].name == CONTROL_BEAT_QUEUE
    assert run_as_delivered(task, CONTROL_QUEUE) is None


def test_the_reports_still_come_on_the_control_queue():
    for name in (HEARTBEAT_TASK, RANKS_TASK, NODE_EXIT_TASK):
        assert not isinstance(control_app.tasks[name], tasks.BeatTask)
        assert control_app.amqp.router.route({}, name)["queue"].name == CONTROL_QUEUE


def test_beat_schedules_only_beat_tasks_and_nothing_of_celerys():
    from controlplane.celery import app

    assert {e["task"] for e in app.conf.beat_schedule.values()} == set(BEAT_TASKS)
    assert app.conf.result_expires is None  # else beat adds celery.backend_cleanup nightly


def test_each_app_registers_only_its_own_tasks():
    import workers.tasks  # noqa: F401  (what the agent's worker imports: its `include`)
    from workers.celery_app import app as node_app

    assert sorted(control_app.tasks) == sorted({*BEAT_TASKS, *CONTROL_ONLY_TASKS, HEARTBEAT_TASK, RANKS_TASK, NODE_EXIT_TASK,
                                                CALIBRATION_REPORT_TASK, *NOTIFY_TASKS})
    assert sorted(node_app.tasks) == ["workers.tasks.node_calibrate", "workers.tasks.node_launch",
                                      "workers.tasks.node_stop"]
