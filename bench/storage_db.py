"""bench/storage.py's database plumbing: the rows it writes (as the relay and the rollup would), the bulk
writes, and bytes on disk per table (SQLite's dbstat, PostgreSQL's pg_total_relation_size)."""
from __future__ import annotations

import os
import random

# --- rows ----------------------------------------------------------------------------------------

SAMPLE_COLS = ("job_id", "attempt_id", "rank", "step", "ts", "loss", "samples_per_s", "tokens_per_s", "step_s",
               "data_s", "compute_s", "comm_s", "optim_s", "bytes_sent", "mem_bytes", "compression_ratio", "share",
               "extra")


def sample_rows(job_id: int, attempt_id: int, ranks: int, steps, rnd: random.Random):
    """Per-rank rows, step-major, as the built-in trainer reports them (no user metrics)."""
    r = rnd.random
    for step in steps:
        ts = 1.7e9 + step * 0.35
        for rank in range(ranks):
            step_s = 0.3 + 0.05 * r()
            yield (job_id, attempt_id, rank, step, ts + 0.001 * r(), 4.0 - step / 1e5 + 0.1 * r(),
                   32 / step_s, 32 * 2048 / step_s, step_s, 0.01 * r(), 0.2 + 0.05 * r(), 0.05 * r(), 0.01 * r(),
                   1_500_000_000 + int(1e6 * r()), 60_000_000_000 + int(1e8 * r()), None, None, None)


def step_columns() -> list[str]:
    from jobs.models import MetricStep

    return [f.column for f in MetricStep._meta.concrete_fields if f.column != "id"]


def step_rows(job_id: int, attempt_id: int, ranks: int, steps, rnd: random.Random):
    """MetricStep rows as the rollup leaves them for `ranks` ranks (compression_ratio and share unreported)."""
    from jobs.models.telemetry import RANKED_FIELDS, REDUCED_FIELDS

    cols = step_columns()
    r = rnd.random
    for step in steps:
        v = {"job_id": job_id, "attempt_id": attempt_id, "step": step, "ts": 1.7e9 + step * 0.35, "ranks": ranks,
             "extra": None, "extra_rank": None}
        for f in REDUCED_FIELDS:
            if f in ("compression_ratio", "share"):
                v[f"{f}_n"], v[f"{f}_min"], v[f"{f}_mean"], v[f"{f}_max"] = 0, None, None, None
            else:
                base = 1e9 * r() if f in ("bytes_sent", "mem_bytes") else r()
                v[f"{f}_n"], v[f"{f}_min"], v[f"{f}_mean"], v[f"{f}_max"] = ranks, base, base * 1.1, base * 1.3
        for f in RANKED_FIELDS:
            v[f"{f}_min_rank"], v[f"{f}_max_rank"] = int(ranks * r()), int(ranks * r())
        yield tuple(v[c] for c in cols)


def write(table: str, cols, rows, chunk: int = 100_000) -> int:
    """Bulk-write rows: executemany in transactions of `chunk` rows (SQLite), COPY (PostgreSQL)."""
    from django.db import connection, transaction

    n = 0
    names = ", ".join(connection.ops.quote_name(c) for c in cols)
    if connection.vendor == "postgresql":
        with transaction.atomic(), connection.cursor() as cur:
            with cur.cursor.copy(f"COPY {table} ({names}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
                    n += 1
        return n
    sql = f"INSERT INTO {table} ({names}) VALUES ({', '.join(['?'] * len(cols))})"
    # bulk-load settings for this bench's writes only (sizes do not depend on them): no fsync, a 1 GB page
    # cache (the (job, rank, step) index takes step-major rows at every rank's place)
    connection.connection.execute("PRAGMA synchronous=OFF")
    connection.connection.execute("PRAGMA cache_size=-1000000")
    batch = []
    for row in rows:
        batch.append(row)
        if len(batch) >= chunk:
            with transaction.atomic():
                connection.connection.executemany(sql, batch)
            n += len(batch)
            batch = []
    if batch:
        with transaction.atomic():
            connection.connection.executemany(sql, batch)
        n += len(batch)
    connection.connection.execute("PRAGMA synchronous=NORMAL")  # as controlplane/database.py
    connection.connection.execute("PRAGMA cache_size=-2000")
    return n


# --- bytes on disk -------------------------------------------------------------------------------

def sizes() -> dict:
    """Bytes on disk of MetricSample and MetricStep (each with its indexes), and of the whole database."""
    from django.db import connection

    from jobs.models import MetricSample, MetricStep

    tables = {"metric_sample": MetricSample._meta.db_table, "metric_step": MetricStep._meta.db_table}
    out = {}
    with connection.cursor() as cur:
        if connection.vendor == "sqlite":
            for key, table in tables.items():
                cur.execute("SELECT name FROM sqlite_master WHERE tbl_name = %s", [table])
                names = [r[0] for r in cur.fetchall()]
                cur.execute(f"SELECT name, SUM(pgsize) FROM dbstat WHERE name IN ({', '.join(['%s'] * len(names))}) "
                            "GROUP BY name", names)
                parts = dict(cur.fetchall())
                out[key] = {"bytes": sum(parts.values()), "parts": parts}
            cur.execute("PRAGMA page_count")
            pages = cur.fetchone()[0]
            cur.execute("PRAGMA freelist_count")
            free = cur.fetchone()[0]
            cur.execute("PRAGMA page_size")
            size = cur.fetchone()[0]
            out["database_used_bytes"] = (pages - free) * size
            out["database_file_bytes"] = os.path.getsize(connection.settings_dict["NAME"])
        else:
            for key, table in tables.items():
                cur.execute("SELECT pg_total_relation_size(%s), pg_relation_size(%s), pg_indexes_size(%s)",
                            [table, table, table])
                total, heap, idx = cur.fetchone()
                out[key] = {"bytes": total, "parts": {"heap": heap, "indexes": idx, "toast": total - heap - idx}}
            cur.execute("SELECT pg_database_size(current_database())")
            out["database_bytes"] = cur.fetchone()[0]
    return out


def settle() -> None:
    """PostgreSQL: VACUUM ANALYZE the two tables (the visibility map and free space map are part of what a
    table costs on disk); SQLite: nothing (rows were only appended)."""
    from django.db import connection

    from jobs.models import MetricSample, MetricStep

    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            for m in (MetricSample, MetricStep):
                cur.execute(f"VACUUM ANALYZE {m._meta.db_table}")


def clear() -> None:
    """Empty both tables and give the space back, for the next case."""
    from django.db import connection

    from jobs.models import MetricSample, MetricStep

    with connection.cursor() as cur:
        for m in (MetricSample, MetricStep):
            if connection.vendor == "postgresql":
                cur.execute(f"TRUNCATE {m._meta.db_table}")
            else:
                cur.execute(f"DELETE FROM {m._meta.db_table}")
        if connection.vendor == "sqlite":
            cur.execute("VACUUM")
