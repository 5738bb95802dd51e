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
one transaction for everything read (the per-rank rows and their per-step rollup: ingest.py,
rollup.py), then what was committed goes to the Channels groups `job.<id>` (through a long-lived
publisher thread, in order): one reduced row per (attempt, step) the round touched, read back from
MetricStep in one SELECT, plus the samples of the few named ranks (publish.reduced_messages, at most
PUBLISH_MAX_SAMPLES per message), so a frame grows with the steps, not the ranks; the log lines go to the kept files on disk (jobs.telemetry.keptlogs: a writer thread, so a slow
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

`Relay` runs the rounds: one round's check, commit, fan-out and acknowledgement, the kept logs,
failed rounds and the process' loop. Its collaborators own the rest: jobs/telemetry/relay_streams.py
which streams are read and how much of each (discovery, XREADGROUP, read sizes, gc),
jobs/telemetry/relay_sort.py which entries are applied and which dead-lettered,
jobs/telemetry/relay_writes.py the transaction and its retries, jobs/telemetry/relay_stats.py the
counters for /metrics.
"""
from __future__ import annotations

import gc
import logging
import signal
import time

import orjson
import redis
from django.conf import settings

from trainyard import keys

from jobs.planning.services.knowledge import knowledge_refresh
from jobs.telemetry import entries, ingest
from jobs.telemetry.keptlogs import LogKeeper, Lines, default_keeper
from jobs.telemetry.publish import ChannelsPublisher, NamedTracker, reduced_messages
# POISON_TRIES is re-exported: the relay's limit, as callers (and its tests) know it.
from jobs.telemetry.relay_sort import POISON_TRIES as POISON_TRIES, Parsed, sort_entries
from jobs.telemetry.relay_stats import RelayStats
from jobs.telemetry.relay_streams import BATCH, StreamReader
from jobs.telemetry.relay_writes import Abandon, apply_entries, retry_db

log = logging.getLogger("trainyard.relay")
LOG_KEEP_LINES = 5000
MIN_ROUND_S = 0.02  # rounds start at most 50 times a second: <= 20 ms of added latency
# Samples per websocket message: ~330 bytes each as JSON, so 500 stay far below daphne's 1 MiB
# message limit (autobahn closes a socket that is sent more) and a browser parses one in ~2 ms.
PUBLISH_MAX_SAMPLES = 500
ERROR_BACKOFF_MAX_S = 5.0
GC_EVERY_S, GC_FULL_EVERY_S = 1.0, 60.0  # RoundCollector
# An ended attempt's knowledge record takes in samples committed after its end (its last flush,
# or a backlog the relay works through after a restart): rewritten at most this often, not after
# every round (a rewrite reads up to 1,000 steps, ~10 ms: in rounds of a few entries that was over half
# the relay's CPU, bench/relay_profile.py --ended --batch 4).
LATE_REFRESH_S = 2.0


class RoundCollector:
    """Python's cyclic garbage collector between the relay's rounds instead of inside them.

    A round holds tens of thousands of young containers (orjson's dicts, the rows' tuples) alive at once:
    with automatic collection every 700 allocations they were scanned again and again, promoted, and
    set off full collections over everything the process holds: ~30% of the relay's CPU
    (bench/relay_profile.py --gc off: 21 -> 15 us a sample at 2 ranks a job, 12 -> 8.5 at 1,024). What
    startup made is frozen (never scanned again); between rounds, when the round's objects are gone,
    the young generations are collected at most every GC_EVERY_S and everything every GC_FULL_EVERY_S,
    so a cycle a round leaves (a traceback) lives a second, not forever."""

    def __init__(self):
        gc.collect()
        gc.freeze()
        gc.disable()
        self.young = self.full = time.monotonic()

    def between_rounds(self) -> None:
        now = time.monotonic()
        if now - self.full >= GC_FULL_EVERY_S:
            gc.collect()
            self.young = self.full = now
        elif now - self.young >= GC_EVERY_S:
            gc.collect(1)
            self.young = now

    def stop(self) -> None:
        gc.enable()
        gc.unfreeze()


class Relay:
    def __init__(self, redis_url: str | None = None, consumer: str = "relay-1", batch: int = BATCH,
                 block_ms: int = 200, publish=None, min_round_s: float = MIN_ROUND_S, keeper: LogKeeper | None = None,
                 shard: tuple[int, int] = (0, 1)):
        self.r = redis.Redis.from_url(redis_url or settings.REDIS_URL, socket_timeout=10)
        self.stats = RelayStats()
        self.reader = StreamReader(self.r, consumer, batch, block_ms, self.stats, shard)
        self.min_round_s = min_round_s
        self._round_start = 0.0
        self._started = time.time()  # keys.RELAY_STARTED_KEY
        self._last_progress = 0.0
        self.running = True
        self.ingested = 0
        self._publish = publish  # callable(group, message); default: a ChannelsPublisher, made on first use
        self._keeper = keeper  # default: keptlogs.default_keeper(), made on first use
        self._round: list[tuple[str, bytes]] = []  # (stream, id) of the round in progress
        self._failures: dict[tuple[str, bytes], int] = {}  # rounds that raised, per entry
        self._last_error = ""
        self._late: set[int] = set()  # ended attempts whose knowledge records want rewriting
        self._late_at = float("-inf")  # the first rewrite is not held back

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

    @property
    def consumer(self) -> str:
        return self.reader.consumer

    @property
    def streams(self) -> dict[str, str]:
        """stream -> next id to read ("0" = own pending first, then ">"): the reader's."""
        return self.reader.streams

    @streams.setter
    def streams(self, value: dict[str, str]) -> None:
        self.reader.streams = value

    @property
    def _counts(self) -> dict[str, int]:
        return self.reader.counts  # stream -> entries per read

    @property
    def _stats_delta(self) -> dict[str, int]:
        return self.stats.delta  # the counters not yet written to keys.RELAY_STATS_KEY

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
        self.reader.discover(lambda attempts: self._retry_db(lambda: ingest.telemetry_owners(set(), attempts))[1])

    def step(self) -> int:
        """Read and commit one round of entries; returns how many entries were handled."""
        if time.monotonic() - self.reader.last_scan > 1.0:
            self.discover()
            # The hang detector trusts "no progress in the database" only while these keys live,
            # and only since this relay started (a restarted relay commits the backlog after it).
            self.r.pipeline(transaction=False).set(keys.RELAY_ALIVE_KEY, time.time(), ex=10).set(
                keys.RELAY_STARTED_KEY, self._started, ex=10).execute()
        if not self.streams:
            time.sleep(self.reader.block_ms / 1000)
            return 0
        self._round_start = time.monotonic()
        read = self.reader.read()
        handled = self.handle(read) if read else 0
        if time.monotonic() - self.reader.last_gc > 30:
            self.gc()
        if self._late and time.monotonic() - self._late_at >= LATE_REFRESH_S:
            self.refresh_late()
        if handled:
            # A round has a fixed cost (~2 ms CPU here: a transaction, two round trips, a websocket
            # message per job); without a floor, 1k samples/s arriving one entry at a time took
            # ~60% of a core in the relay and as much again in daphne.
            rest = self._round_start + self.min_round_s - time.monotonic()
            if rest > 0:
                time.sleep(rest)
        return handled

    def handle(self, read: list[tuple[str, list]]) -> int:
        """Check, commit, fan out and acknowledge the entries of one XREADGROUP (all streams
        together). Nothing in an entry can make this raise: what fails the schema, names another
        job's attempt, reports a checkpoint that is not on disk or raises when applied goes to the
        dead-letter stream; a database error is retried (the round is then committed once)."""
        t0 = time.monotonic()
        self._round = [(stream, e[0]) for stream, got in read for e in got]
        ok, dead = self.sort(read)
        reduced: list = []  # the committed rollup (rollup.Reduced), published without reading it back
        ok = self.apply(ok, dead, reduced)
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
            self.fan_out(list(per_job.values()), reduced[0] if reduced else None)
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
        self.stats.count(n_samples, len(self._round), t0)
        if self.stats.due():
            self.stats.write(pipe, self._keeper, self._publish)
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
        """(the entries to apply, the dead letters (stream, id, fields, reason)); see
        jobs/telemetry/relay_sort.py. Entries of a job deleted meanwhile are neither: they are
        acknowledged and dropped."""
        return sort_entries(read, failures=self._failures, last_error=self._last_error,
                            retry=self._retry_db, stats=self.stats)

    def apply(self, ok: list[Parsed], dead: list[tuple], reduced: list | None = None) -> list[Parsed]:
        """Commit the samples and events of `ok` in one transaction; returns the entries applied.
        If that raises anything but a database error, each entry is applied alone (POISON_TRIES
        times at most) and the ones that still raise join `dead` (jobs/telemetry/relay_writes.py)."""
        return apply_entries(ok, dead, self._retry_db, reduced, self._late)

    def refresh_late(self) -> None:
        """Rewrite the knowledge records of the ended attempts that rounds since the last call
        stored samples of (step calls it at most every LATE_REFRESH_S, close at the end)."""
        attempts, self._late, self._late_at = self._late, set(), time.monotonic()
        self._retry_db(lambda: knowledge_refresh(attempts))

    def _retry_db(self, fn):
        """fn() until it does not raise a database error, with backoff; a stop request abandons
        the round unacknowledged (jobs/telemetry/relay_writes.py's retry_db)."""
        return retry_db(fn, running=lambda: self.running, stats=self.stats)

    def fan_out(self, per_job: list[tuple[int, list, list[dict], list]], reduced=None) -> None:
        """Committed telemetry and log lines to the job's Channels group and the kept log files:
        a browser never sees a point the database lacks. Telemetry goes reduced (issue 26): the
        round's steps read back from MetricStep (one SELECT for all jobs) and the samples of each
        job's few named ranks (jobs/telemetry/publish.py reduced_messages); `reduced` (rollup.Reduced), the
        round's reduction as committed, spares reading back the steps it stored as they are."""
        publish = self.publish
        tracker = self.__dict__.setdefault("_named", NamedTracker())  # the named ranks, per job
        for job_id, message in reduced_messages([(j[0], j[1]) for j in per_job if j[1]], tracker,
                                                max_samples=PUBLISH_MAX_SAMPLES, committed=reduced):
            publish(f"job.{job_id}", message)
        for job_id, _, live_logs, _ in per_job:
            group = f"job.{job_id}"
            for data in live_logs:
                publish(group, {"type": "job.log", "rank": data.get("rank"), "attempt": data.get("attempt"),
                                "stream": data.get("stream", "stdout"), "lines": data["lines"]})
        self.keep_logs(per_job)

    def gc(self) -> None:
        """Forget drained streams of ended attempts (jobs/telemetry/relay_streams.py)."""
        self.reader.gc()

    def close(self) -> None:
        if pending := sorted(self._late):
            try:
                self.refresh_late()
            except Exception:  # Abandon (asked to stop while the database is down): a by-product
                log.exception("knowledge records of ended attempts %s not rewritten", pending)
        if self._keeper is not None:
            self._keeper.close()  # the lines of the last rounds reach the disk
        if self.stats.last_batch:
            try:
                pipe = self.r.pipeline(transaction=False)
                self.stats.write(pipe, self._keeper, self._publish)
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
        collector = RoundCollector()
        try:
            while self.running:
                try:
                    self.step()
                    collector.between_rounds()
                    errors = 0
                except Abandon:
                    log.warning("stopping with a round unacknowledged: it is read again on restart")
                except redis.ConnectionError as exc:
                    log.warning("redis unavailable (%s); retrying", exc)
                    time.sleep(1.0)
                except Exception as exc:  # never exit on data: count it against the round's entries
                    errors += 1
                    self.round_failed(exc)
                    time.sleep(min(ERROR_BACKOFF_MAX_S, 0.1 * 2 ** min(errors, 6)))
        finally:
            collector.stop()
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
            self.reader.rescan()
        else:
            self.reader.reread_pending()

