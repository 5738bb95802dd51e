"""The relay: job Redis Streams -> database (batched), acknowledged only after commit.

Runtimes XADD entries {type: metrics|event, data: json} and agents XADD {type: log, data: json}
to their attempt's stream `trainyard:job:<job>:a<attempt>`, which only that attempt's own Redis user
may write: the stream is the proof of the attempt behind an entry (issue 21). The relay reads the
streams of attempts the database knows with the consumer group `relay`; a stream of no known
attempt is never read.
An entry is XACKed (and XDELed) only after the transaction holding its rows committed, so a relay
killed between read and ack re-reads the entry from its pending list on restart; the unique
(attempt, rank, step) constraint turns the replay into a no-op instead of a duplicate.

One round: XREADGROUPs over all streams, READ_STREAMS at a time, up to `batch` entries each (a
new stream starts at FIRST_COUNT and doubles while its entries are small; one that sent an entry
over BIG_ENTRY_BYTES is read one entry a round until it sends small ones again, so memory per round
stays bounded by Redis' proto-max-bulk-len, not by what a job chooses to send), blocking only when idle,
one transaction for everything read, then the committed samples go to the Channels groups
`job.<id>` (through a long-lived publisher thread, in order, at most PUBLISH_MAX_SAMPLES per
message), the log lines go to the kept files on disk (jobs.telemetry.keptlogs: a writer thread, so a slow
disk never holds a round up for long) and one pipelined round trip XACKs, XDELs, appends logs to
the live Redis list and, every STATS_EVERY_S,
bumps the counters in keys.RELAY_STATS_KEY (read by /metrics). Rounds start at most every MIN_ROUND_S;
under load a round takes longer than that and so reads more: batches grow with the rate
instead of the relay falling behind at a fixed batch size.

Nothing on the bus stops the relay: every entry passes jobs/telemetry/entries.py's schema and must name
only attempts of the job whose stream carried it (a checkpoint report also a complete
checkpoint on disk) before anything is applied; the rest goes to keys.DEADLETTER_STREAM with the
reason (staff: /relay/dead-letters/, /metrics: trainyard_relay_deadletter_total). Database errors
are retried with backoff (the transaction rolled back, so the round commits once); an entry that
raises otherwise is dead-lettered after POISON_TRIES tries, and run_forever survives any error.
"""
from __future__ import annotations

import logging
import signal
import time

from typing import Any, NamedTuple

import orjson
import redis
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection

from trainyard import keys

from jobs.telemetry import entries, ingest
from jobs.attempts.services import checkpoints
from jobs.telemetry.keptlogs import LogKeeper, Lines, default_keeper
from jobs.telemetry.publish import ChannelsPublisher, telemetry_message
from jobs.models import Attempt

log = logging.getLogger("trainyard.relay")
LOG_KEEP_LINES = 5000
STATS_EVERY_S = 0.5
MIN_ROUND_S = 0.02  # rounds start at most 50 times a second: <= 20 ms of added latency
# Samples per websocket message: ~330 bytes each as JSON, so 500 stay far below daphne's 1 MiB
# message limit (autobahn closes a socket that is sent more) and a browser parses one in ~2 ms.
PUBLISH_MAX_SAMPLES = 500
POISON_TRIES = 3  # an entry whose processing raised this often is dead-lettered, not re-read forever
DB_BACKOFF_MIN_S, DB_BACKOFF_MAX_S = 0.05, 2.0
ERROR_BACKOFF_MAX_S = 5.0
READ_STREAMS = 64  # streams per XREADGROUP
BATCH = 32  # entries per stream per round: a reporter's entry holds up to 500 samples (< 256 KB)
BIG_ENTRY_BYTES = 1 << 20  # no reporter writes one; a stream that does is read one entry a round
FIRST_COUNT = 4  # entries of a stream's first read (it doubles while they are small)
IGNORED_FORGET_S = 60.0  # streams of no known attempt are looked up again after this


class Parsed(NamedTuple):
    """A stream entry that passed the schema (jobs/telemetry/entries.py)."""

    stream: str
    job_id: int
    attempt_id: int
    entry_id: bytes
    fields: dict
    kind: str
    data: Any


class _Abandon(Exception):
    """Asked to stop while the database refused the round: leave it unacknowledged."""


class Relay:
    def __init__(self, redis_url: str | None = None, consumer: str = "relay-1", batch: int = BATCH,
                 block_ms: int = 200, publish=None, min_round_s: float = MIN_ROUND_S, keeper: LogKeeper | None = None):
        self.r = redis.Redis.from_url(redis_url or settings.REDIS_URL, socket_timeout=10)
        self.consumer, self.batch, self.block_ms = consumer, batch, block_ms
        self.min_round_s = min_round_s
        self._round_start = 0.0
        self.streams: dict[str, str] = {}  # stream -> next id to read ("0" = own pending first, then ">")
        self._counts: dict[str, int] = {}  # stream -> entries per read (see _read)
        self._ignored: set[str] = set()  # streams of no known attempt (forgotten every IGNORED_FORGET_S)
        self._ignored_at = time.monotonic()
        self._last_scan = 0.0
        self._started = time.time()  # keys.RELAY_STARTED_KEY
        self._last_gc = time.monotonic()
        self._last_progress = 0.0
        self.running = True
        self.ingested = 0
        self._publish = publish  # callable(group, message); default: a ChannelsPublisher, made on first use
        self._keeper = keeper  # default: keptlogs.default_keeper(), made on first use
        self._stats_delta = {"samples_total": 0, "entries_total": 0, "batches_total": 0,
                             "db_retries_total": 0, "orphaned_total": 0}
        self._round: list[tuple[str, bytes]] = []  # (stream, id) of the round in progress
        self._failures: dict[tuple[str, bytes], int] = {}  # rounds that raised, per entry
        self._last_error = ""
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
            self._keeper = default_keeper()
        return self._keeper

    def keep_logs(self, per_job: list[tuple[int, list, list[dict], list]]) -> None:
        """Hand this round's log lines to the disk writer, labelled (job, attempt, rank); lines
        without an attempt and rank are not kept. Every job here exists (checked by `sort`)."""
        lines: Lines = {}
        for job_id, _, live, _ in per_job:
            for data in live:
                attempt, rank = data.get("attempt"), data.get("rank")
                if type(attempt) is int and type(rank) is int and data["lines"]:
                    lines.setdefault((job_id, attempt, rank), []).extend(data["lines"])
        if lines:
            self.keeper.submit(lines)

    def discover(self) -> None:
        """Find new attempt streams (SCAN); read only those of attempts the database knows."""
        if time.monotonic() - self._ignored_at > IGNORED_FORGET_S:
            self._ignored, self._ignored_at = set(), time.monotonic()
        found: dict[str, tuple[int, int]] = {}
        for key in self.r.scan_iter(match=keys.JOB_STREAM_PREFIX + "*", _type="stream", count=1000):
            try:
                name = key.decode()
            except UnicodeDecodeError:  # never a stream's name (and redis-py could not name it back)
                continue
            if name in self.streams or name in self._ignored:
                continue
            ids = entries.stream_ids(name)
            if ids is None:
                self._ignored.add(name)
                continue
            found[name] = ids
        if found:
            _, owners = self._retry_db(lambda: ingest.telemetry_owners(set(), {a for _, a in found.values()}))
            for name, (job_id, attempt_id) in found.items():
                if owners.get(attempt_id) != job_id:
                    self._ignored.add(name)  # no such attempt of that job: nothing of it is read
                    self._stats_delta["orphaned_total"] += 1
                    continue
                self._add_stream(name)
        self._last_scan = time.monotonic()

    def _add_stream(self, name: str) -> None:
        try:
            self.r.xgroup_create(name, keys.RELAY_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):  # e.g. the key stopped being a stream since SCAN
                log.warning("cannot read %s: %s", name[:200], exc)
                return
        # Start from "0": entries this consumer read but never acked (a crash) come back first.
        self.streams[name] = "0"

    def step(self) -> int:
        """Read and commit one round of entries; returns how many entries were handled."""
        if time.monotonic() - self._last_scan > 1.0:
            self.discover()
            # The hang detector trusts "no progress in the database" only while these keys live,
            # and only since this relay started (a restarted relay commits the backlog after it).
            self.r.pipeline(transaction=False).set(keys.RELAY_ALIVE_KEY, time.time(), ex=10).set(
                keys.RELAY_STARTED_KEY, self._started, ex=10).execute()
        if not self.streams:
            time.sleep(self.block_ms / 1000)
            return 0
        self._round_start = time.monotonic()
        read = self._read()
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

    def _read(self) -> list[tuple[str, list]]:
        """One round's entries: own pending entries first (after a restart), then new ones; at most
        READ_STREAMS streams per call, each stream up to its own count: a new stream starts at
        FIRST_COUNT entries, a stream whose entries were all small doubles up to `batch`, one that
        sent an entry over BIG_ENTRY_BYTES is read one entry a round (memory per round stays a few
        entries of at most proto-max-bulk-len each, whatever a job sends)."""
        pending = [s for s, i in self.streams.items() if i == "0"]
        names = pending or [s for s in self.streams if self.streams[s] != "0"]
        block = None if pending else self.block_ms
        read = []
        for i in range(0, len(names), READ_STREAMS):
            chunk = names[i:i + READ_STREAMS]
            for count in sorted({self._read_count(s) for s in chunk}):
                part = [s for s in chunk if self._read_count(s) == count]
                resp = self.r.xreadgroup(keys.RELAY_GROUP, self.consumer, {s: self.streams[s] for s in part},
                                         count=count, block=block)
                block = None  # only the first call of a round waits
                got = {st.decode(): entries_ for st, entries_ in resp or []}
                for s in part:
                    if got.get(s):
                        read.append((s, got[s]))
                        self._note_size(s, got[s])
                    elif self.streams[s] == "0":
                        self.streams[s] = ">"  # own pending list drained
        return read

    def _read_count(self, stream: str) -> int:
        return self._counts.get(stream, FIRST_COUNT)

    def _note_size(self, stream: str, got: list) -> None:
        big = any(len(v) > BIG_ENTRY_BYTES for _, fields in got for v in fields.values())
        self._counts[stream] = 1 if big else min(self.batch, max(FIRST_COUNT, 2 * self._read_count(stream)))

    def handle(self, read: list[tuple[str, list]]) -> int:
        """Check, commit, fan out and acknowledge the entries of one XREADGROUP (all streams
        together). Nothing in an entry can make this raise: what fails the schema, names another
        job's attempt, reports a checkpoint that is not on disk or raises when applied goes to the
        dead-letter stream; a database error is retried (the round is then committed once)."""
        t0 = time.monotonic()
        self._round = [(stream, e[0]) for stream, got in read for e in got]
        ok, dead = self.sort(read)
        ok = self.apply(ok, dead)
        per_job: dict[int, tuple[int, list[dict], list[dict], list[bytes]]] = {}
        for p in ok:
            _, job_samples, live_logs, logs = per_job.setdefault(p.job_id, (p.job_id, [], [], []))
            if p.kind == "metrics":
                job_samples.extend(p.data)
            elif p.kind == "log":
                live_logs.append(p.data)
                logs.extend(orjson.dumps({"rank": p.data.get("rank"), "attempt": p.data.get("attempt"),
                                          "stream": p.data.get("stream"), "line": line}) for line in p.data["lines"])
        try:  # committed: nothing from here on may make the round run (and apply) again
            self.fan_out(list(per_job.values()))
        except Exception:
            log.exception("fan-out of a committed round failed; its entries are acknowledged anyway")
        pipe = self.r.pipeline(transaction=False)
        for job_id, _, _, logs in per_job.values():
            if logs:
                pipe.rpush(keys.job_log_key(job_id), *logs)
                pipe.ltrim(keys.job_log_key(job_id), -LOG_KEEP_LINES, -1)
        for i, (stream, entry_id, fields, reason) in enumerate(dead):
            if i < 3:  # a flood of bad entries must not flood the log: the stream has them all
                log.warning("dead-lettered entry %s of %s: %s", entry_id, stream[:200], reason)
            entries.dead_letter(pipe, stream, entry_id, fields, reason)
        if dead:
            pipe.hincrby(keys.RELAY_STATS_KEY, "deadletter_total", len(dead))
            if len(dead) > 3:
                log.warning("dead-lettered %d more entries this round", len(dead) - 3)
        for stream, stream_entries in read:
            ids = [e[0] for e in stream_entries]
            pipe.xack(stream, keys.RELAY_GROUP, *ids)
            pipe.xdel(stream, *ids)
        n_samples = sum(len(j[1]) for j in per_job.values())
        self._count(n_samples, len(self._round), t0)
        if time.monotonic() - self._stats_written >= STATS_EVERY_S:
            self._write_stats(pipe)
        pipe.execute()
        for key in self._round:
            self._failures.pop(key, None)
        handled, self._round = len(self._round), []
        self.ingested += n_samples
        if n_samples and time.monotonic() - self._last_progress > 1.0:
            self._last_progress = time.monotonic()
            # progress of running jobs for /ws/cluster/, at most once a second
            self.publish("cluster", {"type": "cluster.changed", "what": "jobs"})
        return handled

    def sort(self, read: list[tuple[str, list]]) -> tuple[list[Parsed], list[tuple]]:
        """(the entries to apply, the dead letters (stream, id, fields, reason)). Entries of a job
        deleted meanwhile are neither: they are acknowledged and dropped."""
        parsed: list[Parsed] = []
        dead: list[tuple] = []
        for stream, stream_entries in read:
            ids = entries.stream_ids(stream)
            for entry_id, fields in stream_entries:
                tries = self._failures.get((stream, entry_id), 0)
                try:
                    if tries >= POISON_TRIES:
                        raise entries.EntryError(f"processing it failed {tries} times, last: {self._last_error}")
                    if ids is None:
                        raise entries.EntryError(
                            f"stream {stream[:100]!r} is not named {keys.JOB_STREAM_PREFIX}<job>:a<attempt>")
                    kind, data = entries.parse_entry(fields)
                except entries.EntryError as exc:
                    dead.append((stream, entry_id, fields, str(exc)))
                    continue
                parsed.append(Parsed(stream, ids[0], ids[1], entry_id, fields, kind, data))
        jobs, owners = self._retry_db(lambda: ingest.telemetry_owners(
            {p.job_id for p in parsed}, {p.attempt_id for p in parsed}))
        ok = []
        for p in parsed:
            if p.job_id not in jobs:
                self._stats_delta["orphaned_total"] += 1
                continue
            # Only the stream's attempt's own Redis user can write it: an entry naming any other
            # attempt was written by that attempt's ranks about someone else's.
            foreign = sorted(a for a in entries.entry_attempts(p.kind, p.data) if a != p.attempt_id)
            why = (f"it names attempt {foreign[0]} but arrived on attempt {p.attempt_id}'s stream" if foreign
                   else f"attempt {p.attempt_id} is not an attempt of job {p.job_id}"
                   if owners.get(p.attempt_id) != p.job_id else "")
            if not why and p.kind == "event" and p.data["kind"] == "checkpoint":
                why = checkpoints.checkpoint_verify(p.job_id, p.data["attempt"], p.data["step"], p.data["path"])[1]
            if why:
                dead.append((p.stream, p.entry_id, p.fields, why))
            else:
                ok.append(p)
        return ok, dead

    def apply(self, ok: list[Parsed], dead: list[tuple]) -> list[Parsed]:
        """Commit the samples and events of `ok` in one transaction; returns the entries applied.
        If that raises anything but a database error, each entry is applied alone (POISON_TRIES
        times at most) and the ones that still raise join `dead`."""
        samples = [s for p in ok if p.kind == "metrics" for s in p.data]
        events = [p.data for p in ok if p.kind == "event"]
        if not samples and not events:
            return ok
        try:
            self._retry_db(lambda: ingest.telemetry_ingest(samples, events=events))
            return ok
        except _Abandon:
            raise
        except Exception as exc:
            log.exception("applying %d entries failed (%s); applying them one by one", len(ok), exc)
        applied = []
        for p in ok:
            error = None
            for _ in range(POISON_TRIES if p.kind != "log" else 0):
                try:
                    self._retry_db(lambda p=p: ingest.telemetry_ingest(
                        p.data if p.kind == "metrics" else [], events=[p.data] if p.kind == "event" else []))
                    error = None
                    break
                except _Abandon:
                    raise
                except Exception as exc:
                    error = exc
            if error is None:
                applied.append(p)
            else:
                dead.append((p.stream, p.entry_id, p.fields, f"applying it raised {type(error).__name__}: {error}"))
        return applied

    def _retry_db(self, fn):
        """fn() until it does not raise a database error (locked, connection lost): the transaction
        rolled back, so the retry applies the round exactly once. Backoff doubles up to
        DB_BACKOFF_MAX_S; a stop request abandons the round unacknowledged (re-read on restart)."""
        delay = DB_BACKOFF_MIN_S
        while True:
            try:
                return fn()
            except (OperationalError, InterfaceError) as exc:
                self._stats_delta["db_retries_total"] += 1
                log.warning("database error (%s); retrying in %.2f s", exc, delay)
                if not connection.in_atomic_block and not connection.is_usable():
                    connection.close()  # a broken connection (PostgreSQL restarted): the retry reconnects
                deadline = time.monotonic() + delay
                while self.running and time.monotonic() < deadline:
                    time.sleep(min(0.05, delay))
                if not self.running:
                    raise _Abandon() from exc
                delay = min(delay * 2, DB_BACKOFF_MAX_S)

    def fan_out(self, per_job: list[tuple[int, list, list[dict], list]]) -> None:
        """Committed samples and log lines to the job's Channels group and the kept log files:
        a browser never sees a point the database lacks."""
        publish = self.publish
        for job_id, job_samples, live_logs, _ in per_job:
            group = f"job.{job_id}"
            for i in range(0, len(job_samples), PUBLISH_MAX_SAMPLES):
                publish(group, telemetry_message(job_samples[i:i + PUBLISH_MAX_SAMPLES]))
            for data in live_logs:
                publish(group, {"type": "job.log", "rank": data.get("rank"), "attempt": data.get("attempt"),
                                "stream": data.get("stream", "stdout"), "lines": data["lines"]})
        self.keep_logs(per_job)

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
        """Forget drained streams of ended attempts (the stream key itself stays until empty): its
        Redis user was deleted with its end, so nothing more can arrive."""
        self._last_gc = time.monotonic()
        ids = {s: entries.stream_ids(s) for s in self.streams}
        live = set(Attempt.objects.filter(pk__in={i[1] for i in ids.values() if i}).exclude(
            status=Attempt.Status.ENDED).values_list("pk", flat=True))
        for stream, i in ids.items():
            if (i is None or i[1] not in live) and self.r.xlen(stream) == 0:
                self.r.delete(stream)
                self.streams.pop(stream, None)
                self._counts.pop(stream, None)

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
        errors = 0
        try:
            while self.running:
                try:
                    self.step()
                    errors = 0
                except _Abandon:
                    log.warning("stopping with a round unacknowledged: it is read again on restart")
                except redis.ConnectionError as exc:
                    log.warning("redis unavailable (%s); retrying", exc)
                    time.sleep(1.0)
                except Exception as exc:  # never exit on data: count it against the round's entries
                    errors += 1
                    self.round_failed(exc)
                    time.sleep(min(ERROR_BACKOFF_MAX_S, 0.1 * 2 ** min(errors, 6)))
        finally:
            self.close()

    def round_failed(self, exc: BaseException) -> None:
        """A round raised outside the per-entry checks (a bug, a stream deleted under the relay):
        each of its entries counts one failure (POISON_TRIES of them dead-letter it in `sort`), and
        every stream is read again from its own pending entries, so nothing read is lost."""
        log.exception("relay round failed: %s", exc)
        self._last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        if len(self._failures) > 100_000:
            self._failures.clear()
        for key in self._round:
            self._failures[key] = self._failures.get(key, 0) + 1
        self._round = []
        if isinstance(exc, redis.ResponseError):  # NOGROUP, WRONGTYPE: find the streams again
            self.streams.clear()
            self._last_scan = 0.0
        else:
            self.streams = dict.fromkeys(self.streams, "0")

