"""The per-step rollup (issue 26): MetricStep is exactly the reduction of the stored per-rank samples,
whatever the rounds they arrive in and however often a round is replayed (SQLite and, under
`make test-postgres`, PostgreSQL's COPY path)."""
from __future__ import annotations

import random
import statistics

import pytest

from jobs.models import MetricSample, MetricStep
from jobs.models.telemetry import RANKED_FIELDS, REDUCED_FIELDS
from jobs.telemetry import ingest

from tests.jobs.runs.test_services import start, submit


def sample(attempt, rank, step, rng):
    s = {"attempt": attempt.pk, "rank": rank, "step": step, "ts": 1000.0 + step + rank / 100,
         "loss": rng.uniform(1, 3), "step_s": rng.uniform(0.1, 0.5), "compute_s": rng.uniform(0.05, 0.2),
         "bytes_sent": rng.randrange(1, 1 << 40), "mem_bytes": rng.randrange(1, 1 << 34)}
    if rng.random() < 0.3:
        s["comm_s"] = None  # a field a rank did not report counts nowhere
    else:
        s["comm_s"] = rng.uniform(0, 0.1)
    if rank in (1, 2):
        s["metrics"] = {"acc": rank + step / 1000}
    return s


def expected(rows: list[dict]) -> dict:
    out = {"ranks": len(rows), "ts": max(r["ts"] for r in rows)}
    for f in REDUCED_FIELDS:
        vals = [(r[f], r["rank"]) for r in rows if r.get(f) is not None]
        out[f"{f}_n"] = len(vals)
        if vals:
            out[f"{f}_min"], out[f"{f}_max"] = min(v for v, _ in vals), max(v for v, _ in vals)
            out[f"{f}_mean"] = statistics.fmean(v for v, _ in vals)
            if f in RANKED_FIELDS:
                out[f"{f}_min_rank"] = min(vals)[1]
                out[f"{f}_max_rank"] = max(vals, key=lambda x: (x[0], -x[1]))[1]
        else:
            out[f"{f}_min"] = out[f"{f}_max"] = out[f"{f}_mean"] = None
    with_extra = sorted((r for r in rows if r.get("metrics")), key=lambda r: r["rank"])
    out["extra"] = with_extra[0]["metrics"] if with_extra else None
    return out


def check(attempt, stored: dict[int, list[dict]]) -> None:
    got = {r.step: r for r in MetricStep.objects.filter(attempt=attempt)}
    assert sorted(got) == sorted(stored)
    for step, rows in stored.items():
        want, row = expected(rows), got[step]
        for key, value in want.items():
            actual = getattr(row, key)
            if isinstance(value, float):
                assert actual == pytest.approx(value, rel=1e-9), (step, key)
            else:
                assert actual == value, (step, key)
        assert row.job_id == attempt.job_id


@pytest.mark.django_db(transaction=True)
def test_steps_arriving_in_many_rounds_with_replays_reduce_exactly_once(user, nodes):
    rng = random.Random(7)
    job = submit(user)
    attempt = start(job)
    ranks, steps = 8, 30
    samples = [sample(attempt, r, s, rng) for s in range(1, steps + 1) for r in range(ranks)]
    rng.shuffle(samples)  # each step's ranks spread over many rounds
    cuts = sorted(rng.sample(range(1, len(samples)), 15))
    rounds = [samples[a:b] for a, b in zip([0, *cuts], [*cuts, len(samples)])]
    stored: dict[int, list[dict]] = {}
    seen: set[tuple[int, int]] = set()
    for i, batch in enumerate(rounds):
        ingest.telemetry_ingest([dict(s) for s in batch], events=[])
        for s in batch:
            if (s["rank"], s["step"]) not in seen:
                seen.add((s["rank"], s["step"]))
                stored.setdefault(s["step"], []).append(s)
        if i % 3 == 0:  # a replayed round (relay killed before the ack), and a sample twice in one round
            ingest.telemetry_ingest([dict(s) for s in batch] + [dict(batch[0])], events=[])
    assert MetricSample.objects.filter(attempt=attempt).count() == ranks * steps
    check(attempt, stored)


@pytest.mark.django_db(transaction=True)
def test_what_the_relay_publishes_without_reading_back_is_what_is_stored(user, nodes):
    """The fast path hands the relay its reduction (rollup.Reduced): the steps it stored as they are are
    published from it (reduced.steps_from), the ones that merged into a stored row are named for reading
    back; either way a browser gets exactly the row MetricStep holds after the commit."""
    from jobs.telemetry import reduced as reduced_mod

    rng = random.Random(11)
    job = submit(user)
    attempt = start(job)
    samples = [sample(attempt, r, s, rng) for s in range(1, 41) for r in range(3)]
    for s in samples[::7]:
        s["loss"] = None  # a field no rank of some steps reported
    rounds = [samples[:50], samples[50:51], samples[51:]]  # step 17's ranks split over two rounds
    merged = []
    for batch in rounds:
        out: list = []
        ingest.telemetry_ingest([dict(s) for s in batch], events=[], reduced=out)
        (got,) = out
        keys: dict[int, set[int]] = {}
        for row in got.rows:
            keys.setdefault(row[1], set()).add(row[2])
        stored = {(r["attempt"], r["step"]): r for r in reduced_mod.steps_of(keys)}
        fresh = [row for row in got.rows if (row[1], row[2]) not in got.merged]
        assert got.merged == {k for k in stored if k not in {(r[1], r[2]) for r in fresh}}
        merged.append(got.merged)
        assert {(r["attempt"], r["step"]): r for r in reduced_mod.steps_from(fresh)} == \
            {k: v for k, v in stored.items() if k not in got.merged}
    assert merged == [set(), {(attempt.pk, 17)}, set()]  # the second round's one sample merged into step 17
    out = []
    ingest.telemetry_ingest([dict(s) for s in rounds[0]], events=[], reduced=out)
    assert out == []  # a replay takes the slow path: nothing to publish without reading it back


@pytest.mark.django_db(transaction=True)
def test_ties_keep_the_lowest_rank_and_the_lowest_rank_user_metrics_win(user, nodes):
    job = submit(user)
    attempt = start(job)
    base = {"attempt": attempt.pk, "step": 5, "ts": 1.0, "step_s": 0.2, "loss": 1.0, "compute_s": 0.1}
    ingest.telemetry_ingest([{**base, "rank": 3, "metrics": {"acc": 3.0}}], events=[])
    ingest.telemetry_ingest([{**base, "rank": 1, "metrics": {"acc": 1.0}}, {**base, "rank": 2}], events=[])
    ingest.telemetry_ingest([{**base, "rank": 4, "step_s": 0.9, "metrics": {"acc": 4.0}}], events=[])
    row = MetricStep.objects.get(attempt=attempt, step=5)
    assert (row.ranks, row.step_s_n, row.step_s_max, row.step_s_max_rank) == (4, 4, 0.9, 4)
    assert row.step_s_min_rank == 3  # the tie at 0.2 was first held by rank 3, and a tie keeps what is there
    assert (row.extra, row.extra_rank) == ({"acc": 1.0}, 1)
    assert row.step_s_mean == pytest.approx((0.2 * 3 + 0.9) / 4)
    assert row.data_s_n == 0 and row.data_s_mean is None


@pytest.mark.django_db(transaction=True)
def test_the_migration_backfill_reduces_samples_stored_before_the_rollup(user, nodes):
    from django.db import connection

    from jobs.telemetry.rollup import backfill_sql

    rng = random.Random(3)
    job = submit(user)
    attempt = start(job)
    samples = [sample(attempt, r, s, rng) for s in range(1, 6) for r in range(4)]
    ingest.telemetry_ingest([dict(s) for s in samples], events=[])
    MetricStep.objects.all().delete()  # as a database migrated before MetricStep existed
    with connection.cursor() as cur:
        cur.execute(backfill_sql(connection.vendor))
    stored: dict[int, list[dict]] = {}
    for s in samples:
        stored.setdefault(s["step"], []).append(s)
    check(attempt, stored)


@pytest.mark.django_db(transaction=True)
def test_a_round_whose_steps_lie_far_apart_names_only_its_own_steps_as_merged(user, nodes):
    """A round holding a rank's late sample of an early step and another's of a late one merges into
    two stored rows, and only those two are named for reading back and publishing: on SQLite the
    stored steps were looked up by range and every step stored in between came back as "merged"
    (a running job's step 18 in a round with step 2,000,400: ~7,600 step rows sent to every
    browser in one round, past their flow-control window)."""
    from jobs.telemetry.publish import _round_steps

    rng = random.Random(5)
    job = submit(user)
    attempt = start(job)
    first = [sample(attempt, r, s, rng) for s in range(1, 41) for r in range(2) if (s, r) not in {(2, 1), (39, 1)}]
    ingest.telemetry_ingest(first, events=[])
    out: list = []
    late = [sample(attempt, 1, 2, rng), sample(attempt, 1, 39, rng)]
    ingest.telemetry_ingest([dict(s) for s in late], events=[], reduced=out)
    (got,) = out
    assert got.merged == {(attempt.pk, 2), (attempt.pk, 39)}
    rows = _round_steps([(job.pk, late)], got)
    assert [(r["step"], r["ranks"]) for r in rows] == [(2, 2), (39, 2)]
