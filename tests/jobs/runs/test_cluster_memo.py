"""The cluster page's state is computed once per change for every socket of a process that may
see the same jobs, never older than the change a socket was told about, never across users."""
import time

import pytest

from jobs.runs import payloads
from jobs.scheduling import selectors
from jobs import services
from tests.nodes import node_up

pytestmark = pytest.mark.django_db


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = selectors.queue_positions
    monkeypatch.setattr(selectors, "queue_positions", lambda: calls.append(1) or real())
    monkeypatch.setattr(payloads, "_MEMO", payloads._Memo())
    return calls


def test_sockets_told_of_one_change_share_one_computation(staff, nodes, counted):
    changed = time.monotonic()
    states = [payloads.cluster_state(staff, changed) for _ in range(50)]
    assert len(counted) == 1 and all(s == states[0] for s in states)


def test_a_state_computed_before_a_change_is_not_served_after_it(staff, nodes, counted):
    before = payloads.cluster_state(staff, time.monotonic())
    changed = time.monotonic()
    node_up({"name": "node-c", "address": "127.0.0.3", "slots": 2, "labels": {},
                             "cpu_percent": 1.0, "mem_percent": 2.0})
    after = payloads.cluster_state(staff, changed)
    assert [n["name"] for n in before["nodes"]] == ["node-a", "node-b"]
    assert [n["name"] for n in after["nodes"]] == ["node-a", "node-b", "node-c"] and len(counted) == 2


def test_users_never_share_each_others_jobs(user, other, staff, nodes, counted):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "mine"}))
    now = time.monotonic()
    seen = {u.username: [j["id"] for j in payloads.cluster_state(u, now)["queue"] + payloads.cluster_state(u, now)["running"]]
            for u in (user, other, staff)}
    assert job.pk in seen["alice"] and job.pk in seen["root"] and seen["bob"] == []
    assert len(counted) == 1  # the user-independent part once for all three
