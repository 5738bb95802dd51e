"""The relay: job Redis Streams -> database (batched), acknowledged only after commit.

Runtimes XADD entries {type: metrics|event, data: json} and agents XADD {type: log, data: json}
to `trainyard:job:<id>`. The relay reads every job stream with the consumer group `relay`.
An entry is XACKed (and XDELed) only after the transaction holding its rows committed, so a relay
killed between read and ack re-reads the entry from its pending list on restart; the unique
(attempt, rank, step) constraint turns the replay into a no-op instead of a duplicate.

One round: one XREADGROUP over all streams (up to `batch` entries each, blocking only when idle),
one transaction for everything read, then the committed samples go to the Channels groups
`job.<id>` (through a long-lived publisher thread, in order, at most PUBLISH_MAX_SAMPLES per
message), the log lines go to the kept files on disk (jobs.keptlogs: a writer thread, so a slow
disk never holds a round up for long) and one pipelined round trip XACKs, XDELs, appends logs to
the live Redis list and, every STATS_EVERY_S,
bumps the counters in keys.RELAY_STATS_KEY (read by /metrics). Rounds start at most every MIN_ROUND_S;
under load a round takes longer than that and so reads more: batches grow with the rate
instead of the relay falling behind at a fixed batch size.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import orjson
import redis
from django.conf import settings

from trainyard import keys

from . import services
from .keptlogs import LogKeeper, Lines
from .models import Job

log = logging.getLogger("trainyard.relay")
LOG_KEEP_LINES = 5000
STATS_EVERY_S = 0.5
MIN_ROUND_S = 0.02  # rounds start at most 50 times a second: <= 20 ms of added latency
# Samples per websocket message: ~330 bytes each as JSON, so 500 stay far below daphne's 1 MiB
# message limit (autobahn closes a socket that is sent more) and a browser parses one in ~2 ms.
PUBLISH_MAX_SAMPLES = 500


def telemetry_message(samples: list[dict]) -> dict:
    """The `job.telemetry` group message: the samples already encoded as the JSON array that every
    socket of the group sends as is (jobs.consumers splices it into the frame), so neither msgpack
    in channels_redis nor json in daphne walks each sample once per client; `first_step` is what
    a congested consumer needs to know about the batch it skips."""
    steps = [s["step"] for s in samples if type(s.get("step")) is int]
    return {"type": "job.telemetry", "samples_json": orjson.dumps(samples).decode(),
            "first_step": min(steps) if steps else 0, "count": len(samples)}


class ChannelsPublisher:
    """Sends to Channels groups from one long-lived event loop thread, in submission order.

    dispatch.publish (async_to_sync) builds a new event loop, thread and Redis connection for
    every message; here one loop keeps channels_redis' connection pool. The relay thread only
    enqueues; at most `max_queued` messages wait, after that it blocks, so a stalled channel
    layer slows the relay down instead of growing its memory. Delivery is best effort, as in
    dispatch.publish: a browser that misses a live message is repaired by its next snapshot."""

    def __init__(self, max_queued: int = 256):
        self._slots = threading.BoundedSemaphore(max_queued)
        self._loop = asyncio.new_event_loop()
        self._queue: asyncio.Queue | None = None
        self._ready = threading.Event()
        self.errors = 0
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="relay-publisher", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._queue = asyncio.Queue()
        self._task = self._loop.create_task(self._sender())
        self._ready.set()
        self._loop.run_forever()

    async def _sender(self) -> None:
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        while True:
            group, message = await self._queue.get()
            try:
                await layer.group_send(group, message)
                self.sent += 1
            except Exception as exc:  # Redis briefly away: the state is in the database
                self.errors += 1
                if self.errors == 1 or self.errors % 100 == 0:
                    log.warning("publish to %s failed (%d failures so far): %s", group, self.errors, exc)
            finally:
                self._queue.task_done()
                self._slots.release()

    def __call__(self, group: str, message: dict) -> None:
        if not self._slots.acquire(timeout=10):
            self.errors += 1
            log.warning("publisher stalled for 10 s; dropping a message to %s", group)
            return
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (group, message))

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (for at most timeout_s), then stop the loop."""
        async def drain():
            await self._queue.join()
            self._task.cancel()

        try:
            asyncio.run_coroutine_threadsafe(drain(), self._loop).result(timeout_s)
        except Exception:
            log.warning("publisher closed with messages unsent")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)


class Relay:
    def __init__(self, redis_url: str | None = None, consumer: str = "relay-1", batch: int = 500,
                 block_ms: int = 200, publish=None, min_round_s: float = MIN_ROUND_S, keeper: LogKeeper | None = None):
        self.r = redis.Redis.from_url(redis_url or settings.REDIS_URL, socket_timeout=10)
        self.consumer, self.batch, self.block_ms = consumer, batch, block_ms
        self.min_round_s = min_round_s
        self._round_start = 0.0
        self.streams: dict[str, str] = {}  # stream -> next id to read ("0" = own pending first, then ">")
        self._last_scan = 0.0
        self._last_gc = time.monotonic()
        self._last_progress = 0.0
        self.running = True
        self.ingested = 0
        self._publish = publish  # callable(group, message); default: a ChannelsPublisher, made on first use
        self._keeper = keeper  # default: a LogKeeper on settings.TRAINYARD_ARTIFACT_ROOT, made on first use
        self._stats_delta = {"samples_total": 0, "entries_total": 0, "batches_total": 0}
        self._last_batch: dict = {}
        self._stats_written = 0.0

    @property
    def publish(self):
        if self._publish is None:
            self._publish = ChannelsPublisher()
        return self._publish

    @property
    def keeper(self) -> LogKeeper:
        if self._keeper is None:
            self._keeper = LogKeeper(settings.TRAINYARD_ARTIFACT_ROOT, settings.TRAINYARD_LOG_MAX_BYTES_PER_JOB)
        return self._keeper

    def keep_logs(self, per_job: list[tuple[int, list, list[dict], list]]) -> None:
        """Hand this round's log lines to the disk writer, labelled (job, attempt, rank); lines of a
        job that no longer exists (deleted) or without an attempt and rank are not kept."""
        wanted = {job_id for job_id, _, live, _ in per_job if live}
        if not wanted:
            return
        known = set(Job.objects.filter(pk__in=wanted).values_list("pk", flat=True))
        lines: Lines = {}
        for job_id, _, live, _ in per_job:
            for data in live if job_id in known else ():
                attempt, rank = data.get("attempt"), data.get("rank")
                text = [x for x in data.get("lines") or () if type(x) is str]
                if type(attempt) is int and type(rank) is int and rank >= 0 and text:
                    lines.setdefault((job_id, attempt, rank), []).extend(text)
        self.keeper.submit(lines)

    def discover(self) -> None:
        for key in self.r.scan_iter(match=keys.JOB_STREAM_PREFIX + "*", _type="stream", count=1000):
            name = key.decode()
            if name in self.streams:
                continue
            try:
                self.r.xgroup_create(name, keys.RELAY_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            # Start from "0": entries this consumer read but never acked (a crash) come back first.
            self.streams[name] = "0"
        self._last_scan = time.monotonic()

    def step(self) -> int:
        """Read and commit one round of entries; returns how many entries were handled."""
        if time.monotonic() - self._last_scan > 1.0:
            self.discover()
            # The hang detector trusts "no progress in the database" only while this key lives.
            self.r.set(keys.RELAY_ALIVE_KEY, time.time(), ex=10)
        if not self.streams:
            time.sleep(self.block_ms / 1000)
            return 0
        pending = {s: i for s, i in self.streams.items() if i == "0"}
        block = None if pending else self.block_ms
        self._round_start = time.monotonic()
        resp = self.r.xreadgroup(keys.RELAY_GROUP, self.consumer, pending or self.streams, count=self.batch, block=block)
        read = []
        for stream, entries in resp or []:
            stream = stream.decode()
            if not entries and stream in pending:
                self.streams[stream] = ">"  # own pending list drained
                continue
            if entries:
                read.append((stream, entries))
        for s in pending:
            if not any(st.decode() == s for st, _ in resp or []):
                self.streams[s] = ">"
        handled = self.handle(read) if read else 0
        if time.monotonic() - self._last_gc > 30:
            self.gc()
        if handled:
            # A round has a fixed cost (~2 ms CPU here: a transaction, two round trips, a websocket
            # message per job); without a floor, 1k samples/s arriving one entry at a time took
            # ~60% of a core in the relay and as much again in daphne.
            rest = self._round_start + self.min_round_s - time.monotonic()
            if rest > 0:
                time.sleep(rest)
        return handled

    def handle(self, read: list[tuple[str, list]]) -> int:
        """Commit, fan out and acknowledge the entries of one XREADGROUP (all streams together)."""
        t0 = time.monotonic()
        samples: list[dict] = []
        events: list[dict] = []
        per_job: list[tuple[int, list[dict], list[dict], list[bytes]]] = []  # job, samples, live logs, log lines
        n_entries = 0
        for stream, entries in read:
            job_id = keys.stream_job_id(stream)
            job_samples: list[dict] = []
            live_logs: list[dict] = []
            logs: list[bytes] = []
            for _id, fields in entries:
                kind = fields.get(b"type", b"")
                try:
                    data = orjson.loads(fields.get(b"data", b"null"))
                except orjson.JSONDecodeError:
                    log.warning("dropping malformed entry %s in %s", _id, stream)
                    continue
                if kind == b"metrics" and type(data) is list:
                    job_samples.extend(d for d in data if type(d) is dict)
                elif kind == b"event" and type(data) is dict:
                    events.append(data)
                elif kind == b"log" and type(data) is dict:
                    live_logs.append(data)
                    for line in data.get("lines") or []:
                        logs.append(orjson.dumps({"rank": data.get("rank"), "attempt": data.get("attempt"),
                                                  "stream": data.get("stream"), "line": line}))
            n_entries += len(entries)
            samples.extend(job_samples)
            per_job.append((job_id, job_samples, live_logs, logs))
        if samples or events:
            services.telemetry_ingest(samples, events=events)  # commits
        # Fan out only what is committed: a browser never sees a point the database lacks.
        publish = self.publish
        for job_id, job_samples, live_logs, _ in per_job:
            group = f"job.{job_id}"
            for i in range(0, len(job_samples), PUBLISH_MAX_SAMPLES):
                publish(group, telemetry_message(job_samples[i:i + PUBLISH_MAX_SAMPLES]))
            for data in live_logs:
                publish(group, {"type": "job.log", "rank": data.get("rank"), "attempt": data.get("attempt"),
                                "stream": data.get("stream", "stdout"), "lines": data.get("lines") or []})
        self.keep_logs(per_job)
        pipe = self.r.pipeline(transaction=False)
        for (stream, entries), (job_id, _, _, logs) in zip(read, per_job):
            if logs:
                pipe.rpush(keys.job_log_key(job_id), *logs)
                pipe.ltrim(keys.job_log_key(job_id), -LOG_KEEP_LINES, -1)
            ids = [e[0] for e in entries]
            pipe.xack(stream, keys.RELAY_GROUP, *ids)
            pipe.xdel(stream, *ids)
        self._count(len(samples), n_entries, t0)
        if time.monotonic() - self._stats_written >= STATS_EVERY_S:
            self._write_stats(pipe)
        pipe.execute()
        self.ingested += len(samples)
        if samples and time.monotonic() - self._last_progress > 1.0:
            self._last_progress = time.monotonic()
            # progress of running jobs for /ws/cluster/, at most once a second
            publish("cluster", {"type": "cluster.changed", "what": "jobs"})
        return n_entries

    def _count(self, samples: int, entries: int, t0: float) -> None:
        d = self._stats_delta
        d["samples_total"] += samples
        d["entries_total"] += entries
        d["batches_total"] += 1
        self._last_batch = {"last_batch_unixtime": time.time(), "last_batch_samples": samples,
                            "last_batch_seconds": round(time.monotonic() - t0, 6)}

    def _write_stats(self, pipe) -> None:
        """Counters for /metrics, at most every STATS_EVERY_S (5 commands a round cost ~0.3 ms)."""
        for key, delta in self._stats_delta.items():
            if delta:
                pipe.hincrby(keys.RELAY_STATS_KEY, key, delta)
        self._stats_delta = dict.fromkeys(self._stats_delta, 0)
        kept = self._keeper.stats if self._keeper is not None else {}
        pipe.hset(keys.RELAY_STATS_KEY, mapping={
            **self._last_batch, "publish_errors_total": getattr(self._publish, "errors", 0),
            "log_lines_kept_total": kept.get("lines_written", 0),
            "log_lines_not_kept_total": kept.get("lines_dropped_queue", 0) + kept.get("lines_write_errors", 0)})
        self._stats_written = time.monotonic()

    def gc(self) -> None:
        """Forget drained streams of finished jobs (the stream key itself stays until empty)."""
        self._last_gc = time.monotonic()
        for stream in list(self.streams):
            job_id = keys.stream_job_id(stream)
            done = Job.objects.filter(pk=job_id, status__in=Job.TERMINAL).exists()
            if done and self.r.xlen(stream) == 0:
                self.r.delete(stream)
                self.streams.pop(stream, None)

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.close()  # the lines of the last rounds reach the disk
        if self._last_batch:
            try:
                pipe = self.r.pipeline(transaction=False)
                self._write_stats(pipe)
                pipe.execute()
            except redis.RedisError:
                pass
        if isinstance(self._publish, ChannelsPublisher):
            self._publish.close()

    def run_forever(self) -> None:
        def _stop(*_):
            self.running = False

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        log.info("relay %s started", self.consumer)
        self.r.hset(keys.RELAY_STATS_KEY, mapping={"started_unixtime": time.time(), "consumer": self.consumer})
        try:
            while self.running:
                try:
                    self.step()
                except redis.ConnectionError as exc:
                    log.warning("redis unavailable (%s); retrying", exc)
                    time.sleep(1.0)
        finally:
            self.close()

