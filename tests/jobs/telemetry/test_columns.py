"""The relay's column-at-a-time shortcuts (issue 26 §3) never change a verdict: entries.samples_surely_valid
accepts only what the pydantic schema accepts, and columns.sample_rows, whenever it answers, keeps, drops,
counts and cleans exactly what the per-sample path (ingest._sample_rows) does."""
from __future__ import annotations

import copy
import random

import pytest

from jobs.telemetry import columns, entries, ingest

GOOD = {"attempt": 3, "rank": 0, "step": 1, "ts": 1.5, "loss": 2.0, "samples_per_s": 10.0, "tokens_per_s": 100.0,
        "step_s": 0.1, "data_s": 0.0, "compute_s": 0.08, "comm_s": 0.01, "optim_s": 0.01, "bytes_sent": 1 << 20,
        "mem_bytes": 1 << 30}
ODD = [True, False, "1", 1.5, -1, 0, 2**31, 2**63, 2**63 - 1, -(2**63) - 1, 2**70, None, [], {}, {"acc": 1.0},
       {"bad name": 1.0, "ok": float("inf")}, float("nan")]


def mutated(rng: random.Random, n: int) -> list[dict]:
    """n samples of attempts 3, 4 and 5, each odd (a value of ODD, a key dropped) with a rate of the round's."""
    out = []
    rate = rng.choice([0.0, 0.02, 0.1, 0.5])
    for i in range(n):
        s = {**GOOD, "rank": i % 4, "step": 1 + i // 4}
        if rng.random() < 0.3:
            s["attempt"] = rng.choice([3, 4, 5])
        if rng.random() < 0.2:
            s["metrics"] = rng.choice([None, {"acc": 1.0}, {"bad name": 2.0, "x": 1}])
        for _ in range(rng.choice([1, 2]) if rng.random() < rate else 0):
            key = rng.choice([*GOOD, "metrics", "share", "extra_key"])
            if rng.random() < 0.2:
                s.pop(key, None)
            else:
                s[key] = copy.deepcopy(rng.choice(ODD))
        out.append(s)
    return out


def pydantic_ok(data) -> bool:
    try:
        entries.validate_samples(data)
        return True
    except entries.EntryError:
        return False


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_schema_check_accepts_nothing_pydantic_refuses(seed):
    rng = random.Random(seed)
    batches = [mutated(rng, rng.randrange(1, 12)) for _ in range(rng.randrange(1, 4))]
    if entries.samples_surely_valid(batches):
        assert all(pydantic_ok(b) for b in batches)
    clean = [[{**GOOD, "step": i} for i in range(5)], [{**GOOD, "metrics": None, "share": 0.5}]]
    assert entries.samples_surely_valid(clean)  # the common case takes the fast way
    assert not entries.samples_surely_valid([[{**GOOD, "loss": True}]])
    assert not entries.samples_surely_valid([[{**GOOD, "rank": 2**31}]])


@pytest.mark.parametrize("seed", range(60))
def test_the_column_path_keeps_drops_and_counts_what_the_per_sample_path_does(seed):
    rng = random.Random(seed)
    samples = mutated(rng, rng.randrange(1, 40))
    attempts = {3: 30, 4: 40}  # 5 is an attempt the database does not know
    fences = {4: 3} if rng.random() < 0.5 else {}
    fast_in, slow_in = copy.deepcopy(samples), copy.deepcopy(samples)
    fast = columns.sample_rows(fast_in, attempts, fences, ingest.user_metrics)
    slow = ingest._sample_rows(slow_in, attempts, fences)
    if fast is None:
        return
    assert sorted(fast.rows, key=repr) == sorted(slow.rows, key=repr)
    assert (fast.top, fast.attempt_top, fast.fenced, fast.dropped_metrics) == \
        (slow.top, slow.attempt_top, slow.fenced, slow.dropped_metrics)
    assert fast_in == slow_in  # the same user metrics cleaned in place
    assert [list(c) for c in fast.columns] == [list(c) for c in zip(*fast.rows)] or not fast.rows


def test_a_clean_round_takes_the_column_path():
    samples = [{**GOOD, "rank": r, "step": s, "metrics": {"acc": 0.5, "bad name": 1}} for s in range(3) for r in range(2)]
    got = columns.sample_rows(samples, {3: 30}, {}, ingest.user_metrics)
    assert got is not None and len(got.rows) == 6 and got.dropped_metrics == 6
    assert got.top == {30: 2} and got.attempt_top == {3: 2}
    assert samples[0]["metrics"] == {"acc": 0.5}
