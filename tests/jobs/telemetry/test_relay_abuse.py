"""Abuse of the telemetry bus, through a real relay process (`manage.py relay`) and a real Redis:
malformed entries, entries forging another job's attempt, forged checkpoint reports, and a
database that is briefly locked. The relay must apply what is good, dead-letter the rest with a
reason, never exit, and never apply an entry twice."""
import json

import pytest
import redis

from jobs.telemetry import prometheus
from jobs import services
from jobs.models import Checkpoint, JobEvent, MetricSample
from trainyard.keys import DEADLETTER_STREAM, RELAY_GROUP, RELAY_STATS_KEY, attempt_stream

from tests.jobs.telemetry.relay_proc import RelayProcess
from tests.jobs.attempts.test_fault import write_ckpt
from tests.jobs.runs.test_services import start, submit

pytestmark = [pytest.mark.procs, pytest.mark.django_db(transaction=True),
              pytest.mark.usefixtures("ckpt_root", "relay_alive")]


def sample(attempt, step, rank=0):
    return {"rank": rank, "step": step, "ts": 1.0, "loss": 1.0, "attempt": attempt.pk}


def metrics(*samples):
    return {"type": "metrics", "data": json.dumps(list(samples))}


def event(kind, attempt, **fields):
    return {"type": "event", "data": json.dumps({"kind": kind, "rank": 0, "attempt": attempt.pk, **fields})}


@pytest.fixture
def bus(redis_server, settings):
    settings.REDIS_URL = redis_server.url  # /metrics reads the relay's counters there
    prometheus._redis = None
    yield redis.Redis.from_url(redis_server.url)
    prometheus._redis = None


@pytest.fixture
def relay_for(redis_server, tmp_path, settings, ckpt_root):
    started = []

    def make(fault=None):
        proc = RelayProcess(tmp_path / f"relay-{len(started)}", redis_server.url,
                            checkpoint_root=ckpt_root,
                            artifact_root=tmp_path / "artifacts", fault=fault)
        started.append(proc.start())
        return proc
    yield make
    for proc in started:
        proc.stop()


def dead_letters(r):
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(DEADLETTER_STREAM)]


def drained(r, *streams):
    return all(r.xlen(s) == 0 and r.xpending(s, RELAY_GROUP)["pending"] == 0 for s in streams)


def test_malformed_entries_are_dead_lettered_and_the_relay_keeps_applying(user, staff, nodes, bus, relay_for, client):
    job = submit(user)
    attempt = start(job)
    stream = attempt_stream(job.pk, attempt.pk)
    bus.xadd(stream, metrics(sample(attempt, 1)))
    bus.xadd(stream, {"type": "log", "data": json.dumps({"attempt": attempt.pk, "rank": 0, "lines": 5})})
    bus.xadd(stream, {"type": "gossip", "data": "{}"})
    bus.xadd(stream, {"type": "metrics", "data": "{not json"})
    bus.xadd(stream, metrics({**sample(attempt, 9), "step": "nine"}))
    bus.xadd(stream, event("checkpoint", attempt, step=True, path=None))
    bus.xadd("trainyard:job:not-a-number", metrics(sample(attempt, 7)))  # no attempt's stream: never read
    bus.xadd(attempt_stream(job.pk, attempt.pk + 1000), metrics(sample(attempt, 8)))  # no such attempt: likewise
    for step in (2, 3):
        bus.xadd(stream, metrics(sample(attempt, step)))
    relay = relay_for()
    relay.wait_for(lambda: MetricSample.objects.filter(job=job).count() == 3 and drained(bus, stream),
                   "the good samples around the bad entries")
    relay.wait_for(lambda: len(dead_letters(bus)) == 5, "five dead letters")
    assert sorted(MetricSample.objects.filter(job=job).values_list("step", flat=True)) == [1, 2, 3]
    reasons = {d["type"]: d["reason"] for d in dead_letters(bus)}
    assert "lines: Input should be a valid list" in reasons["log"] and "unknown entry type 'gossip'" in reasons["gossip"]
    assert {d["stream"] for d in dead_letters(bus)} == {stream}
    assert bus.xlen("trainyard:job:not-a-number") == 1  # left alone: the relay reads no stream it cannot own
    assert all(d["reason"] and d["id"] for d in dead_letters(bus))
    assert relay.alive()
    assert int(bus.hget(RELAY_STATS_KEY, "deadletter_total")) == 5
    rendered = prometheus.render()
    assert "trainyard_relay_deadletter_total 5" in rendered, [x for x in rendered.splitlines() if "dead" in x]
    job.refresh_from_db()
    assert job.step == 3
    # staff read them on a page of their own; nobody else does
    assert client.get("/relay/dead-letters/").status_code == 302
    client.force_login(user)
    assert client.get("/relay/dead-letters/").status_code == 403
    client.force_login(staff)
    page = client.get("/relay/dead-letters/")
    assert page.status_code == 200
    html = page.content.decode()
    assert html.count("<tr data-id=") == 5 and "unknown entry type &#x27;gossip&#x27;" in html


def test_a_forged_sample_or_event_for_job_b_on_job_a_stream_changes_nothing_on_b(user, nodes, bus, relay_for):
    a, b = submit(user), submit(user)
    attempt_a, attempt_b = start(a), start(b)
    assert attempt_b is not None and attempt_b.job_id == b.pk
    stream = attempt_stream(a.pk, attempt_a.pk)
    bus.xadd(stream, metrics(sample(attempt_b, 1000)))
    bus.xadd(stream, metrics(sample(attempt_a, 1), sample(attempt_b, 2000)))  # one forged sample spoils the entry
    bus.xadd(stream, event("resumed", attempt_b, step=999, path="/x", load_s=0.1))
    bus.xadd(stream, event("telemetry_dropped", attempt_b, count=5))
    bus.xadd(stream, metrics(sample(attempt_a, 2)))
    relay = relay_for()
    relay.wait_for(lambda: MetricSample.objects.filter(job=a, step=2).exists() and drained(bus, stream),
                   "job A's own sample")
    b.refresh_from_db()
    assert b.step == 0 and not MetricSample.objects.filter(job=b).exists()
    assert list(MetricSample.objects.filter(job=a).values_list("step", flat=True)) == [2]
    assert not JobEvent.objects.filter(job=b, kind__in=["resumed", "telemetry_dropped"]).exists()
    letters = dead_letters(bus)
    assert len(letters) == 4
    assert all(d["reason"] == f"it names attempt {attempt_b.pk} but arrived on attempt {attempt_a.pk}'s stream"
               for d in letters)
    assert relay.alive()


def test_forged_checkpoint_reports_for_b_do_not_delete_bs_real_checkpoints(user, nodes, bus, relay_for, ckpt_root):
    a, b = submit(user), submit(user, checkpoint={"every_steps": 10, "keep": 3})
    attempt_a = start(a)
    attempt_b = start(b)
    stream_a, stream_b = attempt_stream(a.pk, attempt_a.pk), attempt_stream(b.pk, attempt_b.pk)
    real = []
    for step in (10, 20, 30):
        d = write_ckpt(ckpt_root, b, attempt_b, step)
        real.append(services.checkpoint_register(attempt_b.pk, data={"step": step, "path": str(d)}))
    job_dir = ckpt_root / f"job-{b.pk}"
    forged = [str(job_dir / f"step-{s:08d}-a{attempt_b.pk}") for s in (100, 200, 300)]
    for path, step in zip(forged, (100, 200, 300)):  # on A's stream, naming B's attempt
        bus.xadd(stream_a, event("checkpoint", attempt_b, step=step, path=path))
    for path, step in zip(forged, (100, 200, 300)):  # on B's own stream: nothing on disk
        bus.xadd(stream_b, event("checkpoint", attempt_b, step=step, path=path))
    outside = ckpt_root / "elsewhere"
    write_ckpt(ckpt_root, b, attempt_b, 400).rename(outside)
    link = job_dir / f"step-{400:08d}-a{attempt_b.pk}"
    link.symlink_to(outside)  # a symlink out of the job's directory
    bus.xadd(stream_b, event("checkpoint", attempt_b, step=400, path=str(link)))
    bus.xadd(stream_b, event("checkpoint", attempt_b, step=500, path=str(job_dir / ".." / "x")))
    bus.xadd(stream_b, metrics(sample(attempt_b, 1)))
    relay = relay_for()
    relay.wait_for(lambda: MetricSample.objects.filter(job=b).exists() and drained(bus, stream_a, stream_b),
                   "the reports to be handled")
    for c in real:
        c.refresh_from_db()
        assert (c.step, c.deleted_at) == (c.step, None) and (ckpt_root / c.path).is_dir()
    assert Checkpoint.objects.filter(job=b).count() == 3
    reasons = [d["reason"] for d in dead_letters(bus)]
    assert len(reasons) == 8
    assert sum(r == f"it names attempt {attempt_b.pk} but arrived on attempt {attempt_a.pk}'s stream"
               for r in reasons) == 3
    assert sum("has no manifest" in r for r in reasons) == 3
    assert sum("unreadable manifest" in r and "symlink" in r for r in reasons) == 1  # never followed
    assert sum("without '..'" in r for r in reasons) == 1
    assert relay.alive()


def test_a_transient_database_lock_is_retried_and_the_entry_applied_once(user, nodes, bus, relay_for):
    job = submit(user)
    attempt = start(job)
    stream = attempt_stream(job.pk, attempt.pk)
    bus.xadd(stream, metrics(sample(attempt, 1), sample(attempt, 2)))
    bus.xadd(stream, event("resumed", attempt, step=2, path="/x", load_s=0.5))
    # The event's row is the round's last write: the samples were inserted when it fails.
    relay = relay_for(fault='INSERT INTO "jobs_jobevent"|2|database is locked')
    relay.wait_for(lambda: drained(bus, stream), "the round to be committed and acknowledged")
    assert JobEvent.objects.filter(job=job, kind="resumed").count() == 1
    assert sorted(MetricSample.objects.filter(job=job).values_list("step", flat=True)) == [1, 2]
    assert relay.log().count("injected fault: database is locked") == 2
    relay.wait_for(lambda: int(bus.hget(RELAY_STATS_KEY, "db_retries_total") or 0) == 2, "the retries counted")
    assert relay.alive() and not dead_letters(bus)


def test_relay_workers_share_the_streams_and_a_killed_one_is_restarted(user, nodes, bus, relay_for, tmp_path):
    """manage.py relay --workers 2: two relay processes under one supervisor store every sample once; one
    killed mid-stream is started again and goes on where its stream's pending entries are; SIGTERM stops
    them all."""
    import os
    import signal

    import psutil

    attempts = []
    for i in range(4):
        job = services.job_submit(user=user, spec=services.submitted_spec(
            {"name": f"w{i}", "resources": {"nodes": 1, "procs_per_node": 1}}))
        services.schedule_tick()
        attempts.append(job.attempts.get())
    streams = [attempt_stream(a.job_id, a.pk) for a in attempts]

    def send(steps):
        for a, stream in zip(attempts, streams):
            for step in steps:
                bus.xadd(stream, metrics(sample(a, step), sample(a, step, rank=1)))

    send(range(1, 51))
    relay = relay_for()
    relay.proc.terminate()
    relay.proc.wait(15)
    relay.cmd = [*relay.cmd, "--workers", "2"]
    relay.start()
    relay.wait_for(lambda: MetricSample.objects.count() == 4 * 100 and drained(bus, *streams), "both workers' rounds")
    children = relay.wait_for(lambda: psutil.Process(relay.proc.pid).children() if len(
        psutil.Process(relay.proc.pid).children()) == 2 else None, "two relay processes")
    os.kill(children[0].pid, signal.SIGKILL)
    send(range(51, 101))
    relay.wait_for(lambda: MetricSample.objects.count() == 4 * 200 and drained(bus, *streams), "the restarted worker",
                   timeout_s=60)
    for a in attempts:
        assert sorted(MetricSample.objects.filter(attempt=a).values_list("step", "rank")) == \
            [(s, k) for s in range(1, 101) for k in (0, 1)]
    relay.proc.terminate()
    assert relay.proc.wait(30) == 0
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children[1:])
