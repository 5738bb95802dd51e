"""A round's metric samples as columns (issue 26 §3): the relay's fast way from orjson's dicts to the
INSERT's rows and the rollup's arrays, with no per-sample Python object beyond the dicts themselves.

`sample_rows` takes every sample's values in one C call each (`operator.itemgetter`), transposes them
(`zip`), and checks whole columns (the set of a column's types, its min and max) against the rules
jobs/telemetry/ingest.py's `_metric_row` applies to one sample at a time. A round that passes every
rule (the normal case: the relay's schema, jobs/telemetry/entries.py, already refused the rest) goes
this way; a round with anything `_metric_row` would drop or doubt (a bool, a string, a missing rank,
an int beyond int64, an int `ts`) returns None and takes the per-sample path instead, so which
samples are stored, dropped and counted never depends on which way a round went.
"""
from __future__ import annotations

from itertools import compress, repeat
from operator import itemgetter
from typing import NamedTuple

import numpy as np
import orjson

from jobs.models import MetricSample

FIELDS = MetricSample.FIELDS  # rank, step, ts, then the optional numbers
KEYS = ("attempt", *FIELDS)
_ALL = itemgetter(*KEYS)
_INT64 = 2**63
_NONE = type(None)
_INT, _FLOAT, _NUMBER = frozenset((int,)), frozenset((float,)), frozenset((int, float, _NONE))


class Rows(NamedTuple):
    """The kept samples of a round: `columns` in rollup.STAGE_COLUMNS order (job, attempt, FIELDS...,
    extra), `rows` the same as INSERT tuples, and the per-job and per-attempt top steps."""

    columns: list[tuple]
    rows: list[tuple]
    top: dict[int, int]
    attempt_top: dict[int, int]
    fenced: int
    dropped_metrics: int


def _columns(samples: list[dict]) -> list[tuple] | None:
    """KEYS' columns (None for a key a sample lacks), or None if a sample is not a dict."""
    try:
        return list(zip(*map(_ALL, samples)))
    except KeyError:
        pass  # an optional field the ranks leave out (no share): the first sample's keys in one pass
    except TypeError:  # not a dict
        return None
    first = samples[0]
    if type(first) is not dict:
        return None
    have = [k for k in KEYS if k in first]
    try:
        got = dict(zip(have, zip(*map(itemgetter(*have), samples)))) if len(have) > 1 else {}
    except KeyError:
        got = {}
    except TypeError:
        return None
    try:
        return [got[k] if k in got else tuple(map(dict.get, samples, repeat(k))) for k in KEYS]
    except TypeError:
        return None


def _numbers_ok(column: tuple) -> bool:
    """Every value a float, an int within int64, or None (what _metric_row accepts)."""
    types = set(map(type, column))
    if not types <= _NUMBER:
        return False
    if int not in types:
        return True
    values = [v for v in column if v is not None] if _NONE in types else column
    return -_INT64 <= min(values) and max(values) < _INT64


def _clean(cols: list[tuple]) -> bool:
    """The round's columns pass every rule of _metric_row (rank/step ints, rank >= 0, 0 <= step < 2**63,
    ts given, every other value a number or null, ints within int64) and every attempt is an int."""
    attempt, rank, step, ts, *rest = cols
    if not (set(map(type, attempt)) <= _INT and set(map(type, rank)) <= _INT and set(map(type, step)) <= _INT):
        return False
    if min(rank) < 0 or min(step) < 0 or max(step) >= _INT64:
        return False
    if not set(map(type, ts)) <= _FLOAT:  # an int ts (never sent) goes the per-sample way
        return False
    return all(map(_numbers_ok, rest))


def sample_rows(samples: list[dict], attempts: dict[int, int], fences: dict[int, int],
                user_metrics) -> Rows | None:
    """The rows of `samples` whose attempt `attempts` knows (attempt -> job) and that no fence drops
    (attempt -> its fenced step), or None when a sample needs the per-sample path (see the module).
    `user_metrics(raw)` is ingest's check of a sample's own metrics; as there, a kept sample's
    "metrics" is replaced by what is stored (what the relay fans out is what is stored)."""
    if not samples:
        return None
    cols = _columns(samples)
    if cols is None or not _clean(cols):
        return None
    attempt, step = cols[0], cols[2]
    jobs = tuple(map(attempts.get, attempt))
    keep: list[bool] | None = None
    if None in jobs:
        keep = [j is not None for j in jobs]
    fenced = 0
    if fences and not fences.keys().isdisjoint(attempt):
        limit = [fences.get(a, _INT64) for a in attempt]
        ok = [s <= f for s, f in zip(step, limit)]
        fenced = len(ok) - sum(ok)  # a fenced attempt is a known one
        keep = ok if keep is None else [k and o for k, o in zip(keep, ok)]
    raw = tuple(map(dict.get, samples, repeat("metrics")))
    dropped_metrics = 0
    if raw.count(None) != len(raw):
        extras = list(raw)
        for i, value in enumerate(raw):
            if value is not None and (keep is None or keep[i]):
                extra, dropped = user_metrics(value)
                dropped_metrics += dropped
                samples[i]["metrics"] = extra
                extras[i] = orjson.dumps(extra).decode() if extra else None
            else:
                extras[i] = None
        raw = tuple(extras)
    columns = [jobs, *cols, raw]
    if keep is not None:
        columns = [tuple(compress(c, keep)) for c in columns]
        if not columns[0]:
            return Rows(columns, [], {}, {}, fenced, dropped_metrics)
    top, attempt_top = _tops(columns[0], columns[1], columns[3])
    return Rows(columns, list(zip(*columns)), top, attempt_top, fenced, dropped_metrics)


def _tops(jobs: tuple, attempt: tuple, step: tuple) -> tuple[dict[int, int], dict[int, int]]:
    """(job -> its highest step, attempt -> its highest step) of the kept rows."""
    if len(set(attempt)) == 1:
        best = max(step)
        return {jobs[0]: best} if best > 0 else {}, {attempt[0]: best}
    a = np.fromiter(attempt, dtype=np.int64, count=len(attempt))
    s = np.fromiter(step, dtype=np.int64, count=len(step))
    j = np.fromiter(jobs, dtype=np.int64, count=len(jobs))
    order = np.lexsort((s, a))
    last = np.flatnonzero(np.append(a[order][1:] != a[order][:-1], True))
    attempt_top = dict(zip(a[order][last].tolist(), s[order][last].tolist()))
    top: dict[int, int] = {}
    for job, best in zip(j[order][last].tolist(), s[order][last].tolist()):
        if best > top.get(job, 0):
            top[job] = best
    return top, attempt_top
