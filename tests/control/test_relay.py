"""The relay against a real redis-server: batched ingest, ack only after commit, crash replay."""
import json

import pytest
import redis

from jobs import services
from jobs.models import MetricSample
from jobs.telemetry import Relay
from trainyard.keys import RELAY_GROUP, job_log_key, job_stream

pytestmark = [pytest.mark.procs, pytest.mark.django_db(transaction=True)]


def sample(attempt, rank, step):
    return {"rank": rank, "step": step, "ts": 1.0, "loss": 1.0, "samples_per_s": 1.0, "tokens_per_s": 1.0,
            "step_s": 0.1, "data_s": 0.0, "compute_s": 0.1, "comm_s": 0.0, "optim_s": 0.0, "bytes_sent": 1,
            "mem_bytes": 1, "attempt": attempt}


def drain(relay, rounds=50):
    for _ in range(rounds):
        relay.step()


def test_relay_ingests_and_acks(user, nodes, redis_server):
    job = services.job_submit(user=user, spec={"name": "x"})
    services.schedule_tick()
    attempt = job.attempts.get()
    r = redis.Redis.from_url(redis_server.url)
    stream = job_stream(job.pk)
    for step in range(1, 51):
        r.xadd(stream, {"type": "metrics", "data": json.dumps([sample(attempt.pk, 0, step), sample(attempt.pk, 1, step)])})
    r.xadd(stream, {"type": "log", "data": json.dumps({"attempt": attempt.pk, "rank": 1, "lines": ["hello", "world"]})})
    r.xadd(stream, {"type": "metrics", "data": "{not json"})
    relay = Relay(redis_server.url, block_ms=20)
    drain(relay)
    assert MetricSample.objects.filter(job=job).count() == 100
    job.refresh_from_db()
    assert job.step == 50
    assert r.xlen(stream) == 0 and r.xpending(stream, RELAY_GROUP)["pending"] == 0
    assert [json.loads(x)["line"] for x in r.lrange(job_log_key(job.pk), 0, -1)] == ["hello", "world"]


def test_relay_killed_between_read_and_ack_loses_and_duplicates_nothing(user, nodes, redis_server):
    job = services.job_submit(user=user, spec={"name": "x"})
    services.schedule_tick()
    attempt = job.attempts.get()
    r = redis.Redis.from_url(redis_server.url)
    stream = job_stream(job.pk)
    for step in range(1, 21):
        r.xadd(stream, {"type": "metrics", "data": json.dumps([sample(attempt.pk, 0, step)])})
    first = Relay(redis_server.url, block_ms=20)
    first.discover()
    # The first relay reads 10 entries, commits half of them, then "dies" before acking anything.
    entries = r.xreadgroup(RELAY_GROUP, first.consumer, {stream: ">"}, count=10)[0][1]
    services.telemetry_ingest([json.loads(f[b"data"])[0] for _, f in entries[:5]], events=[])
    assert r.xpending(stream, RELAY_GROUP)["pending"] == 10
    second = Relay(redis_server.url, consumer=first.consumer, block_ms=20)
    drain(second)
    assert sorted(MetricSample.objects.filter(job=job).values_list("step", flat=True)) == list(range(1, 21))
    assert r.xpending(stream, RELAY_GROUP)["pending"] == 0
