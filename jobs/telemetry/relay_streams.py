"""Which job streams the relay reads, and how much of each (jobs/telemetry/relay.py's reading side).

`StreamReader` finds attempt streams (SCAN) and reads only those of attempts the database knows
(a stream of no known attempt is never read, and looked up again after IGNORED_FORGET_S); it
creates the consumer group `relay` on each and reads one round: own pending entries first (after
a restart), then new ones, READ_STREAMS streams per XREADGROUP. A new stream starts at
FIRST_COUNT entries a read and doubles while its entries are small, up to `batch`; one that sent
an entry over BIG_ENTRY_BYTES is read one entry a round until it sends small ones again, so memory
per round stays bounded by Redis' proto-max-bulk-len, not by what a job chooses to send. `gc`
forgets the drained streams of ended attempts. With several relay processes (manage.py relay
--workers N) each reads the streams `shard_of` gives it (by attempt), all under one consumer name: a stream's
pending entries are read again by whichever process reads it now, whatever N was when they were read.
"""
from __future__ import annotations

import logging
import time

from typing import TYPE_CHECKING, Callable

import redis

from trainyard import keys

from jobs.telemetry import entries
from jobs.models import Attempt

if TYPE_CHECKING:
    from jobs.telemetry.relay_stats import RelayStats

log = logging.getLogger("trainyard.relay")
READ_STREAMS = 64  # streams per XREADGROUP
BATCH = 32  # entries per stream per round: a reporter's entry holds up to 500 samples (< 256 KB)
BIG_ENTRY_BYTES = 1 << 20  # no reporter writes one; a stream that does is read one entry a round
FIRST_COUNT = 4  # entries of a stream's first read (it doubles while they are small)
IGNORED_FORGET_S = 60.0  # streams of no known attempt are looked up again after this


def shard_of(stream: str, shards: int) -> int:
    """Which of `shards` relay processes reads `stream` (manage.py relay --workers): its attempt's id
    modulo their number, so a stream and its pending entries always go to the same one while their
    number stays, and consecutive attempts (a few running jobs) spread evenly, as a hash of the name
    did not (jobs 1 and 2 both went to process 0)."""
    ids = entries.stream_ids(stream)
    return ids[1] % shards if ids else 0


class StreamReader:
    def __init__(self, r: redis.Redis, consumer: str, batch: int, block_ms: int, stats: RelayStats,
                 shard: tuple[int, int] = (0, 1)):
        self.r, self.stats = r, stats
        self.consumer, self.batch, self.block_ms = consumer, batch, block_ms
        self.shard = shard  # (this process' index, how many): it reads only the streams shard_of gives it
        self.streams: dict[str, str] = {}  # stream -> next id to read ("0" = own pending first, then ">")
        self.counts: dict[str, int] = {}  # stream -> entries per read (see read)
        self._ignored: set[str] = set()  # streams of no known attempt (forgotten every IGNORED_FORGET_S)
        self._ignored_at = time.monotonic()
        self.last_scan = 0.0
        self.last_gc = time.monotonic()

    def discover(self, owners: Callable[[set[int]], dict[int, int]]) -> None:
        """Find new attempt streams (SCAN); read only those of attempts the database knows.
        owners(attempt ids) is attempt id -> its job's id for the ones that exist."""
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
            if self.shard[1] > 1 and shard_of(name, self.shard[1]) != self.shard[0]:
                continue  # another relay process' stream
            ids = entries.stream_ids(name)
            if ids is None:
                self._ignored.add(name)
                continue
            found[name] = ids
        if found:
            known = owners({a for _, a in found.values()})
            for name, (job_id, attempt_id) in found.items():
                if known.get(attempt_id) != job_id:
                    self._ignored.add(name)  # no such attempt of that job: nothing of it is read
                    self.stats.delta["orphaned_total"] += 1
                    continue
                self.add(name)
        self.last_scan = time.monotonic()

    def add(self, name: str) -> None:
        try:
            self.r.xgroup_create(name, keys.RELAY_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):  # e.g. the key stopped being a stream since SCAN
                log.warning("cannot read %s: %s", name[:200], exc)
                return
        # Start from "0": entries this consumer read but never acked (a crash) come back first.
        self.streams[name] = "0"

    def read(self) -> list[tuple[str, list]]:
        """One round's entries: own pending entries first (after a restart), then new ones; at most
        READ_STREAMS streams per call, each stream up to its own count: a new stream starts at
        FIRST_COUNT entries, a stream whose entries were all small doubles up to `batch`, one that
        sent an entry over BIG_ENTRY_BYTES is read one entry a round (memory per round stays a few
        entries of at most proto-max-bulk-len each, whatever a job sends). Waits up to block_ms only
        when no stream has anything: a blocking read of some streams (those of one count) while
        others had entries waiting held those entries back block_ms every round."""
        pending = [s for s, i in self.streams.items() if i == "0"]
        names = pending or [s for s in self.streams if self.streams[s] != "0"]
        read = self._read(names)
        if not read and not pending and names:
            first = names[:READ_STREAMS]
            read = self._read(first, block=self.block_ms, count=min(map(self.count, first)))
        return read

    def _read(self, names: list[str], block: int | None = None, count: int | None = None) -> list[tuple[str, list]]:
        """XREADGROUP each READ_STREAMS of `names`, each stream up to its own count (or all up to `count`)."""
        read = []
        for i in range(0, len(names), READ_STREAMS):
            chunk = names[i:i + READ_STREAMS]
            for n in [count] if count is not None else sorted({self.count(s) for s in chunk}):
                part = chunk if count is not None else [s for s in chunk if self.count(s) == n]
                resp = self.r.xreadgroup(keys.RELAY_GROUP, self.consumer, {s: self.streams[s] for s in part},
                                         count=n, block=block)
                got = {st.decode(): entries_ for st, entries_ in resp or []}
                for s in part:
                    if got.get(s):
                        read.append((s, got[s]))
                        self.note_size(s, got[s])
                    elif self.streams[s] == "0":
                        self.streams[s] = ">"  # own pending list drained
        return read

    def count(self, stream: str) -> int:
        return self.counts.get(stream, FIRST_COUNT)

    def note_size(self, stream: str, got: list) -> None:
        big = any(len(v) > BIG_ENTRY_BYTES for _, fields in got for v in fields.values())
        self.counts[stream] = 1 if big else min(self.batch, max(FIRST_COUNT, 2 * self.count(stream)))

    def reread_pending(self) -> None:
        """Every stream is read again from its own pending entries (a round failed)."""
        self.streams = dict.fromkeys(self.streams, "0")

    def rescan(self) -> None:
        """Forget every stream and find them again on the next round (NOGROUP, WRONGTYPE)."""
        self.streams.clear()
        self.last_scan = 0.0

    def gc(self) -> None:
        """Forget drained streams of ended attempts (the stream key itself stays until empty): its
        Redis user was deleted with its end, so nothing more can arrive."""
        self.last_gc = time.monotonic()
        ids = {s: entries.stream_ids(s) for s in self.streams}
        live = set(Attempt.objects.filter(pk__in={i[1] for i in ids.values() if i}).exclude(
            status=Attempt.Status.ENDED).values_list("pk", flat=True))
        for stream, i in ids.items():
            if (i is None or i[1] not in live) and self.r.xlen(stream) == 0:
                self.r.delete(stream)
                self.streams.pop(stream, None)
                self.counts.pop(stream, None)
