"""The relay's binary COPY (jobs/telemetry/pgcopy.py) stores exactly what psycopg's text rows store, and
hands back to them whatever the binary form could store differently. Runs under `--postgres` only
(`make test-postgres`): the comparison is PostgreSQL's own."""
from __future__ import annotations

import random

import numpy as np
import pytest
from django.db import connection, transaction

from jobs.telemetry import pgcopy

pytestmark = pytest.mark.django_db(transaction=True)

TYPES = ["int8", "int4", "float8", "float8", "int8", "jsonb"]
NAMES = ["a", "b", "c", "d", "e", "x"]


@pytest.fixture
def tables():
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's binary COPY (run with --postgres)")
    with connection.cursor() as cursor:
        for t in ("t_text", "t_binary"):
            cursor.execute(f"CREATE TABLE {t} (k serial, a bigint, b integer, c double precision, "
                           "d double precision, e bigint, x jsonb)")
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE t_text, t_binary")


def copy_both(rows: list[tuple], order=None) -> tuple[list, list]:
    cols = list(zip(*rows))
    data = pgcopy.binary_copy(cols, TYPES, np.array(order) if order is not None else None)
    assert data is not None
    ordered = [rows[i] for i in order] if order is not None else rows
    with transaction.atomic(), connection.cursor() as cursor:
        with cursor.cursor.copy(f"COPY t_binary ({', '.join(NAMES)}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.write(data)
        with cursor.cursor.copy(f"COPY t_text ({', '.join(NAMES)}) FROM STDIN") as copy:
            for row in ordered:
                copy.write_row(row)
        got = []
        for t in ("t_binary", "t_text"):
            cursor.execute(f"SELECT {', '.join(NAMES)} FROM {t} ORDER BY k")
            got.append(cursor.fetchall())
            cursor.execute(f"TRUNCATE {t}")
    return got[0], got[1]


def test_binary_rows_are_the_text_rows(tables):
    rng = random.Random(5)
    for _ in range(20):
        rows = []
        for i in range(rng.randrange(1, 60)):
            nullish = rng.random() < 0.3
            rows.append((rng.randrange(-2**63, 2**63), rng.randrange(0, 2**31),
                         None if nullish and rng.random() < 0.5 else rng.uniform(-1e300, 1e300),
                         rng.choice([1, 2**53 + 1, -7, 0.5, None, float("inf")]),
                         None if i % 7 == 3 else rng.randrange(1 << 40),
                         rng.choice([None, '{"acc": 1.5}', '{"é": [1, 2]}'])))
        order = rng.sample(range(len(rows)), len(rows)) if rng.random() < 0.5 else None
        binary, text = copy_both(rows, order)
        assert binary == text
    binary, text = copy_both([(1, 2, 3.0, None, None, None)] * 3)  # a column all NULL, the text one too
    assert binary == text


@pytest.mark.parametrize("column, value", [
    (0, 1.5),        # a float for a bigint: the text COPY refuses it, binary must not cut it to 1
    (1, 2**31),      # beyond integer
    (0, 2**63),      # beyond bigint
    (1, True),       # not a number
    (2, "1.0"),
])
def test_what_binary_would_store_differently_goes_back_to_the_text_rows(column, value):
    row = [1, 2, 3.0, 4.0, 5, None]
    row[column] = value
    assert pgcopy.binary_copy(list(zip(*[tuple(row)])), TYPES) is None


def test_a_column_without_nulls_in_one_run():
    cols = [(1, 2, 3), (4, 5, 6), (1.0, 2.0, 3.0), (None, None, None), (7, 8, 9), (None, None, None)]
    data = pgcopy.binary_copy(cols, TYPES)
    per_row = 2 + (4 + 8) + (4 + 4) + (4 + 8) + 4 + (4 + 8) + 4
    assert data is not None and len(data) == len(pgcopy.SIGNATURE) + 3 * per_row + len(pgcopy.TRAILER)
