"""Issue 16, section 2: what differs between SQLite and PostgreSQL, on whichever database the suite
runs (`make test` on SQLite, `make test-postgres` on a real PostgreSQL server, tests/postgres.py):
row locking of the scheduler tick and of status transitions under real concurrency, the relay's
duplicate-skipping bulk insert from two writers at once, 64-bit step counters, and values SQLite
stores but PostgreSQL refuses (NUL characters, NaN in JSON)."""
from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from jobs import services
from jobs.models import Allocation, Attempt, Job, JobEvent, MetricSample
from jobs.attempts.services.events import job_set_status

from tests.jobs.runs.test_services import start, submit

pytestmark = pytest.mark.django_db(transaction=True)


def in_threads(n: int, fn) -> list:
    """Run fn(i) in n threads started together; returns their results (or exceptions)."""
    barrier, out = threading.Barrier(n), [None] * n

    def run(i):
        try:
            barrier.wait(10)
            out[i] = fn(i)
        except Exception as exc:
            out[i] = exc
        finally:
            connections.close_all()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_the_database_is_the_one_asked_for():
    """`make test-postgres` really runs on PostgreSQL (the plugin set DATABASE_URL before the settings)."""
    import os

    expected = "postgresql" if os.environ.get("TRAINYARD_TEST_POSTGRES_ADMIN_URL") else "sqlite"
    assert connection.vendor == expected


def test_two_ticks_at_once_never_place_a_job_twice_or_share_a_slot(user, nodes):
    jobs = [submit(user) for _ in range(6)]  # 2 slots each; the two nodes hold 4
    results = in_threads(2, lambda i: services.schedule_tick())
    assert not [r for r in results if isinstance(r, Exception)], results
    placed = [j for r in results for j in r]
    assert sorted(placed) == sorted(set(placed)) and len(placed) == 2, results
    assert {a.job_id for a in Attempt.objects.all()} == set(placed)
    assert Attempt.objects.count() == 2  # one attempt per placed job, never two
    slots = [(a.node_id, s) for a in Allocation.objects.filter(active=True) for s in a.slot_ids]
    assert len(slots) == len(set(slots)) == 4
    assert Job.objects.filter(pk__in=[j.pk for j in jobs], status="QUEUED").count() == 4


def test_a_tick_never_places_on_slots_another_tick_is_placing(user, nodes, monkeypatch):
    """Tick 1 decided to put job A on all 4 slots and has not committed; job B (high priority)
    arrives and tick 2 runs. Tick 2 must wait for tick 1 (the lock row, FOR UPDATE) and then see
    the slots taken; deciding over the same free slots, it would have put B on them too."""
    from jobs.scheduling import policy

    a = submit(user, resources={"nodes": 2, "procs_per_node": 2})
    decided, real = threading.Event(), policy.schedule

    def slow_first(view):
        decision = real(view)
        if threading.current_thread().name == "tick-1":
            decided.set()
            time.sleep(0.5)  # tick 1 holds its decision uncommitted meanwhile
        return decision
    monkeypatch.setattr(policy, "schedule", slow_first)
    results: dict[str, object] = {}

    def tick(name):
        try:
            results[name] = services.schedule_tick()
        except Exception as exc:  # pragma: no cover - shown by the assert below
            results[name] = exc
        finally:
            connections.close_all()
    t1 = threading.Thread(target=tick, args=("tick-1",), name="tick-1")
    t1.start()
    assert decided.wait(10)
    b = submit(user, resources={"nodes": 2, "procs_per_node": 2}, priority="high")
    t2 = threading.Thread(target=tick, args=("tick-2",), name="tick-2")
    t2.start()
    t1.join(30)
    t2.join(30)
    assert results == {"tick-1": [a.pk], "tick-2": []}, results
    slots = [(al.node_id, s) for al in Allocation.objects.filter(active=True) for s in al.slot_ids]
    assert len(slots) == len(set(slots)) == 4
    assert Job.objects.get(pk=b.pk).status == Job.Status.QUEUED


def test_concurrent_transitions_have_exactly_one_winner(user, nodes):
    """Two writers move the same QUEUED job at once, each holding its transaction open after its
    UPDATE: the second waits on the row and then finds the status changed (one True, one False)."""
    job = submit(user)
    hold = threading.Event()

    def move(i):
        with transaction.atomic():
            moved = job_set_status(Job.objects.get(pk=job.pk), Job.Status.QUEUED,
                                            (Job.Status.CANCELLED, Job.Status.STARTING)[i], f"writer {i}")
            if moved:
                hold.wait(0.5)  # the other writer's UPDATE runs into this row lock meanwhile
            return moved
    results = in_threads(2, move)
    assert sorted(results, key=str) == [False, True], results
    winner = results.index(True)
    job.refresh_from_db()
    assert job.status == (Job.Status.CANCELLED, Job.Status.STARTING)[winner]
    assert job.status_reason == f"writer {winner}"


def samples_for(attempt, steps, ranks=(0, 1)):
    return [{"rank": r, "step": s, "ts": float(s), "loss": 1.0, "attempt": attempt.pk} for s in steps for r in ranks]


def test_two_relays_inserting_the_same_samples_at_once_store_each_once(user, nodes):
    """ON CONFLICT DO NOTHING (OR IGNORE on SQLite) from two transactions at once: the second waits
    for the first's unique-index entries and skips them; neither raises IntegrityError."""
    job = submit(user)
    attempt = start(job)
    batch = samples_for(attempt, range(1, 201))
    batch += batch[:50]  # duplicates within one batch too
    results = in_threads(2, lambda i: services.telemetry_ingest(list(reversed(batch)) if i else batch, events=[]))
    assert not [r for r in results if isinstance(r, Exception)], results
    assert MetricSample.objects.filter(job=job).count() == 400
    assert MetricSample.objects.filter(job=job).values("attempt", "rank", "step").distinct().count() == 400
    job.refresh_from_db()
    assert job.step == 200


def test_steps_are_64_bit_counters_on_every_database(user, nodes):
    """A step beyond 2**31 (a run that counts tokens or samples as its step) is stored and becomes
    the job's step; PostgreSQL's `integer` column refused it (DataError: the whole batch was lost
    and the relay dead-lettered it), while SQLite stored it."""
    job = submit(user)
    attempt = start(job)
    big = 2**40 + 7
    services.telemetry_ingest(samples_for(attempt, [5, big]), events=[])
    assert sorted(MetricSample.objects.filter(job=job, rank=0).values_list("step", flat=True)) == [5, big]
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.step == big and attempt.last_step == big
    services.telemetry_ingest(samples_for(attempt, [2**63 - 1, 2**63]), events=[])  # the largest; one past it
    assert MetricSample.objects.filter(job=job, rank=0, step=2**63 - 1).exists()
    assert MetricSample.objects.filter(job=job).count() == 6


def test_nul_characters_from_a_runtime_never_break_the_relays_batch(user, nodes):
    """PostgreSQL's text and jsonb refuse U+0000 (SQLite stores it): a NUL in an event's field
    (JSON allows "\\u0000") is stored as U+FFFD and the batch's samples are kept."""
    job = submit(user)
    attempt = start(job)
    events = [{"kind": "telemetry_dropped", "rank": 1, "count": 3, "attempt": attempt.pk, "note\x00": "a\x00b"},
              {"kind": "resumed", "rank": 0, "step": 4, "attempt": attempt.pk, "path": "/ck\x00pt"}]
    services.telemetry_ingest(samples_for(attempt, [1, 2]), events=events)
    assert MetricSample.objects.filter(job=job).count() == 4
    dropped = JobEvent.objects.get(job=job, kind="telemetry_dropped")
    assert dropped.data["note\ufffd"] == "a\ufffdb"
    resumed = JobEvent.objects.get(job=job, kind="resumed")
    assert "\x00" not in resumed.message and resumed.data["path"] == "/ck\ufffdpt"


def test_nul_in_a_ranks_output_never_keeps_its_attempt_from_ending(user, nodes):
    """The exit report carries the ranks' last lines: a binary-printing rank's NUL made the
    report's UPDATE raise on PostgreSQL, and the attempt stayed RUNNING."""
    job = submit(user)
    attempt = start(job)
    for alloc in attempt.allocations.select_related("node"):
        services.attempt_node_exit(attempt.pk, node_name=alloc.node.name, result={
            "attempt_id": attempt.pk, "node": alloc.node.name, "exit_code": 1, "signal": None, "stopped": False,
            "failures": [{"rank": alloc.node_rank, "exitcode": 1, "message": "bad\x00byte",
                          "traceback": "Traceback:\n  x\x00y\nValueError: \x00"}],
            "log_tail": {str(alloc.node_rank): ["step 3", "garbage \x00\x00 here", "Error: boom\x00"]}})
    attempt.refresh_from_db()
    assert attempt.status == Attempt.Status.ENDED
    stored = [a.result for a in Allocation.objects.filter(attempt=attempt)]
    assert all("\x00" not in str(r) for r in stored) and "garbage \ufffd\ufffd here" in str(stored)


@pytest.mark.parametrize("body, field, why", [
    ('{"username": "VO\\u0000D", "password": "pw-alice-123"}', "username", "NUL"),
    ('{"username": "alice", "password": "pw\\u0000"}', "password", "NUL"),
    ('{"username": "al\\udb8dice", "password": "pw-alice-123"}', "username", "lone surrogates"),
])
def test_a_login_with_text_no_database_can_hold_is_a_400_naming_the_field(user, body, field, why):
    """Found by the API fuzz on PostgreSQL: a NUL in the username made the user lookup raise (500)."""
    from django.core.cache import cache
    from rest_framework.test import APIClient

    cache.clear()  # the login throttle
    r = APIClient().post("/api/v1/auth/token/", body, content_type="application/json")
    assert r.status_code == 400, r.content
    assert why in r.json()["errors"][field][0]


@pytest.mark.parametrize("method, url, body, expected", [
    ("get", "/api/v1/nodes/a%00b/", None, 404),
    ("post", "/api/v1/nodes/a%00b/drain/", {}, 404),
    ("get", "/api/v1/calibrations/?device=cpu%00", None, 400),
    ("post", "/api/v1/calibrations/", {"node": "node-a\x00"}, 400),
])
def test_names_with_nul_in_urls_and_bodies_are_4xx(staff, nodes, method, url, body, expected):
    """Also found by the fuzz on PostgreSQL: these looked a NUL up (500); no node or device has one."""
    from rest_framework.test import APIClient

    c = APIClient()
    c.force_authenticate(staff)
    r = getattr(c, method)(url, body, format="json") if body is not None else getattr(c, method)(url)
    assert r.status_code == expected, r.content
