"""The bus contract (trainyard.keys, trainyard.launch): the JSON each message puts on the wire is
the one the other side has always read, both sides name keys and directories alike, and each
task name is served by exactly the Celery app of the side that owns its queue."""
from __future__ import annotations

from pathlib import Path

import pytest

from trainyard import keys
from trainyard.launch import (CELERY_SETTINGS, HEARTBEAT_TASK, NODE_EXIT_TASK, NODE_LAUNCH_TASK,
                              NODE_STOP_TASK, RANKS_TASK, SCHEDULE_TICK_TASK, Heartbeat, Launch, NodeExit,
                              RankFailure, RankInfo, Resume, Stop)


def launch_dict(resume):
    return {"job_id": 7, "attempt_id": 9, "node": "node-a", "node_rank": 0, "nnodes": 2, "nproc": 1,
            "slots": [0], "device": "cpu", "rdzv_host": "127.0.0.1", "local_addr": "127.0.0.1",
            "stream": "trainyard:job:7:a9", "redis_user": "trainyard-attempt-9", "redis_password": "pw",
            "proof_key": "ab" * 32, "rdzv_token": "cd" * 16, "spec": {"name": "x", "train": {"steps": 3}}, "planner": None, "resume": resume,
            "collective_timeout_s": None, "memory_limit_gb": None}


@pytest.mark.parametrize("resume", [None, {"path": "/ck/job-7/step-00000005-a8", "step": 5, "checkpoint_id": 3}])
def test_launch_json_is_the_dict_the_agent_always_read(resume):
    msg = Launch(job_id=7, attempt_id=9, node="node-a", node_rank=0, nnodes=2, nproc=1, slots=[0], device="cpu",
                 rdzv_host="127.0.0.1", local_addr="127.0.0.1", stream=keys.attempt_stream(7, 9),
                 redis_user="trainyard-attempt-9", redis_password="pw", proof_key="ab" * 32, rdzv_token="cd" * 16,
                 spec={"name": "x", "train": {"steps": 3}}, resume=Resume(**resume) if resume else None)
    wire = msg.model_dump(mode="json")
    assert wire == launch_dict(resume) and list(wire) == list(launch_dict(resume))
    assert Launch.model_validate(wire) == msg


def test_launch_without_resume_key_and_unknown_keys():
    wire = launch_dict(None)
    del wire["resume"]  # hand-built launches (tests/integration) leave it out
    assert Launch.model_validate(wire).resume is None
    del wire["collective_timeout_s"]  # from a control plane older than the key: torch's timeouts
    assert Launch.model_validate(wire).collective_timeout_s is None
    del wire["memory_limit_gb"]  # only a cpu job under TRAINYARD_CPU_DEVICE_MEMORY_ENFORCE has one
    assert Launch.model_validate(wire).memory_limit_gb is None
    del wire["planner"]  # only a user-code job with parallel auto has one
    assert Launch.model_validate(wire).planner is None
    with pytest.raises(ValueError):
        Launch.model_validate({**wire, "nporc": 1})


def test_node_exit_carries_exactly_the_keys_its_sender_set():
    never_started = {"attempt_id": 9, "node": "node-a", "exit_code": None, "signal": None, "stopped": True,
                     "failures": [], "log_tail": {}, "duration_s": 0.0, "reason": "cancel"}
    assert NodeExit.model_validate(never_started).wire() == never_started
    failed = {"attempt_id": 9, "job_id": 7, "node": "node-b", "exit_code": 1, "signal": None, "stopped": False,
              "lost": False, "duration_s": 3.5, "log_tail": {"1": ["boom"]}, "torchrun_tail": ["x"],
              "failures": [{"rank": 1, "local_rank": 0, "exitcode": 1, "signal": None, "timestamp": 12.5,
                            "message": "ValueError: bad", "traceback": "tb"}]}
    assert NodeExit.model_validate(failed).wire() == failed
    rdzv = NodeExit(attempt_id=9, failures=[RankFailure(rank=None, message="RendezvousError: x")]).wire()
    assert rdzv == {"attempt_id": 9, "failures": [{"rank": None, "message": "RendezvousError: x"}]}


def test_heartbeat_ranks_and_stop():
    beat = Heartbeat.model_validate({"name": "node-a", "address": "127.0.0.1", "slots": 2})
    assert (beat.labels, beat.devices, beat.agent_id, beat.attempts) == ({}, [], "", [])
    full = beat.model_dump(mode="json")
    assert set(full) == {"name", "address", "slots", "labels", "devices", "cpu_percent", "mem_percent",
                         "agent_id", "attempts", "allocation", "draining"}
    assert (beat.allocation, beat.draining) == ("", "")  # only a Slurm seat's ephemeral agent sets them
    rank = {"rank": 1, "local_rank": 0, "pid": 4243, "node": "node-b"}
    assert RankInfo.model_validate(rank).model_dump(mode="json") == rank
    stop = {"job_id": 0, "attempt_id": 9, "reason": "orphan"}
    assert Stop.model_validate(stop).model_dump(mode="json") == stop  # NODE_STOP_TASK's body, sealed


def test_keys_keep_their_values():
    assert keys.attempt_stream(7, 9) == "trainyard:job:7:a9" and keys.stream_ids("trainyard:job:7:a9") == (7, 9)
    assert keys.job_log_key(7) == "trainyard:joblog:7"
    assert keys.preempt_key(9) == "trainyard:preempt:9" and keys.rdzv_port_key(9, "t0k") == "trainyard:rdzv:9:t0k"
    assert (keys.RELAY_GROUP, keys.RELAY_STATS_KEY, keys.RELAY_ALIVE_KEY, keys.RELAY_STARTED_KEY) == (
        "relay", "trainyard:relay:stats", "trainyard:relay:alive", "trainyard:relay:started")
    assert (keys.CONTROL_QUEUE, keys.node_queue("node-a")) == ("control", "node.node-a")
    assert keys.step_dir_name(5, 21) == "step-00000005-a21" and keys.MANIFEST == "trainyard.json"


def test_checkpoint_root_is_one_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert keys.checkpoint_root({"TRAINYARD_CHECKPOINT_ROOT": "ck"}) == tmp_path / "ck"
    assert keys.checkpoint_root({"TRAINYARD_VAR_DIR": "v"}) == tmp_path / "v" / "checkpoints"
    assert keys.checkpoint_root({}) == keys.REPO_VAR_DIR / "checkpoints"  # not the cwd's var/
    assert keys.data_root({"TRAINYARD_VAR_DIR": str(tmp_path)}) == tmp_path / "data"
    assert keys.job_checkpoint_dir(Path("/r"), 7) == Path("/r/job-7")


def test_control_plane_and_agents_resolve_the_same_root(settings):
    from django.conf import settings as live

    assert Path(live.TRAINYARD_CHECKPOINT_ROOT) == keys.checkpoint_root()


def test_each_side_serves_its_own_tasks_with_the_shared_settings():
    import jobs.tasks  # noqa: F401 - registers the control tasks
    import workers.tasks  # noqa: F401 - registers the node tasks
    from jobs.core.celery_app import app as control
    from workers.celery_app import app as node

    assert {SCHEDULE_TICK_TASK, HEARTBEAT_TASK, RANKS_TASK, NODE_EXIT_TASK} <= set(control.tasks)
    assert not {NODE_LAUNCH_TASK, NODE_STOP_TASK} & set(control.tasks)
    assert {NODE_LAUNCH_TASK, NODE_STOP_TASK} <= set(node.tasks)
    assert not {SCHEDULE_TICK_TASK, HEARTBEAT_TASK, RANKS_TASK, NODE_EXIT_TASK} & set(node.tasks)
    for app in (control, node):
        assert all(app.conf[k] == v for k, v in CELERY_SETTINGS.items())


def test_reports_are_acked_after_they_run_and_periodic_tasks_before():
    """An attempt's rank and exit reports are sent once: a worker killed mid-task must run them
    again (late ack). Ticks and heartbeats repeat every 2 s, so they are acked early, which keeps
    a Redis restart during one from crashing the control worker (jobs/tasks.py)."""
    from jobs.core.celery_app import app as control
    from jobs.tasks import PERIODIC  # noqa: F401 - registers the control tasks

    assert control.tasks[RANKS_TASK].acks_late and control.tasks[NODE_EXIT_TASK].acks_late
    assert not control.tasks[HEARTBEAT_TASK].acks_late and not control.tasks[SCHEDULE_TICK_TASK].acks_late
