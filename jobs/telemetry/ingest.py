"""Telemetry intake: the relay's batches of metric samples and runtime events, stored in one
transaction (the relay reads them from each attempt's Redis stream, trainyard.keys.attempt_stream).

A sample's user metrics (`sample["metrics"] = {name: float}`, what the SDK's `run.log(step, **metrics)`
sends for names outside the standard fields) go to `MetricSample.extra`: names
[A-Za-z_][A-Za-z0-9_./-]{0,63}, finite numbers, at most MAX_USER_METRICS per sample; anything else is
dropped (counted in one warning per batch) and the sample itself is kept. The sample dict is cleaned in
place, so the copy the relay then fans out to the browsers carries exactly what was stored.

Runtime events: `checkpoint` (registered), `resumed` (a timeline entry), `rank_plan` (what each
rank holds under the plan), `rebalanced` (train.balance's new split of the batch, a timeline entry)
and `telemetry_dropped` (samples lost while Redis was away).
"""
from __future__ import annotations

import logging
import math
import re
from itertools import repeat
from operator import itemgetter

import numpy as np
import orjson
from django.db import transaction
from django.utils import timezone

from jobs.core.dbtext import storable
from jobs.models import Attempt, Job, JobEvent, MetricSample, MetricStep
from jobs.telemetry import columns, pgcopy, rollup
from jobs.attempts.services.checkpoints import checkpoint_register
from jobs.attempts.services.events import job_event
from jobs.planning.services.knowledge import knowledge_refresh

log = logging.getLogger(__name__)


METRIC_FIELDS = MetricSample.FIELDS

_METRIC_TYPES = frozenset((int, float, type(None)))

_INT64 = 2**63

USER_METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]{0,63}")
MAX_USER_METRICS = 32


def user_metrics(raw) -> tuple[dict[str, float] | None, int]:
    """(the valid user metrics of one sample or None, how many values were dropped): names matching
    USER_METRIC_NAME, finite int/float values (as floats), the first MAX_USER_METRICS of them."""
    if raw is None:
        return None, 0
    if type(raw) is not dict:
        return None, 1
    out: dict[str, float] = {}
    for name, value in raw.items():
        if len(out) < MAX_USER_METRICS and type(name) is str and USER_METRIC_NAME.fullmatch(name) \
                and type(value) in (int, float):
            try:
                value = float(value)
            except OverflowError:  # an int beyond float range
                value = math.inf
            if math.isfinite(value):
                out[name] = value
                continue
    return out or None, len(raw) - len(out)


def _metric_row(job_id: int, attempt_id: int, s: dict) -> tuple | None:
    """One sample's INSERT parameters, or None for a sample no database would accept (rank, step
    and ts are required, rank/step non-negative ints, everything else a number or null), so one bad
    sample never rejects the batch it came in. ~3 us: this runs for every sample."""
    vals = tuple(map(s.get, METRIC_FIELDS))
    rank, step = vals[0], vals[1]
    if type(rank) is not int or type(step) is not int or rank < 0 or not 0 <= step < _INT64 or vals[2] is None:
        return None
    if not _METRIC_TYPES.issuperset(map(type, vals)):
        return None
    # int64 bounds of the other int fields (rank and step are checked above)
    big = [v for v in vals[3:] if type(v) is int]
    if big and (max(big) >= _INT64 or min(big) < -_INT64):
        return None
    return (job_id, attempt_id) + vals


_TELEMETRY_SQL: dict[str, tuple[str, str, str]] = {}
_ROW_KEY = itemgetter(0, 1, 2, 3)  # job, attempt, rank, step


def _telemetry_sql(vendor: str) -> tuple[str, str, str]:
    """(attempt -> job lookup, job step UPDATE, the lookup's lock clause) for this database; the rows themselves go through
    jobs/telemetry/rollup.py's staging table. Raw SQL: the ORM lookup + update cost ~1.5 ms of a
    ~3 ms round at low rates."""
    from django.db import connection

    if vendor in _TELEMETRY_SQL:
        return _TELEMETRY_SQL[vendor]
    qn = connection.ops.quote_name
    att, job = Attempt._meta, Job._meta
    lookup = (f"SELECT {qn(att.pk.column)}, {qn(att.get_field('job').column)}, {qn(att.get_field('status').column)}, "
              f"{qn(att.get_field('fenced_step').column)} FROM {qn(att.db_table)} "
              f"WHERE {qn(att.pk.column)} IN ")
    step = qn(job.get_field("step").column)
    update = f"UPDATE {qn(job.db_table)} SET {step} = %s WHERE {qn(job.pk.column)} = %s AND {step} < %s"
    # The attempts' rows locked against a delete until the commit: the metric tables have no database
    # FK constraints (jobs/models/telemetry.py), so this keeps a row from outliving its attempt. SQLite's
    # IMMEDIATE transaction already excludes every other writer.
    lock = " FOR KEY SHARE" if vendor == "postgresql" else ""
    _TELEMETRY_SQL[vendor] = lookup, update, lock
    return lookup, update, lock


_INLINE_INTS = frozenset(("job_id", "attempt_id", "ranks", *(f"{f}_n" for f in rollup.REDUCED_FIELDS)))


def _sqlite_values(names, cols: list) -> tuple[str, list[int]]:
    """SQLite's VALUES list for rows given as columns, and the indexes of the columns left to bind: a
    column NULL throughout, or an id or count (_INLINE_INTS) the same throughout, is written into the
    statement. Binding costs ~50 ns a value a row: the NULL fields no rank reports and the counts (as
    many as the ranks) were ~30% of a 57-column MetricStep row's insert. Only ints and NULL are written."""
    parts, bound = [], []
    for i, (name, col) in enumerate(zip(names, cols)):
        first = col[0]
        if first is None and col.count(None) == len(col):
            parts.append("NULL")
        elif name in _INLINE_INTS and type(first) is int and min(col) == max(col) == first:
            parts.append(str(int(first)))
        else:
            parts.append("?")
            bound.append(i)
    return ", ".join(parts), bound


def _key_order(cols: list) -> np.ndarray:
    """The order of the rows given as columns (STAGE_COLUMNS) by (job, attempt, rank, step)."""
    return np.lexsort(tuple(np.fromiter(cols[i], dtype=np.int64, count=len(cols[i])) for i in (3, 2, 1, 0)))


def _copy(cursor, table: str, names: list[str], cols: list, rows, order, *, into: str = "") -> None:
    """COPY the rows given as columns (taken in `order`) into `into` (default `table`, whose column types
    the binary form follows): binary, built a column at a time (jobs/telemetry/pgcopy.py), or where the
    binary form could differ psycopg's text rows, rows() (the same rows, in that order)."""
    types = pgcopy.column_types(cursor, table)
    data = pgcopy.binary_copy(cols, [types[c] for c in names], order)
    target = f"{into or table} ({', '.join(names)})"
    if data is not None:
        with cursor.cursor.copy(f"COPY {target} FROM STDIN (FORMAT BINARY)") as copy:
            copy.write(data)
        return
    with cursor.cursor.copy(f"COPY {target} FROM STDIN") as copy:
        for row in rows():
            copy.write_row(row)


def _store_rows(cursor, connection, rows: list[tuple], cols: list[tuple]) -> rollup.Reduced | None:
    """Insert the round's rows (on PostgreSQL sorted by job, attempt, rank, step) into MetricSample and reduce the
    new ones into MetricStep (jobs/telemetry/rollup.py).

    Fast path, in a savepoint: every row goes straight in (SQLite: INSERT OR IGNORE, whose count says
    whether all were new; PostgreSQL: COPY, which fails on any duplicate), then numpy reduces the
    batch and one executemany merges it. A round with any row already stored (a replayed entry, a
    duplicate XADD) is rolled back to the savepoint and takes the slow path: stage, drop what exists,
    insert the rest, reduce in SQL. In key order: two writers with overlapping rows (a second relay,
    a replay) wait on each other's unique-index entries in one order, never in a cycle (PostgreSQL
    aborted one with "deadlock detected").

    Returns the fast path's reduction (rollup.Reduced: what the relay publishes without reading it back),
    None after the slow path."""
    vendor = connection.vendor
    raw = cursor.cursor
    sample_cols = ", ".join(rollup.STAGE_COLUMNS)
    cursor.execute("SAVEPOINT trainyard_rows")
    try:
        if vendor == "postgresql":  # in key order (see above)
            _copy(cursor, MetricSample._meta.db_table, rollup.STAGE_COLUMNS, cols,
                  lambda: sorted(rows, key=_ROW_KEY), _key_order(cols))
            all_new = True
        else:
            values, bound = _sqlite_values(rollup.STAGE_COLUMNS, cols)
            raw.executemany(f"INSERT OR IGNORE INTO {MetricSample._meta.db_table} ({sample_cols}) VALUES ({values})",
                            zip(*[cols[i] for i in bound]) if len(bound) < len(cols) else rows)
            all_new = raw.rowcount == len(rows)
    except connection.Database.IntegrityError:
        all_new = False
    if all_new:
        step_cols = [c.tolist() for c in rollup.reduce_columns(cols)]
        reduced = list(zip(*step_cols))
        if vendor == "postgresql":
            # one COPY and one INSERT ... SELECT: psycopg's executemany of the upsert cost ~1 ms a row here
            for ddl in rollup.step_stage_ddl():
                cursor.execute(ddl)
            names = rollup.step_columns()
            last = [i for i, c in enumerate(names) if c != "extra"] + [names.index("extra")]  # text last
            _copy(cursor, MetricStep._meta.db_table, [names[i] for i in last], [step_cols[i] for i in last],
                  lambda: [tuple(r[i] for i in last) for r in reduced], None, into=rollup.STEP_STAGE)
            cursor.execute(rollup.upsert_from_stage_sql())
            merged = set(cursor.fetchall())
            cursor.execute(f"DELETE FROM {rollup.STEP_STAGE}")
        else:
            merged = rollup.stored_steps(raw, reduced)  # before the merge: one writer at a time
            values, bound = _sqlite_values(rollup.step_columns(), step_cols)
            raw.executemany(rollup.upsert_sql(vendor, values), zip(*[step_cols[i] for i in bound]))
        cursor.execute("RELEASE SAVEPOINT trainyard_rows")
        return rollup.Reduced(reduced, merged)
    cursor.execute("ROLLBACK TO SAVEPOINT trainyard_rows")
    cursor.execute("RELEASE SAVEPOINT trainyard_rows")
    sql = rollup.ingest_sql(vendor)
    for ddl in rollup.stage_ddl(vendor):  # every time: a rolled-back transaction takes the table with it
        cursor.execute(ddl)
    if vendor == "postgresql":
        # COPY has no ON CONFLICT: a sample twice in one round (a duplicate XADD) is dropped here, in
        # key order
        unique, last = [], None
        for row in sorted(rows, key=_ROW_KEY):
            key = _ROW_KEY(row)
            if key != last:
                unique.append(row)
                last = key
        with raw.copy(f"COPY {rollup.STAGE} ({sample_cols}) FROM STDIN") as copy:
            for row in unique:
                copy.write_row(row)
    else:
        marks = ", ".join(["?"] * len(rollup.STAGE_COLUMNS))
        raw.executemany(f"INSERT OR IGNORE INTO {rollup.STAGE} VALUES ({marks})", rows)
    for statement in sql:
        cursor.execute(statement)


def _sample_rows(samples: list[dict], attempts: dict[int, int], fences: dict[int, int]) -> columns.Rows:
    """columns.sample_rows' result one sample at a time (_metric_row): the way of a round holding a sample
    that the column checks doubt (a malformed one is dropped and counted here, the rest kept)."""
    rows, top, attempt_top, malformed, dropped_metrics, fenced = [], {}, {}, 0, 0, 0
    for s in samples:
        attempt_id = s.get("attempt")
        job_id = attempts.get(attempt_id) if type(attempt_id) is int else None
        if job_id is None:
            continue  # an attempt this database does not know (e.g. deleted job): drop, never crash
        row = _metric_row(job_id, attempt_id, s)
        if row is None:
            malformed += 1
            continue
        if attempt_id in fences and row[3] > fences[attempt_id]:
            fenced += 1  # trained after its node was written off: in no line of the job
            continue
        extra = None
        if "metrics" in s:
            extra, dropped = user_metrics(s["metrics"])
            dropped_metrics += dropped
            s["metrics"] = extra  # what the relay fans out is what is stored
            extra = orjson.dumps(extra).decode() if extra else None
        rows.append(row + (extra,))
        if row[3] > top.get(job_id, 0):
            top[job_id] = row[3]
        if row[3] > attempt_top.get(attempt_id, -1):
            attempt_top[attempt_id] = row[3]
    if malformed:
        log.warning("dropped %d malformed metric samples", malformed)
    return columns.Rows(list(zip(*rows)), rows, top, attempt_top, fenced, dropped_metrics)


def telemetry_ingest(samples: list[dict], *, events: list[dict], reduced: list | None = None,
                     late: set[int] | None = None) -> dict[int, int]:
    """Store a batch of metric samples (idempotent: duplicates of (attempt, rank, step) are skipped)
    and runtime events, in one transaction. Returns job id -> highest step seen in the batch.
    `reduced`, if given, gets the batch's rollup.Reduced when its rows were all new (the relay
    publishes those steps from it instead of reading them back). Samples of an attempt that has
    already ended change its knowledge record (jobs/planning/services/knowledge.py), which is
    rewritten after the commit; with `late` given, the ids of those attempts are added to it instead
    and the caller rewrites them when it chooses (the relay: at most every LATE_REFRESH_S)."""
    from django.db import connection

    lookup, update, lock = _telemetry_sql(connection.vendor)
    try:
        wanted = {a for a in set(map(dict.get, samples, repeat("attempt"))) if type(a) is int}
    except TypeError:  # not every sample a dict (never from the relay: its schema checked them)
        wanted = {a for a in (s.get("attempt") for s in samples) if type(a) is int}
    wanted |= {a for a in (e.get("attempt") for e in events) if type(a) is int}
    with transaction.atomic(), connection.cursor() as cursor:
        # Inside the (IMMEDIATE) transaction: an attempt deleted meanwhile cannot break the FK.
        attempts: dict[int, int] = {}
        ended: set[int] = set()
        fences: dict[int, int] = {}  # attempt -> its fenced step (jobs/fleet/services/nodes.py, attempt_fence)
        if wanted:
            cursor.execute(lookup + "(" + ", ".join(["%s"] * len(wanted)) + ")" + lock, sorted(wanted))
            for attempt_id, job_id, status, fenced_step in cursor.fetchall():
                attempts[attempt_id] = job_id
                if status == Attempt.Status.ENDED:
                    ended.add(attempt_id)
                if fenced_step is not None:
                    fences[attempt_id] = fenced_step
        got = columns.sample_rows(samples, attempts, fences, user_metrics) or _sample_rows(samples, attempts, fences)
        if got.fenced:
            log.warning("dropped %d samples of fenced attempts (written after their node was lost)", got.fenced)
        if got.dropped_metrics:
            log.warning("dropped %d user metric values: names must match %s, values must be finite numbers, "
                        "at most %d per sample", got.dropped_metrics, USER_METRIC_NAME.pattern, MAX_USER_METRICS)
        if got.rows:
            rows = got.rows
            # on PostgreSQL in key order (_store_rows), and the updates below in id order
            done = _store_rows(cursor, connection, rows, got.columns)
            if done is not None and reduced is not None:
                reduced.append(done)
        top, attempt_top = got.top, got.attempt_top
        for job_id, step in sorted(top.items()):
            cursor.execute(update, [step, job_id, step])
        now = timezone.now()
        for attempt_id, step in sorted(attempt_top.items()):  # the hang detector's evidence
            Attempt.objects.filter(pk=attempt_id, last_step__lt=step).update(last_step=step, last_progress_at=now)
        for e in events:
            attempt_id = e.get("attempt")
            job_id = attempts.get(attempt_id) if type(attempt_id) is int else None
            if job_id is not None:
                _runtime_event(job_id, attempt_id, storable(e))  # no NUL reaches PostgreSQL's text
    ended_late = ended.intersection(attempt_top)
    if late is not None:
        late |= ended_late
    elif ended_late:  # the last steps of an attempt that already ended: its knowledge record takes them in
        knowledge_refresh(ended_late)
    return top


def telemetry_owners(job_ids: set[int], attempt_ids: set[int]) -> tuple[set[int], dict[int, int]]:
    """(which of job_ids exist, attempt id -> its job's id for attempt_ids that exist): what the
    relay checks every entry against, so an entry only ever changes the job whose stream carried it."""
    jobs = set(Job.objects.filter(pk__in=job_ids).values_list("pk", flat=True)) if job_ids else set()
    owners = dict(Attempt.objects.filter(pk__in=attempt_ids).values_list("pk", "job_id")) if attempt_ids else {}
    return jobs, owners


RANK_PLAN_KEYS = ("strategy", "coords", "role", "param_bytes", "optim_bytes", "model")


def _rank_plan(attempt_id: int, e: dict) -> None:
    """What one rank really holds under the plan (mesh coordinates, role, parameter and optimizer
    bytes): kept on the attempt, shown per rank on the job page and in the API."""
    rank = e.get("rank")
    if type(rank) is not int:
        return
    attempt = Attempt.objects.select_for_update().filter(pk=attempt_id).first()
    if attempt is None:
        return
    plans = dict(attempt.rank_plans or {})
    plans[str(rank)] = {k: e[k] for k in RANK_PLAN_KEYS if k in e}
    Attempt.objects.filter(pk=attempt_id).update(rank_plans=plans)
    if rank == 0 and isinstance(e.get("auto"), dict):
        _auto_choice(attempt.job_id, e["auto"])


def _auto_choice(job_id: int, auto: dict) -> None:
    """parallel auto of a user's model: the plan rank 0's run.prepare chose (entries.py bounds it)
    becomes the job's plan.auto, which the job page shows as for a built-in job planned at submit.
    Only for a job that asked for it (its plan holds the planner's inputs)."""
    job = Job.objects.select_for_update().filter(pk=job_id).first()
    if job is None or "auto_inputs" not in (job.plan or {}):
        return
    plan = {**job.plan, "auto": {**auto, "device": job.plan["auto_inputs"].get("device", {})},
            "source": f"auto: run.prepare's best of {auto['candidates']} plans for the model's shape "
                      f"({auto['constants_source']})"}
    Job.objects.filter(pk=job_id).update(plan=plan)


def _runtime_event(job_id: int, attempt_id: int, e: dict) -> None:
    kind = e.get("kind")
    if kind == "checkpoint":
        checkpoint_register(attempt_id, data=e)
    elif kind == "resumed":
        load_s = e.get("load_s") if isinstance(e.get("load_s"), (int, float)) else None
        job = Job.objects.get(pk=job_id)
        job_event(job, "resumed", f"rank {e.get('rank')} loaded the checkpoint at step {e.get('step')}"
               + (f" in {load_s:.2f} s" if load_s is not None else ""), attempt=Attempt(pk=attempt_id),
               step=e.get("step"), load_s=load_s, path=e.get("path"))
    elif kind == "rank_plan":
        _rank_plan(attempt_id, e)
    elif kind == "rebalanced":
        counts, previous = e["counts"], e["previous"]
        shares = ", ".join(f"rank {r} {c}" for r, c in enumerate(counts))
        job_event(Job.objects.get(pk=job_id), "rebalanced",
                  f"batch split by measured speed from step {e['step'] + 1}: {shares} samples "
                  f"(was {'/'.join(map(str, previous))})", attempt=Attempt(pk=attempt_id),
                  step=e["step"], counts=counts, previous=previous, shares=e["shares"], speeds=e["speeds"])
    elif kind == "telemetry_dropped":
        JobEvent.objects.create(job_id=job_id, attempt_id=attempt_id, kind=kind,
                                message=f"rank {e.get('rank')} dropped {e.get('count')} telemetry samples "
                                        "while Redis was unreachable", data=e)
