"""The relay: job Redis Streams -> database (batched), acknowledged only after commit.

Runtimes XADD entries {type: metrics|event, data: json} and agents XADD {type: log, data: json}
to `trainyard:job:<id>`. The relay reads every job stream with the consumer group `relay`.
An entry is XACKed (and XDELed) only after the transaction holding its rows committed, so a relay
killed between read and ack re-reads the entry from its pending list on restart; the unique
(attempt, rank, step) constraint turns the replay into a no-op instead of a duplicate.
"""
from __future__ import annotations

import json
import logging
import signal
import time

import redis
from django.conf import settings

from . import dispatch, services
from .models import Job

log = logging.getLogger("trainyard.relay")
GROUP = "relay"
LOG_KEEP_LINES = 5000


def log_key(job_id: int) -> str:
    return f"trainyard:joblog:{job_id}"


class Relay:
    def __init__(self, redis_url: str | None = None, consumer: str = "relay-1", batch: int = 500,
                 block_ms: int = 200):
        self.r = redis.Redis.from_url(redis_url or settings.REDIS_URL, socket_timeout=10)
        self.consumer, self.batch, self.block_ms = consumer, batch, block_ms
        self.streams: dict[str, str] = {}  # stream -> next id to read ("0" = own pending first, then ">")
        self._last_scan = 0.0
        self._last_gc = time.monotonic()
        self._last_progress = 0.0
        self.running = True
        self.ingested = 0

    def discover(self) -> None:
        for key in self.r.scan_iter(match=services.STREAM_PREFIX + "*", _type="stream", count=1000):
            name = key.decode()
            if name in self.streams:
                continue
            try:
                self.r.xgroup_create(name, GROUP, id="0", mkstream=True)
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
        if not self.streams:
            time.sleep(self.block_ms / 1000)
            return 0
        pending = {s: i for s, i in self.streams.items() if i == "0"}
        block = None if pending else self.block_ms
        resp = self.r.xreadgroup(GROUP, self.consumer, pending or self.streams, count=self.batch, block=block)
        handled = 0
        for stream, entries in resp or []:
            stream = stream.decode()
            if not entries and stream in pending:
                self.streams[stream] = ">"  # own pending list drained
                continue
            handled += self.handle(stream, entries)
        for s in pending:
            if not any(st.decode() == s for st, _ in resp or []):
                self.streams[s] = ">"
        if time.monotonic() - self._last_gc > 30:
            self.gc()
        return handled

    def handle(self, stream: str, entries: list) -> int:
        job_id = int(stream.rsplit(":", 1)[1])
        samples: list[dict] = []
        events: list[dict] = []
        logs: list[str] = []
        live_logs: list[dict] = []
        for _id, fields in entries:
            kind = fields.get(b"type", b"").decode()
            try:
                data = json.loads(fields.get(b"data", b"null"))
            except ValueError:
                log.warning("dropping malformed entry %s in %s", _id, stream)
                continue
            if kind == "metrics" and isinstance(data, list):
                samples.extend(d for d in data if isinstance(d, dict))
            elif kind == "event" and isinstance(data, dict):
                events.append(data)
            elif kind == "log" and isinstance(data, dict):
                live_logs.append(data)
                for line in data.get("lines") or []:
                    logs.append(json.dumps({"rank": data.get("rank"), "attempt": data.get("attempt"),
                                            "stream": data.get("stream"), "line": line}))
        services.telemetry_ingest(samples, events)  # commits
        ids = [e[0] for e in entries]
        pipe = self.r.pipeline(transaction=False)
        if logs:
            pipe.rpush(log_key(job_id), *logs)
            pipe.ltrim(log_key(job_id), -LOG_KEEP_LINES, -1)
        pipe.xack(stream, GROUP, *ids)
        pipe.xdel(stream, *ids)
        pipe.execute()
        self.ingested += len(samples)
        # Fan out only what is committed: a browser never sees a point the database lacks.
        group = f"job.{job_id}"
        if samples:
            dispatch.publish(group, {"type": "job.telemetry", "samples": samples})
        for data in live_logs:
            dispatch.publish(group, {"type": "job.log", "rank": data.get("rank"), "attempt": data.get("attempt"),
                                     "stream": data.get("stream", "stdout"), "lines": data.get("lines") or []})
        if samples and time.monotonic() - self._last_progress > 1.0:
            self._last_progress = time.monotonic()
            dispatch.publish_cluster_changed("jobs")  # progress of running jobs, at most once a second
        return len(entries)

    def gc(self) -> None:
        """Forget drained streams of finished jobs (the stream key itself stays until empty)."""
        self._last_gc = time.monotonic()
        for stream in list(self.streams):
            job_id = int(stream.rsplit(":", 1)[1])
            done = Job.objects.filter(pk=job_id, status__in=Job.TERMINAL).exists()
            if done and self.r.xlen(stream) == 0:
                self.r.delete(stream)
                self.streams.pop(stream, None)

    def run_forever(self) -> None:
        def _stop(*_):
            self.running = False

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        log.info("relay %s started", self.consumer)
        while self.running:
            try:
                self.step()
            except redis.ConnectionError as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                time.sleep(1.0)
