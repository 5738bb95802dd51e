"""The relay's counters for /metrics (jobs/telemetry/relay.py's bookkeeping).

`RelayStats` holds what changed since the last write (samples, entries, rounds, database retries,
entries and streams of no known job or attempt) and the last round's figures; `write` adds them
to keys.RELAY_STATS_KEY in the round's pipeline, at most every STATS_EVERY_S, together with the
publisher's errors and the kept-log writer's counts. jobs/telemetry/prometheus.py reads that hash.
"""
from __future__ import annotations

import time

from typing import TYPE_CHECKING

from trainyard import keys

if TYPE_CHECKING:
    from jobs.telemetry.keptlogs import LogKeeper

STATS_EVERY_S = 0.5


class RelayStats:
    def __init__(self):
        self.delta = {"samples_total": 0, "entries_total": 0, "batches_total": 0,
                      "db_retries_total": 0, "orphaned_total": 0}  # not yet added to the hash
        self.last_batch: dict = {}
        self.totals: dict[str, int] = {}  # the process' own totals last added (see write)
        self.written = 0.0  # time.monotonic() of the last write

    def count(self, samples: int, entries: int, t0: float) -> None:
        """One round handled: `samples` samples in `entries` entries, started at t0 (monotonic)."""
        d = self.delta
        d["samples_total"] += samples
        d["entries_total"] += entries
        d["batches_total"] += 1
        self.last_batch = {"last_batch_unixtime": time.time(), "last_batch_samples": samples,
                           "last_batch_seconds": round(time.monotonic() - t0, 6)}

    def due(self) -> bool:
        return time.monotonic() - self.written >= STATS_EVERY_S

    def write(self, pipe, keeper: LogKeeper | None, publish) -> None:
        """Counters for /metrics, at most every STATS_EVERY_S (5 commands a round cost ~0.3 ms).
        `keeper` and `publish` are the relay's, None while it has made none."""
        for key, delta in self.delta.items():
            if delta:
                pipe.hincrby(keys.RELAY_STATS_KEY, key, delta)
        self.delta = dict.fromkeys(self.delta, 0)
        kept = keeper.stats if keeper is not None else {}
        # this process' own totals, added as what changed since the last write: the relay's processes
        # (manage.py relay --workers) add to the same counters
        totals = {"publish_errors_total": getattr(publish, "errors", 0),
                  "log_lines_kept_total": kept.get("lines_written", 0),
                  "log_lines_not_kept_total": kept.get("lines_dropped_queue", 0) + kept.get("lines_write_errors", 0)}
        for key, total in totals.items():
            if key not in self.totals or total != self.totals[key]:  # the first write makes the field
                pipe.hincrby(keys.RELAY_STATS_KEY, key, total - self.totals.get(key, 0))
        self.totals = totals
        if self.last_batch:
            pipe.hset(keys.RELAY_STATS_KEY, mapping=self.last_batch)
        self.written = time.monotonic()
