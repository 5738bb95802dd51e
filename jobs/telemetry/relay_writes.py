"""The relay's database writes (jobs/telemetry/relay.py's committing side).

`apply_entries` commits a round's samples and events in one transaction (jobs.telemetry.ingest);
if that raises anything but a database error, each entry is applied alone, POISON_TRIES times at
most, and the ones that still raise are dead-lettered. `retry_db` retries a database call while it
raises a database error (locked, connection lost) with backoff: the transaction rolled back, so the
round commits once. A stop request during the backoff raises `Abandon`: the round is left
unacknowledged and read again on restart.
"""
from __future__ import annotations

import logging
import time

from typing import TYPE_CHECKING, Callable

from django.db import InterfaceError, OperationalError, connection

from jobs.telemetry import ingest
from jobs.telemetry.relay_sort import POISON_TRIES, Parsed

if TYPE_CHECKING:
    from jobs.telemetry.relay_stats import RelayStats

log = logging.getLogger("trainyard.relay")
DB_BACKOFF_MIN_S, DB_BACKOFF_MAX_S = 0.05, 2.0


class Abandon(Exception):
    """Asked to stop while the database refused the round: leave it unacknowledged."""


def retry_db(fn, *, running: Callable[[], bool], stats: RelayStats):
    """fn() until it does not raise a database error (locked, connection lost): the transaction
    rolled back, so the retry applies the round exactly once. Backoff doubles up to
    DB_BACKOFF_MAX_S; once running() is false the round is abandoned unacknowledged (re-read on
    restart). Each retry counts in stats' db_retries_total."""
    delay = DB_BACKOFF_MIN_S
    while True:
        try:
            return fn()
        except (OperationalError, InterfaceError) as exc:
            stats.delta["db_retries_total"] += 1
            log.warning("database error (%s); retrying in %.2f s", exc, delay)
            if not connection.in_atomic_block and not connection.is_usable():
                connection.close()  # a broken connection (PostgreSQL restarted): the retry reconnects
            deadline = time.monotonic() + delay
            while running() and time.monotonic() < deadline:
                time.sleep(min(0.05, delay))
            if not running():
                raise Abandon() from exc
            delay = min(delay * 2, DB_BACKOFF_MAX_S)


def apply_entries(ok: list[Parsed], dead: list[tuple], retry: Callable, reduced: list | None = None,
                  late: set[int] | None = None) -> list[Parsed]:
    """Commit the samples and events of `ok` in one transaction, each database call through
    retry(fn); returns the entries applied. If that raises anything but a database error, each
    entry is applied alone (POISON_TRIES times at most) and the ones that still raise join `dead`.
    `reduced` gets the committed transaction's rollup.Reduced (ingest.telemetry_ingest), if any;
    `late`, the ended attempts whose samples were stored (ingest.telemetry_ingest)."""
    samples = [s for p in ok if p.kind == "metrics" for s in p.data]
    events = [p.data for p in ok if p.kind == "event"]
    if not samples and not events:
        return ok
    got: list = []

    def once():
        got.clear()  # a retried transaction's first try was rolled back
        return ingest.telemetry_ingest(samples, events=events, reduced=got, late=late)

    try:
        retry(once)
        if reduced is not None:
            reduced.extend(got)
        return ok
    except Abandon:
        raise
    except Exception as exc:
        log.exception("applying %d entries failed (%s); applying them one by one", len(ok), exc)
    applied = []
    for p in ok:
        error = None
        for _ in range(POISON_TRIES if p.kind != "log" else 0):
            try:
                retry(lambda p=p: ingest.telemetry_ingest(
                    p.data if p.kind == "metrics" else [], events=[p.data] if p.kind == "event" else [], late=late))
                error = None
                break
            except Abandon:
                raise
            except Exception as exc:
                error = exc
        if error is None:
            applied.append(p)
        else:
            dead.append((p.stream, p.entry_id, p.fields, f"applying it raised {type(error).__name__}: {error}"))
    return applied
