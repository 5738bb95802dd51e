"""Two nodes' reports of one attempt handled at the same time (the control worker runs two tasks at
once): on PostgreSQL's read committed, each transaction judged "has every node reported?" without
seeing the other's uncommitted allocation, so neither moved the attempt on. An attempt whose ranks
had all started stayed STARTING until its launch timed out (a needless restart), and one whose
nodes had all exited stayed RUNNING until the hang detector failed it. Node A's report is held
open inside a transaction while node B's runs in another thread: B must wait for A's commit and
then see it. PostgreSQL only (SQLite serialises writers: the race cannot happen there)."""
from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from jobs import services
from jobs.models import Attempt, Job

from tests.jobs.runs.test_services import submit

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _postgres_only():
    if connection.vendor != "postgresql":
        pytest.skip("the race needs concurrent writers (PostgreSQL; make test-postgres)")


def _at_once(first, second) -> None:
    """Run first() in a transaction held open until second() (another thread, its own connection)
    has started; second() must not see first's work before it commits."""
    started, errors = threading.Event(), []

    def other():
        try:
            started.set()
            second()
        except Exception as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
        finally:
            connection.close()

    with transaction.atomic():
        first()
        thread = threading.Thread(target=other)
        thread.start()
        started.wait(10)
        thread.join(1.0)  # with the lock it waits for this commit; without it, it is done by now
    thread.join(30)
    assert not thread.is_alive() and not errors, errors


def _started(user) -> Attempt:
    job = submit(user)
    services.schedule_tick()
    attempt = job.attempts.get()
    assert sorted(a.node.name for a in attempt.allocations.all()) == ["node-a", "node-b"]
    return attempt


def _ranks(attempt: Attempt, node: str, rank: int):
    return lambda: services.attempt_ranks(attempt.pk, node_name=node, ranks=[
        {"rank": rank, "local_rank": 0, "pid": 1000 + rank}])


def _exit(attempt: Attempt, node: str):
    return lambda: services.attempt_node_exit(attempt.pk, node_name=node, result={
        "attempt_id": attempt.pk, "node": node, "exit_code": 0, "signal": None, "stopped": False,
        "failures": [], "log_tail": {}})


def test_both_nodes_reporting_their_ranks_at_once_make_the_attempt_running(user, nodes):
    attempt = _started(user)
    _at_once(_ranks(attempt, "node-a", 0), _ranks(attempt, "node-b", 1))
    attempt.refresh_from_db()
    assert attempt.status == Attempt.Status.RUNNING and attempt.job.status == Job.Status.RUNNING


def test_both_nodes_exiting_at_once_end_the_attempt_and_the_job(user, nodes):
    attempt = _started(user)
    _ranks(attempt, "node-a", 0)()
    _ranks(attempt, "node-b", 1)()
    _at_once(_exit(attempt, "node-a"), _exit(attempt, "node-b"))
    attempt.refresh_from_db()
    assert attempt.status == Attempt.Status.ENDED and attempt.outcome == "succeeded"
    assert Job.objects.get(pk=attempt.job_id).status == Job.Status.SUCCEEDED
