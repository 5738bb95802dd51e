"""Trainyard's own agents as the first launch backend (jobs/core/agents_backend.py): the tick's
launches go through its submit, and status, cancel, signal and reconcile read and act on what the
agents reported, as trainyard/backends.py promises."""
from __future__ import annotations

import pytest

from jobs import services
from jobs.core.agents_backend import AGENTS
from jobs.models import Attempt
from trainyard import backends
from trainyard.backends import Handle, State

from tests.jobs.runs.test_services import submit

pytestmark = pytest.mark.django_db


def started(user, django_capture_on_commit_callbacks) -> Attempt:
    job = submit(user, resources={"nodes": 2, "procs_per_node": 1})
    with django_capture_on_commit_callbacks(execute=True):
        services.schedule_tick()
    return Attempt.objects.get(job=job)


def handle(attempt: Attempt) -> Handle:
    return Handle("agents", backends.attempt_tag(attempt.job_id, attempt.pk))


def test_the_ticks_launches_go_through_the_agents_backend(user, nodes, sent, django_capture_on_commit_callbacks):
    assert isinstance(AGENTS, backends.LaunchBackend)
    attempt = started(user, django_capture_on_commit_callbacks)
    launches = [c for c in sent if c[0] == "launch"]
    assert sorted(c[1] for c in launches) == ["node-a", "node-b"]
    assert {c[2]["attempt_id"] for c in launches} == {attempt.pk}
    assert AGENTS.status([handle(attempt)])[handle(attempt)].state == State.PENDING  # no rank reported yet


def test_status_follows_the_agents_reports(user, nodes, sent, django_capture_on_commit_callbacks):
    attempt = started(user, django_capture_on_commit_callbacks)
    for alloc in attempt.allocations.select_related("node"):
        services.attempt_ranks(attempt.pk, node_name=alloc.node.name,
                               ranks=[{"rank": alloc.node_rank, "local_rank": 0, "pid": 10}])
    st = AGENTS.status([handle(attempt)])[handle(attempt)]
    assert st.state == State.RUNNING and sorted(st.nodes) == ["node-a", "node-b"]
    for alloc in attempt.allocations.select_related("node"):
        services.attempt_node_exit(attempt.pk, node_name=alloc.node.name, result={
            "attempt_id": attempt.pk, "node": alloc.node.name, "exit_code": 0, "failures": [], "log_tail": {}})
    assert AGENTS.status([handle(attempt)])[handle(attempt)].state == State.SUCCEEDED
    unknown = Handle("agents", backends.attempt_tag(999, 999))
    assert AGENTS.status([unknown])[unknown].state == State.UNKNOWN


def test_cancel_signal_and_reconcile(user, nodes, sent, preempts, django_capture_on_commit_callbacks):
    attempt = started(user, django_capture_on_commit_callbacks)
    AGENTS.signal(handle(attempt), "checkpoint")
    assert preempts == [(attempt.pk, "checkpoint requested")]
    with pytest.raises(ValueError):
        AGENTS.signal(handle(attempt), "KILL")
    AGENTS.cancel(handle(attempt), 30.0)
    assert preempts[-1] == (attempt.pk, "cancel")
    assert sorted(c[1] for c in sent if c[0] == "stop") == ["node-a", "node-b"]
    tag = backends.attempt_tag(attempt.job_id, attempt.pk)
    kept = AGENTS.reconcile({tag})
    assert kept.adopted == ((tag, Handle("agents", tag)),) and kept.cancelled == ()
    sent.clear()
    gone = AGENTS.reconcile(set())  # not live any more: what the agents still run is stopped
    assert gone.cancelled == ((tag, Handle("agents", tag)),)
    assert sorted((c[1], c[3]) for c in sent if c[0] == "stop") == [("node-a", "orphan"), ("node-b", "orphan")]
