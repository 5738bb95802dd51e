"""Issue 26: the job socket's charts come from MetricStep. The snapshot sends bucketed reduced steps (at
most ~1,500 points per curve whatever the run's length or ranks, min/max across each bucket so spikes
survive), the named ranks (slowest/fastest by how often they were a step's extreme) and their recent
per-rank samples; the relay publishes each round's steps read back from MetricStep and the named ranks'
samples only (jobs/telemetry/reduced.py, publish.py, relay.py fan_out)."""
from __future__ import annotations

import orjson
import pytest
from django.db import connection

from jobs import services
from jobs.models import Attempt, MetricSample, MetricStep
from jobs.models.telemetry import RANKED_FIELDS, REDUCED_FIELDS
from jobs.runs import payloads as runs_payloads
from jobs.telemetry import ingest, payloads as telemetry_payloads, reduced
from jobs.telemetry.relay import Relay

pytestmark = pytest.mark.django_db


@pytest.fixture
def running(user, nodes):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "wide"}))
    services.schedule_tick()
    return job, job.attempts.get()


def write_steps(job, attempt, steps, *, ranks=1024, spike_at=None, metrics=False):
    """MetricStep rows written directly (as bench/ws_snapshot.py does): step_s mean 0.2, min 0.1
    (rank 5), max 0.3 (rank 17), 10.0 at `spike_at`; loss 1/(1+step)."""
    cols = ["job_id", "attempt_id", "step", "ts", "ranks", "extra", "extra_rank"]
    for f in REDUCED_FIELDS:
        cols += [f"{f}_n", f"{f}_min", f"{f}_mean", f"{f}_max"]
    for f in RANKED_FIELDS:
        cols += [f"{f}_min_rank", f"{f}_max_rank"]
    rows = []
    for s in steps:
        extra = orjson.dumps({"acc": s / 1000}).decode() if metrics else None
        row = [job.pk, attempt.pk, s, 1000.0 + s, ranks, extra, 0 if metrics else None]
        for f in REDUCED_FIELDS:
            if f == "step_s":
                row += [ranks, 0.1, 0.2, 10.0 if s == spike_at else 0.3]
            elif f == "loss":
                row += [ranks, 0.5 / (1 + s), 1.0 / (1 + s), 2.0 / (1 + s)]
            else:
                row += [0, None, None, None]
        for f in RANKED_FIELDS:
            row += [5, 17] if f == "step_s" else [None, None]
        rows.append(row)
    with connection.cursor() as cur:
        cur.executemany(f"INSERT INTO {MetricStep._meta.db_table} ({', '.join(cols)}) "
                        f"VALUES ({', '.join(['%s'] * len(cols))})", rows)


def test_a_long_run_is_bucketed_and_keeps_its_spikes(running, django_assert_max_num_queries):
    job, attempt = running
    steps = list(range(0, 9000, 3))  # an uneven stride: 3,000 steps
    write_steps(job, attempt, steps, spike_at=4503, metrics=True)
    with django_assert_max_num_queries(5):  # lineage, first step, newest row, GROUP BY, the last rows
        out = reduced.reduced_series(job.pk, max_points=1500)
    rows = out["steps"]
    assert out["bucketed"] and out["total_steps"] == 3000 and 750 <= len(rows) <= 1500
    assert rows[0]["first"] == 0 and rows[-1]["step"] == steps[-1]
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})
    spiked = [r for r in rows if r["step_s"][2] == 10.0]
    assert len(spiked) == 1 and spiked[0]["first"] <= 4503 <= spiked[0]["step"]  # the spike survives
    last = rows[-1]
    assert last["step_s"] == [0.1, 0.2, 0.3, 1024] and last["by"]["step_s"] == [5, 17]
    assert last["loss"][1] == pytest.approx(1.0 / (1 + steps[-1]))  # the mean at the bucket's last step
    assert rows[1]["loss"][2] == pytest.approx(2.0 / (1 + rows[1]["first"]))  # max over the bucket
    assert "samples_per_s" not in last  # a field no rank reported is left out
    assert last["metrics"]["acc"] == [pytest.approx(steps[-1] / 1000)] * 3  # the last step's (lowest rank's) value


def test_a_short_run_is_sent_step_by_step(running):
    job, attempt = running
    ingest.telemetry_ingest([{"attempt": attempt.pk, "rank": r, "step": s, "ts": 1.0 + s, "loss": 1.0 + r,
                              "step_s": 0.1 * (r + 1)} for s in range(1, 41) for r in range(2)], events=[])
    out = reduced.reduced_series(job.pk)
    assert not out["bucketed"] and [r["step"] for r in out["steps"]] == list(range(1, 41))
    row = out["steps"][0]
    assert row["loss"] == [1.0, 1.5, 2.0, 2] and row["by"]["step_s"] == [0, 1] and row["ranks"] == 2
    assert "first" not in row


def test_the_lineage_replaces_what_a_restart_resumed_over(running, user):
    job, first = running
    write_steps(job, first, range(0, 100))
    second = Attempt.objects.create(job=job, number=2, resumed_from_step=60)
    write_steps(job, second, range(61, 80))
    rows = reduced.reduced_series(job.pk)["steps"]
    assert [(r["attempt"], r["step"]) for r in rows] == (
        [(first.pk, s) for s in range(0, 61)] + [(second.pk, s) for s in range(61, 80)])


def ingest_wide(attempt, steps, ranks=64, slow=17, fast=5):
    ingest.telemetry_ingest([
        {"attempt": attempt.pk, "rank": r, "step": s, "ts": 1.0 + s, "loss": 2.0,
         "step_s": 0.9 if r == slow else 0.05 if r == fast else 0.2 + r / 1000}
        for s in steps for r in range(ranks)], events=[])


def test_the_snapshot_names_the_slowest_and_fastest_ranks_and_sends_only_their_samples(running):
    job, attempt = running
    ingest_wide(attempt, range(1, 21))
    snap = runs_payloads.job_snapshot(job.pk)
    assert [r["step"] for r in snap["steps"]] == list(range(1, 21)) and snap["bucketed"] is False
    named = snap["named"]
    assert named["slowest"] == [{"rank": 17, "count": 20}] and named["fastest"] == [{"rank": 5, "count": 20}]
    assert named["all"] is False and named["window"] == 20
    assert {s["rank"] for s in snap["samples"]} == {5, 17} and len(snap["samples"]) == 40
    assert snap["steps"][-1]["step_s"][:3] == [0.05, pytest.approx((0.9 + 0.05 + sum(
        0.2 + r / 1000 for r in range(64) if r not in (5, 17))) / 64), 0.9]
    assert set(snap["samples"][0]) >= {"rank", "step", "ts", "loss", "step_s", "attempt", "metrics"}
    # the whole frame stays small: 64 ranks cost what 2 do
    assert len(orjson.dumps(snap["steps"])) < 20 * 400


def test_a_small_job_names_every_rank(running):
    job, attempt = running
    ingest_wide(attempt, range(1, 11), ranks=4, slow=3, fast=0)
    snap = runs_payloads.job_snapshot(job.pk)
    assert snap["named"]["all"] is True
    assert {s["rank"] for s in snap["samples"]} == {0, 1, 2, 3} and len(snap["samples"]) == 40


def test_named_samples_cover_only_the_recent_steps(running):
    job, attempt = running
    ingest_wide(attempt, range(1, 31), ranks=2)
    named = reduced.named_ranks(job.pk)
    samples = reduced.named_samples(job.pk, named, steps=10)
    assert sorted({s["step"] for s in samples}) == list(range(21, 31))
    window = telemetry_payloads.chart_telemetry(job.pk, from_step=25)
    assert [r["step"] for r in window["steps"]] == list(range(25, 31))
    assert min(s["step"] for s in window["samples"]) == 25


def test_an_empty_job_has_an_empty_frame(running):
    job, _ = running
    snap = runs_payloads.job_snapshot(job.pk)
    assert snap["steps"] == [] and snap["samples"] == [] and snap["named"]["slowest"] == []


# ---------------------------------------------------------------- the relay's reduced fan-out

class Published(list):
    def __call__(self, group, message):
        self.append((group, message))

    def telemetry(self):
        return [(g, {"steps": orjson.loads(m["steps_json"]), "samples": orjson.loads(m["samples_json"]),
                     "named": orjson.loads(m["named_json"]), "first_step": m["first_step"], "count": m["count"]})
                for g, m in self if m["type"] == "job.telemetry"]


def relay_round(relay, attempt, samples):
    """What Relay.handle does with a committed round: ingest, then fan_out."""
    ingest.telemetry_ingest([dict(s) for s in samples], events=[])
    relay.fan_out([(attempt.job_id, samples, [], [])])


def wide(attempt, step, ranks, slow=17, fast=5):
    return [{"attempt": attempt.pk, "rank": r, "step": step, "ts": 1.0 + step, "loss": 2.0,
             "step_s": 0.9 if r == slow else 0.05 if r == fast else 0.2} for r in ranks]


def test_the_relay_publishes_one_reduced_row_per_step_and_the_named_ranks_samples(running, user,
                                                                                 django_assert_max_num_queries):
    job, attempt = running
    other = services.job_submit(user=user, spec=services.submitted_spec({"name": "other"}))
    services.schedule_tick()
    other_attempt = other.attempts.get()
    published = Published()
    relay = Relay("redis://127.0.0.1:1/0", publish=published)
    samples = [s for step in (1, 2, 3) for s in wide(attempt, step, range(64))]
    others = wide(other_attempt, 1, range(2), slow=1, fast=0)
    ingest.telemetry_ingest([dict(s) for s in samples + others], events=[])
    with django_assert_max_num_queries(1):  # one SELECT for every touched step of every job
        relay.fan_out([(job.pk, samples, [], []), (other.pk, others, [], [])])
    msgs = published.telemetry()
    assert [g for g, _ in msgs] == [f"job.{job.pk}", f"job.{other.pk}"]
    mine = msgs[0][1]
    assert [r["step"] for r in mine["steps"]] == [1, 2, 3] and all(r["ranks"] == 64 for r in mine["steps"])
    assert mine["steps"][0]["by"]["step_s"] == [5, 17] and mine["steps"][0]["step_s"][0] == 0.05
    assert {s["rank"] for s in mine["samples"]} == {5, 17} and len(mine["samples"]) == 6  # not 192
    assert mine["named"]["slowest"][0] == {"rank": 17, "count": 3} and mine["first_step"] == 1
    theirs = msgs[1][1]
    assert theirs["named"]["all"] is True and len(theirs["samples"]) == 2  # a small job: every rank


def test_a_step_arriving_over_several_rounds_is_sent_again_merged(running):
    job, attempt = running
    published = Published()
    relay = Relay("redis://127.0.0.1:1/0", publish=published)
    relay_round(relay, attempt, wide(attempt, 7, range(0, 32)))
    relay_round(relay, attempt, wide(attempt, 7, range(32, 64)))
    relay_round(relay, attempt, wide(attempt, 7, range(32, 64)))  # a replayed round: nothing new stored
    rows = [m["steps"] for _, m in published.telemetry()]
    assert [[(r["step"], r["ranks"]) for r in x] for x in rows] == [[(7, 32)], [(7, 64)], [(7, 64)]]
    assert rows[0][0]["step_s"][2] == 0.9 and rows[1][0]["by"]["step_s"] == [5, 17]
    assert MetricStep.objects.get(attempt=attempt, step=7).ranks == 64


def test_the_named_ranks_follow_who_is_slow_recently(running):
    job, attempt = running
    published = Published()
    relay = Relay("redis://127.0.0.1:1/0", publish=published)
    for step in range(1, 6):
        relay_round(relay, attempt, wide(attempt, step, range(64), slow=17))
    for step in range(6, 15):
        relay_round(relay, attempt, wide(attempt, step, range(64), slow=40))
    last = published.telemetry()[-1][1]
    assert [x["rank"] for x in last["named"]["slowest"]] == [40, 17]
    assert {s["rank"] for s in last["samples"]} == {5, 17, 40}


def test_a_round_of_many_steps_is_split_and_big_rounds_keep_their_samples(running):
    job, attempt = running
    published = Published()
    relay = Relay("redis://127.0.0.1:1/0", publish=published)
    samples = [s for step in range(1, 451) for s in wide(attempt, step, range(4))]
    relay_round(relay, attempt, samples)
    msgs = [m for _, m in published.telemetry()]
    assert [len(m["steps"]) for m in msgs] == [200, 200, 50, 0, 0, 0]  # 1,800 samples: 500 with the steps, the rest alone
    assert sum(len(m["samples"]) for m in msgs) == 1800 and all(m["count"] for m in msgs)
    assert MetricSample.objects.filter(attempt=attempt).count() == 1800


def test_a_catch_up_round_publishes_only_an_attempts_newest_steps(running):
    """A relay draining a backlog commits thousands of one attempt's steps in a round: it publishes the
    newest LIVE_STEPS_PER_ROUND of them (every one is stored; the page's next snapshot reads them)."""
    from jobs.telemetry.publish import LIVE_STEPS_PER_ROUND

    job, attempt = running
    published = Published()
    relay = Relay("redis://127.0.0.1:1/0", publish=published)
    steps = LIVE_STEPS_PER_ROUND + 300
    relay_round(relay, attempt, [s for step in range(1, steps + 1) for s in wide(attempt, step, range(2))])
    sent = [r["step"] for _, m in published.telemetry() for r in m["steps"]]
    assert sent == list(range(301, steps + 1))
    assert MetricStep.objects.filter(attempt=attempt).count() == steps
