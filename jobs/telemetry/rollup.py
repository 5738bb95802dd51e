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


def reduce_sql(vendor: str, source: str) -> str:
    """INSERT INTO MetricStep the reduction of `source` (a table with MetricSample's columns) by
    (attempt, step), merged into the rows already there."""
    step_table = MetricStep._meta.db_table
    cols, sel, merge = ["job_id", "attempt_id", "step", "ts", "ranks", "extra", "extra_rank"], [], []

    def sub(col: str, where: str, order: str) -> str:
        return (f"(SELECT s2.{col} FROM {source} s2 WHERE s2.attempt_id = g.attempt_id AND s2.step = g.step "
                f"AND {where} ORDER BY {order} LIMIT 1)")

    sel += ["g.job_id", "g.attempt_id", "g.step", "MAX(g.ts)", "COUNT(*)",
            sub("extra", "s2.extra IS NOT NULL", "s2.rank"), sub("rank", "s2.extra IS NOT NULL", "s2.rank")]
    t, x = step_table, "excluded"
    merge += [f"ts = {_least(vendor, f'{t}.ts', f'{x}.ts', 'max')}", f"ranks = {t}.ranks + {x}.ranks",
              f"extra = CASE WHEN {t}.extra_rank IS NULL OR ({x}.extra_rank IS NOT NULL AND "
              f"{x}.extra_rank < {t}.extra_rank) THEN {x}.extra ELSE {t}.extra END",
              f"extra_rank = CASE WHEN {t}.extra_rank IS NULL OR ({x}.extra_rank IS NOT NULL AND "
              f"{x}.extra_rank < {t}.extra_rank) THEN {x}.extra_rank ELSE {t}.extra_rank END"]
    for f in REDUCED_FIELDS:
        q = _qn(f)
        cols += [f"{f}_n", f"{f}_min", f"{f}_mean", f"{f}_max"]
        sel += [f"COUNT(g.{q})", f"MIN(g.{q})", f"AVG(g.{q})", f"MAX(g.{q})"]
        n, xn = f"{t}.{f}_n", f"{x}.{f}_n"
        merge += [f"{f}_n = {n} + {xn}",
                  f"{f}_min = {_least(vendor, f'{t}.{f}_min', f'{x}.{f}_min', 'min')}",
                  f"{f}_max = {_least(vendor, f'{t}.{f}_max', f'{x}.{f}_max', 'max')}",
                  f"{f}_mean = CASE WHEN {n} + {xn} = 0 THEN NULL ELSE "
                  f"(COALESCE({t}.{f}_mean * {n}, 0) + COALESCE({x}.{f}_mean * {xn}, 0)) / ({n} + {xn}) END"]
    for f in RANKED_FIELDS:
        q = _qn(f)
        cols += [f"{f}_min_rank", f"{f}_max_rank"]
        sel += [sub("rank", f"s2.{q} IS NOT NULL", f"s2.{q} ASC, s2.rank"),
                sub("rank", f"s2.{q} IS NOT NULL", f"s2.{q} DESC, s2.rank")]
        # a tie keeps the rank already there: a replay (never reduced twice anyway) changes nothing
        merge += [f"{f}_min_rank = CASE WHEN {t}.{f}_min IS NULL OR {x}.{f}_min < {t}.{f}_min "
                  f"THEN {x}.{f}_min_rank ELSE {t}.{f}_min_rank END",
                  f"{f}_max_rank = CASE WHEN {t}.{f}_max IS NULL OR {x}.{f}_max > {t}.{f}_max "
                  f"THEN {x}.{f}_max_rank ELSE {t}.{f}_max_rank END"]
    return (f"INSERT INTO {step_table} ({', '.join(_qn(c) for c in cols)}) "
            f"SELECT {', '.join(sel)} FROM {source} g WHERE true GROUP BY g.attempt_id, g.step, g.job_id "
            f"ON CONFLICT (attempt_id, step) DO UPDATE SET {', '.join(merge)}")


def ingest_sql(vendor: str) -> dict[str, str]:
    """The statements of one round after its rows are staged: drop the ones already stored, insert the
    rest, reduce them, empty the stage (SQLite; PostgreSQL's empties itself at commit)."""
    sample_table = MetricSample._meta.db_table
    cols = ", ".join(_qn(c) for c in STAGE_COLUMNS)
    return {
        "dedupe": (f"DELETE FROM {STAGE} WHERE EXISTS (SELECT 1 FROM {sample_table} m WHERE m.attempt_id = "
                   f"{STAGE}.attempt_id AND m.rank = {STAGE}.rank AND m.step = {STAGE}.step)"),
        "insert": f"INSERT INTO {sample_table} ({cols}) SELECT {cols} FROM {STAGE}",
        "reduce": reduce_sql(vendor, STAGE),
        "clear": f"DELETE FROM {STAGE}",
    }


def backfill_sql(vendor: str) -> str:
    """Reduce every stored MetricSample into MetricStep (merging into rows already there)."""
    return reduce_sql(vendor, MetricSample._meta.db_table)
