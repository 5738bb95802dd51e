"""The per-step rollup (issue 26): the relay's per-rank samples of one round go through a staging table,
and in the same transaction
1. the staged rows that already exist in MetricSample are dropped (a replayed entry, a duplicate XADD),
2. the rest are inserted into MetricSample,
3. and reduced by (attempt, step) into MetricStep: per standard field the count, min, mean and max, for
   RANKED_FIELDS also the rank of the min and of the max, and the user metrics of the lowest rank that
   logged any. A step whose ranks arrive in several rounds merges: counts add, means are weighted by
   their counts, min/max (and their ranks) keep the extreme, the lower rank's user metrics win.

So MetricStep is exactly the reduction of every sample ever stored, whatever the rounds and replays:
only new rows are reduced, and the merge is associative. Everything here is set-based SQL run by
the database (no per-sample Python beyond building the staged rows): SQLite's staging table is a
TEMP table of the relay's connection, PostgreSQL's a TEMP table filled by COPY.

`backfill_sql` reduces every MetricSample row of the database (the migration that added MetricStep).
"""
from __future__ import annotations

from operator import itemgetter
from typing import NamedTuple

import numpy as np

from jobs.models import MetricSample, MetricStep
from jobs.models.telemetry import RANKED_FIELDS, REDUCED_FIELDS

STAGE = "trainyard_metric_stage"
# The staged row: what ingest builds for each sample (job, attempt, MetricSample.FIELDS..., extra).
STAGE_COLUMNS = ("job_id", "attempt_id", *MetricSample.FIELDS, "extra")


def _qn(name: str) -> str:
    return '"' + name + '"'


def stage_ddl(vendor: str) -> list[str]:
    """The statements that create this connection's staging table (idempotent)."""
    types = {"job_id": "bigint", "attempt_id": "bigint", "rank": "bigint", "step": "bigint",
             "bytes_sent": "bigint", "mem_bytes": "bigint"}
    extra_type = "jsonb" if vendor == "postgresql" else "text"
    cols = ", ".join(f"{_qn(c)} {types.get(c, extra_type if c == 'extra' else 'double precision')}"
                     for c in STAGE_COLUMNS)
    if vendor == "postgresql":
        # ON COMMIT DELETE ROWS: every transaction starts with it empty, whatever the last one did
        return [f"CREATE TEMP TABLE IF NOT EXISTS {STAGE} ({cols}) ON COMMIT DELETE ROWS",
                f"CREATE INDEX IF NOT EXISTS {STAGE}_key ON {STAGE} (attempt_id, step, rank)"]
    return [f"CREATE TEMP TABLE IF NOT EXISTS {STAGE} ({cols}, PRIMARY KEY (attempt_id, step, rank)) WITHOUT ROWID"]


def _least(vendor: str, a: str, b: str, fn: str) -> str:
    """min/max of two nullable values, NULL only when both are (SQLite's scalar min() is NULL when
    either is; PostgreSQL's LEAST/GREATEST skip NULLs)."""
    if vendor == "postgresql":
        return f"{'LEAST' if fn == 'min' else 'GREATEST'}({a}, {b})"
    return f"{fn}(COALESCE({a}, {b}), COALESCE({b}, {a}))"


def _ranked(vendor: str, source: str) -> list[str]:
    """The select expressions of extra, extra_rank and each ranked field's min and max rank.
    PostgreSQL: ordered aggregates in the one GROUP BY. SQLite: over the plain aggregates `g` (a
    subquery), the lowest rank whose value equals the group's min (max): an index walk of the step's
    rows in rank order (the stage's key is (attempt, step, rank)) with no sort; a correlated
    ORDER BY value LIMIT 1 sorted each step's rows per column (~10 us a sample)."""
    if vendor == "postgresql":
        sel = ["(ARRAY_AGG(g.extra ORDER BY g.rank) FILTER (WHERE g.extra IS NOT NULL))[1]",
               "MIN(g.rank) FILTER (WHERE g.extra IS NOT NULL)"]
        for f in RANKED_FIELDS:
            q = _qn(f)
            sel += [f"(ARRAY_AGG(g.rank ORDER BY g.{q} ASC, g.rank) FILTER (WHERE g.{q} IS NOT NULL))[1]",
                    f"(ARRAY_AGG(g.rank ORDER BY g.{q} DESC, g.rank) FILTER (WHERE g.{q} IS NOT NULL))[1]"]
        return sel

    def first(col: str, where: str) -> str:
        return (f"(SELECT s2.{col} FROM {source} s2 WHERE s2.attempt_id = g.attempt_id AND s2.step = g.step "
                f"AND {where} ORDER BY s2.attempt_id, s2.step, s2.rank LIMIT 1)")

    sel = [first("extra", "s2.extra IS NOT NULL"), first("rank", "s2.extra IS NOT NULL")]
    for f in RANKED_FIELDS:
        q = _qn(f)
        sel += [first("rank", f"s2.{q} = g.{f}_min"), first("rank", f"s2.{q} = g.{f}_max")]
    return sel


def step_columns() -> list[str]:
    """MetricStep's columns in the order reduce_sql and reduce_rows produce them."""
    cols = ["job_id", "attempt_id", "step", "ts", "ranks", "extra", "extra_rank"]
    for f in REDUCED_FIELDS:
        cols += [f"{f}_n", f"{f}_min", f"{f}_mean", f"{f}_max"]
    for f in RANKED_FIELDS:
        cols += [f"{f}_min_rank", f"{f}_max_rank"]
    return cols


def _merge(vendor: str) -> str:
    """ON CONFLICT's SET: a step's new partial reduction (`excluded`) merged into the stored one."""
    t, x = MetricStep._meta.db_table, "excluded"
    lower = f"{t}.extra_rank IS NULL OR ({x}.extra_rank IS NOT NULL AND {x}.extra_rank < {t}.extra_rank)"
    merge = [f"ts = {_least(vendor, f'{t}.ts', f'{x}.ts', 'max')}", f"ranks = {t}.ranks + {x}.ranks",
             f"extra = CASE WHEN {lower} THEN {x}.extra ELSE {t}.extra END",
             f"extra_rank = CASE WHEN {lower} THEN {x}.extra_rank ELSE {t}.extra_rank END"]
    for f in REDUCED_FIELDS:
        n, xn = f"{t}.{f}_n", f"{x}.{f}_n"
        merge += [f"{f}_n = {n} + {xn}",
                  f"{f}_min = {_least(vendor, f'{t}.{f}_min', f'{x}.{f}_min', 'min')}",
                  f"{f}_max = {_least(vendor, f'{t}.{f}_max', f'{x}.{f}_max', 'max')}",
                  f"{f}_mean = CASE WHEN {n} + {xn} = 0 THEN NULL ELSE "
                  f"(COALESCE({t}.{f}_mean * {n}, 0) + COALESCE({x}.{f}_mean * {xn}, 0)) / ({n} + {xn}) END"]
    for f in RANKED_FIELDS:
        # a tie keeps the rank already there: the first rank seen with the extreme value
        merge += [f"{f}_min_rank = CASE WHEN {t}.{f}_min IS NULL OR {x}.{f}_min < {t}.{f}_min "
                  f"THEN {x}.{f}_min_rank ELSE {t}.{f}_min_rank END",
                  f"{f}_max_rank = CASE WHEN {t}.{f}_max IS NULL OR {x}.{f}_max > {t}.{f}_max "
                  f"THEN {x}.{f}_max_rank ELSE {t}.{f}_max_rank END"]
    return f"ON CONFLICT (attempt_id, step) DO UPDATE SET {', '.join(merge)}"


def reduce_sql(vendor: str, source: str) -> str:
    """INSERT INTO MetricStep the reduction of `source` (a table with MetricSample's columns) by
    (attempt, step), merged into the rows already there."""
    cols = step_columns()
    aggs = ["MAX(g.ts)", "COUNT(*)"]
    for f in REDUCED_FIELDS:
        q = _qn(f)
        aggs += [f"COUNT(g.{q})", f"MIN(g.{q})", f"AVG(g.{q})", f"MAX(g.{q})"]
    ranked = _ranked(vendor, source)
    keys = "g.job_id, g.attempt_id, g.step"
    if vendor == "postgresql":
        select = f"SELECT {keys}, {aggs[0]}, {aggs[1]}, {', '.join(ranked[:2])}, {', '.join(aggs[2:])}, " \
                 f"{', '.join(ranked[2:])} FROM {source} g WHERE true GROUP BY g.attempt_id, g.step, g.job_id"
    else:
        # the plain aggregates first (named as MetricStep's columns), then the ranked columns over them
        names = ["ts", "ranks"] + [c for c in cols[7:]]
        inner = (f"SELECT g.job_id, g.attempt_id, g.step, {', '.join(f'{a} AS {n}' for a, n in zip(aggs, names))} "
                 f"FROM {source} g GROUP BY g.attempt_id, g.step")
        select = (f"SELECT {keys}, g.ts, g.ranks, {', '.join(ranked[:2])}, "
                  f"{', '.join(f'g.{n}' for n in names[2:len(aggs)])}, {', '.join(ranked[2:])} "
                  f"FROM ({inner}) g WHERE true")
    return (f"INSERT INTO {MetricStep._meta.db_table} ({', '.join(_qn(c) for c in cols)}) {select} {_merge(vendor)}")


def upsert_sql(vendor: str, values: str | None = None) -> str:
    """INSERT one partial reduction per VALUES row (reduce_rows' rows), merged like reduce_sql's; `values`:
    the VALUES list (default a %s per column)."""
    cols = step_columns()
    return (f"INSERT INTO {MetricStep._meta.db_table} ({', '.join(_qn(c) for c in cols)}) "
            f"VALUES ({values or ', '.join(['%s'] * len(cols))}) {_merge(vendor)}")


STEP_STAGE = "trainyard_step_stage"
_ATTEMPT, _STEP = itemgetter(1), itemgetter(2)  # of a reduce_rows row


def step_stage_ddl() -> list[str]:
    """PostgreSQL's staging table of reduced rows (reduce_rows' columns), for one COPY a round."""
    cols = ", ".join(_qn(c) for c in step_columns())
    return [f"CREATE TEMP TABLE IF NOT EXISTS {STEP_STAGE} ON COMMIT DELETE ROWS AS SELECT {cols} "
            f"FROM {MetricStep._meta.db_table} WITH NO DATA"]


def upsert_from_stage_sql() -> str:
    """STEP_STAGE's rows merged into MetricStep, as upsert_sql merges VALUES rows (PostgreSQL); selects
    the (attempt, step) of the rows that merged into one already stored (xmax is 0 for a row the
    statement inserted), whatever another transaction committed meanwhile."""
    cols = ", ".join(_qn(c) for c in step_columns())
    return (f"WITH up AS (INSERT INTO {MetricStep._meta.db_table} ({cols}) SELECT {cols} FROM {STEP_STAGE} "
            f"{_merge('postgresql')} RETURNING attempt_id, step, xmax) "
            "SELECT attempt_id, step FROM up WHERE xmax::text <> '0'")


class Reduced(NamedTuple):
    """A round's reduction as the fast path stored it: `rows` (reduce_rows'), and the (attempt, step)s of
    them that merged into a row already stored; every other row is exactly MetricStep's row now."""

    rows: list[tuple]
    merged: set[tuple[int, int]]


def stored_steps(raw_cursor, rows: list[tuple]) -> set[tuple[int, int]]:
    """The (attempt, step)s of reduce_rows' rows (in (attempt, step) order) that MetricStep already holds
    (SQLite, inside the writing transaction): one range per attempt on the unique (attempt, step) index,
    and of what the ranges hold only the rows' own steps (a range also holds the steps stored between
    a round's far-apart ones: a rank's late sample of an early step)."""
    keys = set(zip(map(_ATTEMPT, rows), map(_STEP, rows)))
    ranges: dict[int, list[int]] = {}
    for attempt, step in zip(map(_ATTEMPT, rows), map(_STEP, rows)):
        ranges.setdefault(attempt, [step, step])[1] = step
    where = " OR ".join(["(attempt_id = ? AND step BETWEEN ? AND ?)"] * len(ranges))
    raw_cursor.execute(f"SELECT attempt_id, step FROM {MetricStep._meta.db_table} WHERE {where}",
                       [v for a, (lo, hi) in ranges.items() for v in (a, lo, hi)])
    return keys.intersection(raw_cursor.fetchall())


_FIELD_AT = {f: STAGE_COLUMNS.index(f) for f in REDUCED_FIELDS}  # a staged row's index of each field


def reduce_rows(cols: list) -> list[tuple]:
    """reduce_columns' rows."""
    return list(zip(*(c.tolist() for c in reduce_columns(cols))))


def reduce_columns(cols: list) -> list[np.ndarray]:
    """The same reduction as reduce_sql, of staged rows that are all new, given as columns (STAGE_COLUMNS
    order, rows in any order), as columns in step_columns() order (None where NULL), rows sorted by
    (attempt, step), in numpy: one vectorised pass per column (~1 us a sample), where SQLite's GROUP BY
    cost ~19 us per (attempt, step) group (50 aggregates each): a 2-rank job's round is mostly groups."""
    n = len(cols[0])
    attempt = np.array(cols[1], dtype=np.int64)
    rank = np.array(cols[2], dtype=np.int64)
    step = np.array(cols[3], dtype=np.int64)
    order = np.lexsort((rank, step, attempt))  # by (attempt, step, rank): each step's ranks in rank order
    attempt, rank, step = attempt[order], rank[order], step[order]
    starts = np.concatenate(([0], np.flatnonzero((attempt[1:] != attempt[:-1]) | (step[1:] != step[:-1])) + 1))
    sizes = np.diff(np.append(starts, n))
    index = np.arange(n)

    def first_where(mask):
        """Per group: the rank of its first row (lowest rank) where mask holds, or None."""
        at = np.minimum.reduceat(np.where(mask, index, n), starts)
        return np.where(at < n, rank[np.minimum(at, n - 1)], None)

    job = np.array(cols[0], dtype=np.int64)[order][starts]
    ts = np.fmax.reduceat(np.array(cols[4], dtype=float)[order], starts)
    extra = np.array(cols[-1], dtype=object)[order]
    has_extra = extra != None  # noqa: E711 (elementwise)
    extra_at = np.minimum.reduceat(np.where(has_extra, index, n), starts)
    out = [job, attempt[starts], step[starts], ts, sizes,
           np.where(extra_at < n, extra[np.minimum(extra_at, n - 1)], None), first_where(has_extra)]
    ranked = []
    for f in REDUCED_FIELDS:
        v = np.array(cols[_FIELD_AT[f]], dtype=float)[order]
        valid = ~np.isnan(v)
        count = np.add.reduceat(valid, starts)
        some = count > 0
        lo, hi = np.fmin.reduceat(v, starts), np.fmax.reduceat(v, starts)
        total = np.add.reduceat(np.where(valid, v, 0.0), starts)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = total / count
        out += [count, np.where(some, lo, None), np.where(some, mean, None), np.where(some, hi, None)]
        if f in RANKED_FIELDS:
            ranked.append((f, v, lo, hi))
    by_name = {f: (v, lo, hi) for f, v, lo, hi in ranked}
    for f in RANKED_FIELDS:
        v, lo, hi = by_name[f]
        out += [first_where(v == np.repeat(lo, sizes)), first_where(v == np.repeat(hi, sizes))]
    return out


def ingest_sql(vendor: str) -> list[str]:
    """The statements of one round after its rows are staged, in order.

    SQLite (one writer at a time): drop the staged rows already stored, insert the rest, reduce them,
    empty the stage. PostgreSQL: one statement inserts with ON CONFLICT DO NOTHING and reduces exactly
    the rows it inserted (RETURNING): another transaction (a second relay) may commit the same rows
    between any check and the insert, and the insert then waits for it and skips them."""
    sample_table = MetricSample._meta.db_table
    cols = ", ".join(_qn(c) for c in STAGE_COLUMNS)
    clear = f"DELETE FROM {STAGE}"
    if vendor == "postgresql":
        return [f"WITH new_rows AS (INSERT INTO {sample_table} ({cols}) SELECT {cols} FROM {STAGE} "
                f"ON CONFLICT DO NOTHING RETURNING {cols}) " + reduce_sql(vendor, "new_rows"), clear]
    return [(f"DELETE FROM {STAGE} WHERE EXISTS (SELECT 1 FROM {sample_table} m WHERE m.attempt_id = "
             f"{STAGE}.attempt_id AND m.rank = {STAGE}.rank AND m.step = {STAGE}.step)"),
            f"INSERT INTO {sample_table} ({cols}) SELECT {cols} FROM {STAGE}",
            reduce_sql(vendor, STAGE), clear]


def backfill_sql(vendor: str) -> str:
    """Reduce every stored MetricSample into MetricStep (merging into rows already there)."""
    return reduce_sql(vendor, MetricSample._meta.db_table)
