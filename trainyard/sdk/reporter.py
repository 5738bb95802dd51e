"""Telemetry to the job's Redis Stream, off the training thread.

Stream entries (the relay, jobs/telemetry/relay.py, parses exactly these):
    XADD <stream> * type metrics data <JSON list of per-step sample dicts, at most 500>
    XADD <stream> * type event   data <JSON {"kind": ..., "rank": r, ...}>

The training thread only calls `metric()` / `event()`, which put the dict on a SimpleQueue
(a C-level append, ~0.2 us). A daemon thread blocks on that queue and flushes as soon as
something arrives (a fixed tick would add up to a tick of latency to every sample on its way
to the browser): it moves the queue into a bounded buffer, serialises it and writes it in one
pipelined MULTI/EXEC round trip per chunk. Flushes start at most every MIN_FLUSH_GAP_S (10 ms):
a rank at <= 100 steps/s never waits, a faster one batches 10 ms of samples per round trip.
One flush costs ~0.2-0.5 ms of CPU on a 2-core VM (redis-py, and a send that wakes the Redis
server), so this caps the thread at ~5% of a core however fast the rank steps.

Redis being down must not stop training: the buffer keeps the newest `buffer` entries
(TRAINYARD_TELEMETRY_BUFFER, default 100_000: ~8 min of 2-rank steps at 100 steps/s per rank),
counts what it evicts, and the thread retries with capped exponential backoff. Short socket
timeouts and no client-side retries make a dead server cost at most ~0.5 s per attempt. Once
a flush succeeds and the buffer is empty, a `telemetry_dropped` event reports the evicted
samples (only if any). `close()` flushes for at most `timeout_s`, then gives up, so a dead
Redis delays the end of a job by a bounded time, never forever.

Known limit: if the connection drops after Redis executed a MULTI/EXEC but before the reply
arrived, the retry writes that chunk twice; the relay can dedupe by (attempt, rank, step).
"""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from collections import deque
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

DEFAULT_BUFFER = 100_000
BUFFER_ENV = "TRAINYARD_TELEMETRY_BUFFER"
BATCH_MAX = 500  # samples per stream entry: keeps one entry well under 256 KB of JSON
MIN_FLUSH_GAP_S = 0.01
IDLE_WAKE_S = 1.0  # the flush thread re-checks its state at least this often when idle
CHUNK_ENTRIES = 5_000  # buffered items per round trip, so one write fits the socket timeout
BACKOFF_MAX_S = 2.0

from .preempt import FENCED_EXIT_CODE  # noqa: E402
from .preempt import POLL_S as PREEMPT_POLL_S  # noqa: E402
METRIC, EVENT = "metrics", "event"
_WAKE = ("wake", None)  # put by close(): the flush thread stops waiting for samples


try:  # ~10x faster than json for float-heavy samples (1 us vs 10 us a sample); json if absent
    import orjson
except ImportError:  # pragma: no cover - orjson is pinned in requirements.lock
    orjson = None


def _is_fence(raw: bytes) -> bool:
    """Whether a preemption key's value (trainyard.launch.PreemptRequest as JSON) is a fence."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(value, dict) and value.get("fenced") is True


def _dumps(obj: Any) -> str | bytes:
    if orjson is not None:
        try:  # orjson writes nan/inf as null, like the fallback below
            return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:  # e.g. an int beyond 64 bits: json copes
            pass
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a diverged loss (nan/inf) is not JSON; the relay and browsers get null
        return json.dumps(_finite(obj), separators=(",", ":"))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def buffer_size_from_env() -> int:
    raw = os.environ.get(BUFFER_ENV, "")
    size = int(raw) if raw.strip() else DEFAULT_BUFFER
    if size < 1:
        raise ValueError(f"{BUFFER_ENV} must be >= 1, got {raw!r}")
    return size


SIGTERM_PREEMPTS_ENV = "TRAINYARD_SIGTERM_PREEMPTS"


def catch_sigterm(flag: threading.Event) -> bool:
    """On a Slurm node (the agent sets SIGTERM_PREEMPTS_ENV for its ranks) the batch system takes the
    node back by SIGTERMing every process of the job, the ranks included, and SIGKILLs after its
    GraceTime: a SIGTERM there is a preemption request like the control plane's (checkpoint, exit 83),
    not a death. Only from the main thread (where Python runs handlers); True if installed."""
    import os
    import signal

    if os.environ.get(SIGTERM_PREEMPTS_ENV) != "1" or threading.current_thread() is not threading.main_thread():
        return False

    def on_term(signum, frame):
        if not flag.is_set():
            os.write(2, b"trainyard: SIGTERM from the batch system: checkpointing and stopping (preemption)\n")
        flag.set()

    signal.signal(signal.SIGTERM, on_term)
    return True


class Reporter:
    def __init__(self, redis_url: str, stream: str, *, rank: int, attempt: int | None = None,
                 buffer: int | None = None, preempt_key: str | None = None,
                 min_flush_gap_s: float = MIN_FLUSH_GAP_S, connect_timeout_s: float = 0.5,
                 socket_timeout_s: float = 1.0):
        self.stream = stream
        self.rank = rank
        self.attempt = attempt  # every event names its attempt: the relay files it under that run
        self._gap = min_flush_gap_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._buf: deque = deque(maxlen=buffer or buffer_size_from_env())
        self._client = redis.Redis.from_url(
            redis_url, socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
            driver_info=None)  # no CLIENT SETINFO: an attempt's Redis user may not run it (trainyard/redis_acl.py)
        # Counters are written by the flush thread only; read them after close().
        self.sent_samples = 0
        self.dropped_samples = 0
        self.dropped_events = 0
        self._dropped_unreported = 0
        self.failures = 0
        self._stop = threading.Event()
        self._deadline = math.inf
        # Set once the control plane asks this attempt to checkpoint and exit (preempt.py); polled
        # here, off the training thread, every PREEMPT_POLL_S.
        self.preempt_requested = threading.Event()
        self._preempt_key = preempt_key
        self._next_preempt_poll = 0.0
        # After Redis was unreachable nothing is flushed until the preemption key has been read
        # again: a partitioned attempt may have been fenced meanwhile (_poll_preempt).
        self._fence_unknown = False
        self._thread = threading.Thread(target=self._run, name="trainyard-reporter", daemon=True)
        self._thread.start()
        catch_sigterm(self.preempt_requested)

    # ---- training thread -------------------------------------------------------------
    def metric(self, sample: dict) -> None:
        self._inbox.put((METRIC, sample))

    def event(self, kind: str, **fields: Any) -> None:
        self._inbox.put((EVENT, {"kind": kind, "rank": self.rank, "attempt": self.attempt, **fields}))

    def close(self, timeout_s: float = 10.0) -> bool:
        """Flush what is left for at most timeout_s; True if everything was delivered."""
        self._deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._inbox.put(_WAKE)
        self._thread.join(timeout_s + 2.0)  # + one socket timeout for an attempt in progress
        delivered = not self._thread.is_alive() and not self._buf and self._inbox.empty()
        if not delivered:
            log.warning("telemetry: gave up after %.1f s with %d entries undelivered",
                        timeout_s, len(self._buf) + self._inbox.qsize())
        try:
            self._client.close()
        except redis.RedisError:
            pass
        return delivered

    @property
    def buffered(self) -> int:
        """Entries taken off the queue but not yet acknowledged by Redis."""
        return len(self._buf)

    # ---- flush thread ----------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.0
        last_flush = -math.inf
        while True:
            if backoff:  # Redis is down: retry on the backoff schedule, not on every new sample
                stopping = self._stop.wait(backoff)
            else:
                stopping = self._wait_for_work()
                gap = last_flush + self._gap - time.monotonic()
                if gap > 0 and not stopping:
                    stopping = self._stop.wait(gap)  # coalesce a fast rank's samples
            self._drain_inbox()
            self._poll_preempt()
            last_flush = time.monotonic()
            try:
                if self._fence_unknown:
                    raise redis.ConnectionError("the preemption key could not be read since Redis came back")
                self._flush()
                backoff = 0.0
            except redis.RedisError as e:
                if self._preempt_key is not None:
                    self._fence_unknown = True
                    self._next_preempt_poll = 0.0  # read the fence first, the moment Redis answers
                self.failures += 1
                if self.failures == 1 or self.failures % 50 == 0:
                    log.warning("telemetry: redis unavailable (%s); buffering %d entries",
                                e, len(self._buf))
                backoff = min(max(backoff * 2, 0.1), BACKOFF_MAX_S)
            if stopping:
                idle = not self._buf and self._inbox.empty() and not self._dropped_unreported
                if idle or time.monotonic() >= self._deadline:
                    return
                backoff = min(backoff, max(0.0, self._deadline - time.monotonic()))

    def _poll_preempt(self) -> None:
        # Polled on after a preemption request too: an attempt checkpointing its way out may still
        # be fenced meanwhile (its node written off), and then it must not finish that checkpoint.
        if self._preempt_key is None or time.monotonic() < self._next_preempt_poll:
            return
        self._next_preempt_poll = time.monotonic() + PREEMPT_POLL_S
        try:
            raw = self._client.get(self._preempt_key)
        except redis.RedisError:
            return  # Redis away: the control plane's grace period still ends the attempt
        self._fence_unknown = False
        if raw is None:
            return
        if _is_fence(raw):
            self._fenced(raw)
        self.preempt_requested.set()

    def _fenced(self, raw: bytes) -> None:
        """The control plane wrote this attempt off (its node was lost) and the job runs on
        elsewhere: exit now, from this thread, so the training thread takes no further step and
        saves no checkpoint, and drop what is buffered (stale telemetry). Fencing, not cleanup."""
        self._buf.clear()
        msg = (f"trainyard: attempt {self.attempt} was fenced by the control plane ({raw[:200]!r}): its node "
               f"was written off and the job continues elsewhere; exiting now without a checkpoint "
               f"(exit code {FENCED_EXIT_CODE})\n")
        try:
            os.write(2, msg.encode())
        finally:
            os._exit(FENCED_EXIT_CODE)

    def _wait_for_work(self) -> bool:
        """Block until something is queued (or close() was called); True once stopping."""
        if self._stop.is_set():
            return True
        try:
            self._take(self._inbox.get(timeout=PREEMPT_POLL_S if self._preempt_key else IDLE_WAKE_S))
        except queue.Empty:
            pass
        return self._stop.is_set()

    def _drain_inbox(self) -> None:
        get = self._inbox.get_nowait
        while True:
            try:
                item = get()
            except queue.Empty:
                return
            self._take(item)

    def _take(self, item: tuple) -> None:
        if item is _WAKE:
            return
        buf = self._buf
        if len(buf) == buf.maxlen:  # the append below evicts the oldest entry
            if buf[0][0] == METRIC:
                self.dropped_samples += 1
                self._dropped_unreported += 1
            else:
                self.dropped_events += 1
        buf.append(item)

    def _flush(self) -> None:
        while self._buf:
            items = [self._buf[i] for i in range(min(len(self._buf), CHUNK_ENTRIES))]
            pipe = self._client.pipeline(transaction=True)
            samples = 0
            batch: list[dict] = []
            for kind, payload in items:
                if kind == METRIC:
                    batch.append(payload)
                    if len(batch) == BATCH_MAX:
                        samples += self._xadd_metrics(pipe, batch)
                        batch = []
                else:
                    if batch:  # keep stream order: samples queued before this event go first
                        samples += self._xadd_metrics(pipe, batch)
                        batch = []
                    pipe.xadd(self.stream, {"type": EVENT, "data": _dumps(payload)})
            if batch:
                samples += self._xadd_metrics(pipe, batch)
            pipe.execute()
            for _ in items:  # only this thread mutates the buffer, so these are `items`
                self._buf.popleft()
            self.sent_samples += samples
        if self._dropped_unreported:
            count = self._dropped_unreported
            self._client.xadd(self.stream, {"type": EVENT, "data": _dumps(
                {"kind": "telemetry_dropped", "rank": self.rank, "attempt": self.attempt, "count": count})})
            self._dropped_unreported -= count

    def _xadd_metrics(self, pipe: Any, batch: list[dict]) -> int:
        pipe.xadd(self.stream, {"type": METRIC, "data": _dumps(batch)})
        return len(batch)
