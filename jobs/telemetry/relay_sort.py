"""Which of a round's entries the relay applies and which it dead-letters (jobs/telemetry/relay.py's checks).

Every entry passes jobs/telemetry/entries.py's schema and must name only attempts of the job whose
stream carried it (`trainyard:job:<job>:a<attempt>`, which only that attempt's own Redis user may
write: the stream is the proof of the attempt behind an entry), and a checkpoint report also a
complete checkpoint on disk; an entry whose rounds raised POISON_TRIES times is dead-lettered too.
The rest become dead letters (stream, id, fields, reason) for keys.DEADLETTER_STREAM. Entries of a
job deleted meanwhile are neither: they are acknowledged and dropped.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from trainyard import keys

from jobs.telemetry import entries, ingest
from jobs.attempts.services import checkpoints

if TYPE_CHECKING:
    from jobs.telemetry.relay_stats import RelayStats

POISON_TRIES = 3  # an entry whose processing raised this often is dead-lettered, not re-read forever


class Parsed(NamedTuple):
    """A stream entry that passed the schema (jobs/telemetry/entries.py)."""

    stream: str
    job_id: int
    attempt_id: int
    entry_id: bytes
    fields: dict
    kind: str
    data: Any


def _check_samples(checked: list) -> tuple[list[Parsed], list[tuple]]:
    """(the entries whose samples pass the schema, the dead letters) of parse_entry's results, in order:
    one check of every metrics entry's samples together (entries.samples_surely_valid), and pydantic for
    each metrics entry only when that doubts any (the same verdicts and reasons as entry by entry)."""
    metrics = [p.data for p in checked if isinstance(p, Parsed) and p.kind == "metrics"]
    sure = entries.samples_surely_valid(metrics)
    parsed: list[Parsed] = []
    dead: list[tuple] = []
    for p in checked:
        if not isinstance(p, Parsed):
            dead.append(p)
            continue
        if p.kind == "metrics" and not sure:
            try:
                entries.validate_samples(p.data)
            except entries.EntryError as exc:
                dead.append((p.stream, p.entry_id, p.fields, str(exc)))
                continue
        parsed.append(p)
    return parsed, dead


def sort_entries(read: list[tuple[str, list]], *, failures: dict[tuple[str, bytes], int], last_error: str,
                 retry: Callable, stats: RelayStats) -> tuple[list[Parsed], list[tuple]]:
    """(the entries to apply, the dead letters (stream, id, fields, reason)) of one XREADGROUP.
    `failures` counts the failed rounds per (stream, id), `last_error` is the last one's error,
    retry(fn) runs a database call until it does not raise a database error; entries of a job
    deleted meanwhile are counted in stats' orphaned_total."""
    checked: list[Parsed | tuple] = []  # in stream order: a Parsed, or a dead letter's tuple
    for stream, stream_entries in read:
        ids = entries.stream_ids(stream)
        for entry_id, fields in stream_entries:
            tries = failures.get((stream, entry_id), 0)
            try:
                if tries >= POISON_TRIES:
                    raise entries.EntryError(f"processing it failed {tries} times, last: {last_error}")
                if ids is None:
                    raise entries.EntryError(
                        f"stream {stream[:100]!r} is not named {keys.JOB_STREAM_PREFIX}<job>:a<attempt>")
                kind, data = entries.parse_entry(fields, check_samples=False)
            except entries.EntryError as exc:
                checked.append((stream, entry_id, fields, str(exc)))
                continue
            checked.append(Parsed(stream, ids[0], ids[1], entry_id, fields, kind, data))
    parsed, dead = _check_samples(checked)
    jobs, owners = retry(lambda: ingest.telemetry_owners(
        {p.job_id for p in parsed}, {p.attempt_id for p in parsed}))
    ok = []
    for p in parsed:
        if p.job_id not in jobs:
            stats.delta["orphaned_total"] += 1
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
