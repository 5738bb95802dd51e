"""The agent runs a command from its queue only if the control plane sealed it for this node
(issue 16: nothing trusts the bus without checking who wrote it). Before, anything that could write
to node.<name> (a node's Redis user can push to its own queue) could launch or stop there."""
from __future__ import annotations

import time

import pytest

from trainyard import nodeauth
from trainyard.launch import COMMAND_MAX_AGE_S, NODE_LAUNCH_TASK, NODE_STOP_TASK
from workers import agent as agent_mod

CRED = "credential-of-node-a"
STOP = {"job_id": 1, "attempt_id": 9, "reason": "cancel"}


@pytest.fixture
def agent(tmp_path):
    return agent_mod.Agent("node-a", "127.0.0.1", 2, {}, "cpu", tmp_path / "runs", credential=CRED)


def test_a_command_sealed_for_this_node_is_opened(agent):
    assert agent.command_open(nodeauth.seal(CRED, "node-a", NODE_STOP_TASK, STOP, time.time()), NODE_STOP_TASK) == STOP
    assert agent.refused_commands == 0


@pytest.mark.parametrize("case", ["unsigned", "another credential", "another node", "another task", "stale",
                                  "future", "tampered body", "not a dict", "no body"])
def test_anything_else_is_refused_and_counted(agent, case, caplog):
    env = nodeauth.seal(CRED, "node-a", NODE_STOP_TASK, STOP, time.time())
    if case == "unsigned":
        env = nodeauth.seal(None, "node-a", NODE_STOP_TASK, STOP, time.time())
    elif case == "another credential":
        env = nodeauth.seal("guess", "node-a", NODE_STOP_TASK, STOP, time.time())
    elif case == "another node":
        env = nodeauth.seal(CRED, "node-b", NODE_STOP_TASK, STOP, time.time())
    elif case == "another task":  # a signed stop replayed as a launch
        return_value = agent.command_open(env, NODE_LAUNCH_TASK)
        assert return_value is None and agent.refused_commands == 1
        return
    elif case in ("stale", "future"):
        ts = time.time() + (-1 if case == "stale" else 1) * (COMMAND_MAX_AGE_S + 60)
        env = nodeauth.seal(CRED, "node-a", NODE_STOP_TASK, STOP, ts)
    elif case == "tampered body":
        env["body"] = {**STOP, "attempt_id": 10}
    elif case == "not a dict":
        env = [1, 9, "cancel"]  # the old, unsigned argument list
    elif case == "no body":
        env.pop("body")
    assert agent.command_open(env, NODE_STOP_TASK) is None
    assert agent.refused_commands == 1
    assert "refused a node_stop command" in caplog.text


def test_an_agent_without_a_credential_runs_no_command(tmp_path):
    a = agent_mod.Agent("node-a", "127.0.0.1", 2, {}, "cpu", tmp_path / "runs", credential=None)
    assert a.command_open(nodeauth.seal(CRED, "node-a", NODE_STOP_TASK, STOP, time.time()), NODE_STOP_TASK) is None


def test_the_stop_task_refuses_an_unsigned_stop(agent, monkeypatch):
    from workers import tasks

    stopped = []
    monkeypatch.setattr(agent_mod, "AGENT", agent)
    monkeypatch.setattr(agent, "stop", lambda attempt_id, reason: stopped.append((attempt_id, reason)))
    tasks.node_stop.run({"node": "node-a", "task": NODE_STOP_TASK, "ts": time.time(), "body": STOP, "sig": ""})
    assert stopped == []
    tasks.node_stop.run(nodeauth.seal(CRED, "node-a", NODE_STOP_TASK, STOP, time.time()))
    assert stopped == [(9, "cancel")]
