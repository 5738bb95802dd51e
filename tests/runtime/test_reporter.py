import json
import time

import pytest

from trainyard.sdk.reporter import BATCH_MAX, Reporter, buffer_size_from_env

from .conftest import read_stream


def sample(step, rank=0):
    return {"rank": rank, "step": step, "ts": time.time(), "loss": 1.0 / step}


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_unreachable_redis_never_blocks_the_caller_and_overflow_evicts_the_oldest(dead_redis_url):
    rep = Reporter(dead_redis_url, "s", rank=0, buffer=100)
    t = time.perf_counter()
    for step in range(1, 251):
        rep.metric(sample(step))
    assert time.perf_counter() - t < 0.5  # the hot path only enqueues
    t = time.monotonic()
    assert rep.close(timeout_s=1.0) is False  # nothing could be delivered
    assert time.monotonic() - t < 4.0  # bounded: timeout + at most one socket attempt
    assert rep.dropped_samples == 150 and rep.buffered == 100
    assert [payload["step"] for _, payload in rep._buf] == list(range(151, 251))  # newest kept
    assert rep.failures >= 1 and rep.sent_samples == 0


def test_buffer_size_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TRAINYARD_TELEMETRY_BUFFER", "123")
    assert buffer_size_from_env() == 123
    monkeypatch.setenv("TRAINYARD_TELEMETRY_BUFFER", "0")
    with pytest.raises(ValueError, match="must be >= 1"):
        buffer_size_from_env()
    monkeypatch.delenv("TRAINYARD_TELEMETRY_BUFFER")
    assert buffer_size_from_env() == 100_000


@pytest.mark.procs
def test_stream_entries_are_ordered_batches_of_at_most_500_samples(redis_server):
    rep = Reporter(redis_server.url, "trainyard:job:3", rank=1, attempt=9)
    rep.event("rank_started", pid=42, node="node-b", world_size=2)
    for step in range(1, 1201):
        rep.metric(sample(step, rank=1))
    rep.metric({"rank": 1, "step": 1201, "loss": float("nan")})  # diverged: still valid JSON
    rep.event("rank_finished", steps=1201, final_loss=0.5)
    assert rep.close() is True
    samples, events, raw = read_stream(redis_server.url, "trainyard:job:3")
    assert all(set(fields) == {b"type", b"data"} for _, fields in raw)
    assert [s["step"] for s in samples] == list(range(1, 1202))
    assert samples[-1]["loss"] is None
    sizes = [len(json.loads(f[b"data"])) for _, f in raw if f[b"type"] == b"metrics"]
    assert max(sizes) <= BATCH_MAX and len(sizes) >= 3
    assert json.loads(raw[0][1][b"data"]) == {"kind": "rank_started", "rank": 1, "attempt": 9, "pid": 42,
                                              "node": "node-b", "world_size": 2}
    assert json.loads(raw[-1][1][b"data"]) == {"kind": "rank_finished", "rank": 1, "attempt": 9, "steps": 1201,
                                               "final_loss": 0.5}
    assert [e["kind"] for e in events] == ["rank_started", "rank_finished"]
    assert rep.sent_samples == 1201 and rep.dropped_samples == 0


@pytest.mark.procs
def test_after_an_outage_the_buffer_is_flushed_and_evictions_are_reported(redis_server):
    redis_server.stop()
    rep = Reporter(redis_server.url, "s", rank=0, attempt=4, buffer=100)
    for step in range(1, 301):
        rep.metric(sample(step))
    wait_for(lambda: rep.dropped_samples == 200)  # the flush thread has queued and evicted
    redis_server.start()
    assert rep.close(timeout_s=10.0) is True
    samples, events, _ = read_stream(redis_server.url, "s")
    assert [s["step"] for s in samples] == list(range(201, 301))
    assert events == [{"kind": "telemetry_dropped", "rank": 0, "attempt": 4, "count": 200}]
    assert len(samples) + events[0]["count"] == 300


@pytest.mark.procs
def test_preemption_request_is_seen_within_a_poll_period(redis_server):
    import redis

    from trainyard.keys import preempt_key
    from trainyard.sdk.preempt import POLL_S

    rep = Reporter(redis_server.url, "s", rank=0, attempt=5, preempt_key=preempt_key(5))
    time.sleep(2 * POLL_S)
    assert not rep.preempt_requested.is_set()
    redis.Redis.from_url(redis_server.url).set(preempt_key(5), "{}")
    t0 = time.monotonic()
    assert rep.preempt_requested.wait(5 * POLL_S)
    assert time.monotonic() - t0 <= 2 * POLL_S + 0.3
    rep.close()
