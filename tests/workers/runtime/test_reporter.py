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


class _PartitionedRedis:
    """A fake Redis client at the library boundary: every command fails while `down`; records the
    order of reads of the preemption key and stream writes once it is back."""

    def __init__(self, fence: bytes | None):
        import threading

        self.down = True
        self.fence = fence
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def _check(self, what: str) -> None:
        import redis

        if self.down:
            raise redis.ConnectionError("partitioned")
        with self.lock:
            self.calls.append(what)

    def get(self, key):
        self._check("get")
        return self.fence

    def exists(self, key):
        self._check("get")
        return self.fence is not None

    def xadd(self, stream, fields):
        self._check("xadd")

    def pipeline(self, transaction=True):
        client = self

        class Pipe:
            def xadd(self, stream, fields):
                pass

            def execute(self):
                client._check("xadd")
        return Pipe()

    def close(self):
        pass


def _partitioned_reporter(monkeypatch, fake):
    import redis

    from trainyard.keys import preempt_key
    from trainyard.sdk import reporter as mod

    monkeypatch.setattr(mod, "BACKOFF_MAX_S", 0.2)
    monkeypatch.setattr(redis.Redis, "from_url", classmethod(lambda cls, *a, **k: fake))
    rep = Reporter("redis://partitioned", "s", rank=0, attempt=7, preempt_key=preempt_key(7))
    fenced = []

    def exits(raw):  # stands in for os._exit: nothing is flushed or polled after it
        fenced.append(raw)
        rep._buf.clear()
        rep._preempt_key = None
    monkeypatch.setattr(rep, "_fenced", exits)
    return rep, fenced


def test_a_fenced_attempt_flushes_nothing_when_the_partition_heals(monkeypatch):
    """Issue 16: the control plane wrote the attempt off while its node was cut off. When Redis
    answers again, the rank reads the fence before it sends anything: the buffered samples (trained
    after the fence) are dropped and the rank exits (here `_fenced` is recorded instead of exiting)."""
    fence = json.dumps({"reason": "node_lost:node-b", "grace_s": 0.0, "fenced": True}).encode()
    fake = _PartitionedRedis(fence)
    rep, fenced = _partitioned_reporter(monkeypatch, fake)
    for step in range(1, 50):
        rep.metric(sample(step))
    wait_for(lambda: rep.failures >= 2)
    fake.down = False
    wait_for(lambda: fenced)
    time.sleep(0.5)
    assert fenced == [fence] and "xadd" not in fake.calls and fake.calls[0] == "get"
    rep.close(timeout_s=0.5)


def test_after_a_partition_the_fence_is_read_before_any_flush(monkeypatch):
    fake = _PartitionedRedis(None)  # not fenced: the samples go out, but only after the key was read
    rep, fenced = _partitioned_reporter(monkeypatch, fake)
    for step in range(1, 50):
        rep.metric(sample(step))
    wait_for(lambda: rep.failures >= 2)
    fake.down = False
    wait_for(lambda: "xadd" in fake.calls)
    assert fake.calls[0] == "get" and not fenced
    assert rep.close(timeout_s=2)


def test_an_ordinary_preemption_request_is_not_a_fence():
    from trainyard.sdk.reporter import _is_fence

    assert _is_fence(b'{"reason": "node_lost:b", "grace_s": 0, "fenced": true}')
    assert not _is_fence(b'{"reason": "preempt", "grace_s": 60}')
    assert not _is_fence(b'{"reason": "preempt", "grace_s": 60, "fenced": "yes"}')
    assert not _is_fence(b"{}") and not _is_fence(b"\xff") and not _is_fence(b"[1]")
