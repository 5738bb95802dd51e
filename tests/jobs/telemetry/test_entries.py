"""The relay's decisions without a relay: the entry schema, stream names, which entries of a round
are applied or dead-lettered (Relay.sort/apply against the database, no Redis), and the on-disk
checks before a checkpoint counts (checkpoint_verify, resume_checkpoint)."""
import json
import re

import pytest
from django.db import OperationalError

from jobs.telemetry import ingest
from jobs.telemetry import entries
from jobs import services
from jobs.models import Checkpoint, JobEvent, MetricSample
from jobs.telemetry.relay import POISON_TRIES, Relay
from trainyard.keys import attempt_stream

from tests.jobs.attempts.test_fault import signed, write_ckpt
from tests.jobs.runs.test_services import start, submit

GOOD = {"rank": 0, "step": 1, "ts": 1.0, "loss": 0.5, "attempt": 3, "averaged": True, "metrics": {"acc": 1}}


MODEL = {"kind": "user", "layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64, "params": 30080,
         "params_per_block": 12704, "blocks": "h"}


AUTO = {"chosen": {"dp": 2, "tp": 1, "pp": 1, "micro_batch": 4, "fsdp": False, "shard_optimizer": True,
                   "recompute": "none", "step_time_s": 0.0115, "memory_gb_per_device": 0.0007,
                   "tflops_per_device": 0.01, "explain": "dp 2 with ZeRO-1"},
        "runners_up": [{"label": "dp 2", "step_time_s": 0.0116, "why": "slower by 0.4%"},
                       {"label": "dp 1 · tp 2", "step_time_s": None, "why": "does not fit"}],
        "candidates": 4, "searched": 5, "constants_source": "default", "flops_per_step": 1.5e9}


def fields(kind, data):
    return {b"type": kind.encode(), b"data": data if isinstance(data, bytes) else json.dumps(data).encode()}


@pytest.mark.parametrize("kind, data", [
    ("metrics", [GOOD, {**GOOD, "step": 2, "loss": None}]),
    ("event", {"kind": "checkpoint", "attempt": 3, "rank": 0, "step": 5, "path": "/c/job-1/step-5", "save_s": 1}),
    ("event", {"kind": "rank_started", "attempt": 3, "rank": None, "pid": 7}),  # kinds the relay ignores pass
    ("log", {"attempt": 3, "rank": 1, "stream": "stderr", "lines": ["a", "b"], "node": "node-a"}),
    ("log", {"rank": 0, "lines": []}),
    ("event", {"kind": "rank_plan", "attempt": 3, "rank": 0, "strategy": "fsdp", "model": MODEL}),
    ("event", {"kind": "rank_plan", "attempt": 3, "rank": 0, "strategy": "tp", "auto": AUTO}),
])
def test_what_the_writers_send_passes_the_schema(kind, data):
    assert entries.parse_entry(fields(kind, data)) == (kind, data)


@pytest.mark.parametrize("kind, data, reason", [
    ("log", {"attempt": 3, "rank": 0, "lines": 5}, "log entry: lines: Input should be a valid list"),
    ("log", {"attempt": 3, "rank": 0, "lines": [1]}, "lines.0: Input should be a valid string"),
    ("log", {"attempt": 3, "rank": 0, "lines": ["x"], "stream": "stdin"}, "stream: Input should be 'stdout'"),
    ("gossip", {}, "unknown entry type 'gossip'"),
    ("metrics", b"{not json", "data is not JSON"),
    ("metrics", {"a": 1}, "metrics entry: (root): Input should be a valid list"),
    ("metrics", [{**GOOD, "rank": True}], "0.rank: Input should be a valid integer"),
    ("metrics", [{**GOOD, "loss": "0.5"}], "0.loss: Input should be a valid number"),
    ("metrics", [{k: v for k, v in GOOD.items() if k != "attempt"}], "0.attempt: Field required"),
    ("metrics", [{**GOOD, "step": -1}], "0.step: Input should be greater than or equal to 0"),
    ("metrics", [{**GOOD, "step": 2**70}], "0.step: Input should be a valid integer"),  # orjson: a float
    ("metrics", [{**GOOD, "attempt": 2**63}], "0.attempt: Input should be less than"),
    ("metrics", [GOOD] * (entries.MAX_SAMPLES + 1), "at most 5000 items"),
    ("event", {"kind": "checkpoint", "attempt": 3, "step": "5", "path": "/x"}, "step: Input should be a valid integer"),
    ("event", {"kind": "checkpoint", "attempt": 3, "step": 5}, "path: Field required"),
    ("event", {"kind": "resumed", "attempt": "3", "step": 5}, "attempt: Input should be a valid integer"),
    ("event", {"kind": "telemetry_dropped", "attempt": 3, "count": 1.5}, "count: Input should be a valid integer"),
    ("event", {"kind": "", "attempt": 3}, "kind: String should have at least 1 character"),
    ("event", [], "(root): Input should be a valid dictionary"),
    # run.prepare's description of a user model goes into the knowledge base: bounded, no extras
    ("event", {"kind": "rank_plan", "attempt": 3, "rank": 0, "model": {**MODEL, "layers": 0}},
     "model.layers: Input should be greater than or equal to 1"),
    ("event", {"kind": "rank_plan", "attempt": 3, "rank": 0, "model": {**MODEL, "params": 10**14}},
     "model.params: Input should be less than or equal to"),
    ("event", {"kind": "rank_plan", "attempt": 3, "rank": 0, "model": {**MODEL, "kind": "gpt"}},
     "model.kind: Input should be 'user'"),
    ("event", {"kind": "rank_plan", "attempt": 3, "rank": 0, "model": {**MODEL, "note": "x" * 10**5}},
     "model.note: Extra inputs are not permitted"),
    # parallel auto's choice becomes the job's plan.auto: bounded too
    ("event", {"kind": "rank_plan", "attempt": 3, "rank": 0, "auto": {**AUTO, "runners_up": AUTO["runners_up"] * 11}},
     "auto.runners_up: List should have at most 10 items"),
    ("event", {"kind": "rank_plan", "attempt": 3, "rank": 0, "auto": {**AUTO, "chosen": {**AUTO["chosen"], "x": 1}}},
     "auto.chosen.x: Extra inputs are not permitted"),
    ("event", {"kind": "rank_plan", "attempt": 3, "rank": 0,
               "auto": {**AUTO, "chosen": {**AUTO["chosen"], "explain": "x" * 5000}}},
     "auto.chosen.explain: String should have at most 2000 characters"),
])
def test_malformed_entries_are_refused_with_the_reason(kind, data, reason):
    with pytest.raises(entries.EntryError) as err:
        entries.parse_entry(fields(kind, data))
    assert reason in str(err.value)


def test_an_entry_without_data_or_over_the_size_limit_is_refused():
    with pytest.raises(entries.EntryError, match="no data field"):
        entries.parse_entry({b"type": b"log"})
    with pytest.raises(entries.EntryError, match="over the 4194304 byte limit"):
        entries.parse_entry({b"type": b"log", b"data": b" " * (entries.MAX_ENTRY_BYTES + 1)})


@pytest.mark.parametrize("name, ids", [
    ("trainyard:job:7:a3", (7, 3)), ("trainyard:job:123456:a9", (123456, 9)), ("trainyard:job:7", None),
    ("trainyard:job:07:a1", None), ("trainyard:job:0:a1", None), ("trainyard:job:7:a0", None),
    ("trainyard:job:x:a1", None), ("trainyard:job:7:8", None), ("trainyard:job:", None), ("trainyard:job:-1:a1", None),
    ("trainyard:job:7:a1 ", None), ("trainyard:job:" + "9" * 30 + ":a1", None),
])
def test_only_names_attempt_stream_makes_are_streams(name, ids):
    assert entries.stream_ids(name) == ids
    if ids:
        assert attempt_stream(*ids) == name


def test_dead_letters_are_capped_and_keep_a_bounded_copy():
    class Pipe:
        def __init__(self):
            self.calls = []

        def xadd(self, *args, **kw):
            self.calls.append((args, kw))

    pipe = Pipe()
    entries.dead_letter(pipe, "trainyard:job:1", b"1-0", {b"type": b"log", b"data": b"x" * 10_000}, "r" * 9999)
    (stream, row), kw = pipe.calls[0]
    assert kw == {"maxlen": entries.DEADLETTER_MAXLEN, "approximate": True}
    assert len(row["data"]) == entries.DEADLETTER_DATA_MAX and row["data_bytes"] == 10_000
    assert len(row["reason"]) == entries.REASON_MAX and row["id"] == "1-0"


# ---------------------------------------------------------------- a round's decisions (database, no Redis)

def offline_relay():
    return Relay("redis://127.0.0.1:1/0")  # never connects: sort and apply use the database only


def entry(stream, n, kind, data):
    return (f"{n}-0".encode(), fields(kind, data))


@pytest.mark.django_db
def test_a_round_applies_its_own_jobs_entries_and_dead_letters_foreign_or_unverified_ones(
        user, nodes, ckpt_root, relay_alive):
    a, b = submit(user), submit(user)
    att_a, att_b = start(a), start(b)
    real = write_ckpt(ckpt_root, a, att_a, 10)
    forged = ckpt_root / f"job-{a.pk}" / f"step-00000020-a{att_a.pk}"
    read = [(attempt_stream(a.pk, att_a.pk), [
        entry(0, 1, "metrics", [{**GOOD, "attempt": att_a.pk}]),
        entry(0, 2, "metrics", [{**GOOD, "attempt": att_b.pk, "step": 99}]),
        entry(0, 3, "event", {"kind": "checkpoint", "attempt": att_a.pk, "step": 10, "path": str(real)}),
        entry(0, 4, "event", {"kind": "checkpoint", "attempt": att_a.pk, "step": 20, "path": str(forged)}),
        entry(0, 5, "log", {"attempt": att_b.pk, "rank": 0, "lines": ["forged"]}),
        entry(0, 6, "log", {"rank": 0, "lines": ["no attempt: live list only"]}),
    ]), (attempt_stream(a.pk, att_b.pk), [entry(0, 8, "metrics", [{**GOOD, "attempt": att_b.pk}])]),
        ("trainyard:job:999999:a1", [entry(0, 7, "metrics", [{**GOOD, "attempt": att_a.pk}])])]
    relay = offline_relay()
    ok, dead = relay.sort(read)
    assert [p.entry_id for p in ok] == [b"1-0", b"3-0", b"6-0"]
    own = f"arrived on attempt {att_a.pk}'s stream"
    assert [(d[1], d[3]) for d in dead] == [
        (b"2-0", f"it names attempt {att_b.pk} but {own}"),
        (b"4-0", f"{forged} has no manifest trainyard.json: not a complete checkpoint"),
        (b"5-0", f"it names attempt {att_b.pk} but {own}"),
        (b"8-0", f"attempt {att_b.pk} is not an attempt of job {a.pk}")]
    assert relay._stats_delta["orphaned_total"] == 1  # job 999999 does not exist: dropped, not dead-lettered
    assert relay.apply(ok, dead) == ok
    assert list(Checkpoint.objects.values_list("step", flat=True)) == [10]
    assert MetricSample.objects.filter(job=a).count() == 1 and not MetricSample.objects.filter(job=b).exists()


@pytest.mark.django_db
def test_an_entry_that_raises_when_applied_is_dead_lettered_after_n_tries_and_the_rest_applied(
        user, nodes, monkeypatch):
    job = submit(user)
    attempt = start(job)
    read = [(attempt_stream(job.pk, attempt.pk), [
        entry(0, 1, "metrics", [{**GOOD, "attempt": attempt.pk}]),
        entry(0, 2, "event", {"kind": "telemetry_dropped", "attempt": attempt.pk, "count": 13}),
        entry(0, 3, "event", {"kind": "telemetry_dropped", "attempt": attempt.pk, "count": 1})])]
    real, calls = ingest.telemetry_ingest, []

    def failing(samples, *, events, **kw):
        calls.append(len(samples) + len(events))
        if any(e.get("count") == 13 for e in events):
            raise ValueError("a bug this entry trips")
        return real(samples, events=events, **kw)

    monkeypatch.setattr(ingest, "telemetry_ingest", failing)
    relay = offline_relay()
    ok, dead = relay.sort(read)
    applied = relay.apply(ok, dead)
    assert [p.entry_id for p in applied] == [b"1-0", b"3-0"]
    assert [(d[1], d[3]) for d in dead] == [(b"2-0", "applying it raised ValueError: a bug this entry trips")]
    assert calls == [3, 1] + [1] * POISON_TRIES + [1]  # the round, then each entry alone
    assert MetricSample.objects.filter(job=job).count() == 1
    assert list(JobEvent.objects.filter(kind="telemetry_dropped").values_list("data__count", flat=True)) == [1]


@pytest.mark.django_db
def test_a_round_that_keeps_failing_is_dead_lettered_not_read_forever(user, nodes):
    job = submit(user)
    attempt = start(job)
    read = [(attempt_stream(job.pk, attempt.pk), [entry(0, 1, "metrics", [{**GOOD, "attempt": attempt.pk}])])]
    relay = offline_relay()
    relay.streams = {attempt_stream(job.pk, attempt.pk): ">"}
    for _ in range(POISON_TRIES):
        relay._round = [(attempt_stream(job.pk, attempt.pk), b"1-0")]
        relay.round_failed(RuntimeError("fan-out bug"))
        assert relay.streams == {attempt_stream(job.pk, attempt.pk): "0"}  # read again from its own pending entries
    ok, dead = relay.sort(read)
    assert ok == [] and dead[0][3] == "processing it failed 3 times, last: RuntimeError: fan-out bug"


@pytest.mark.django_db
def test_database_errors_are_retried_with_backoff_and_the_round_committed_once(user, nodes, monkeypatch):
    job = submit(user)
    attempt = start(job)
    read = [(attempt_stream(job.pk, attempt.pk), [entry(0, 1, "event", {"kind": "telemetry_dropped", "attempt": attempt.pk,
                                                        "count": 2})])]
    real, fails = ingest.telemetry_ingest, [2]

    def locked_twice(samples, *, events, **kw):
        if fails[0]:
            fails[0] -= 1
            raise OperationalError("database is locked")
        return real(samples, events=events, **kw)

    monkeypatch.setattr(ingest, "telemetry_ingest", locked_twice)
    relay = offline_relay()
    ok, dead = relay.sort(read)
    assert relay.apply(ok, dead) == ok and dead == []
    assert relay._stats_delta["db_retries_total"] == 2
    assert JobEvent.objects.filter(kind="telemetry_dropped").count() == 1


# ---------------------------------------------------------------- checkpoints on disk

@pytest.mark.django_db
def test_checkpoint_verify_accepts_only_a_complete_checkpoint_of_this_job_attempt_and_step(user, nodes, ckpt_root):
    job = submit(user)
    attempt = start(job)
    d = write_ckpt(ckpt_root, job, attempt, 10)
    assert services.checkpoint_verify(job.pk, attempt.pk, 10, str(d)) == (d, "")
    assert "is not step-00000020" in services.checkpoint_verify(job.pk, attempt.pk, 20, str(d))[1]
    assert "is not step-00000010-a" in services.checkpoint_verify(job.pk, attempt.pk + 1, 10, str(d))[1]
    assert "without '..'" in services.checkpoint_verify(job.pk, attempt.pk, 10, str(d / ".." / d.name))[1]
    assert "not an absolute path" in services.checkpoint_verify(job.pk, attempt.pk, 10, "job-1/step")[1]
    assert "malformed" in services.checkpoint_verify(job.pk, attempt.pk, True, str(d))[1]
    manifest = d / "trainyard.json"
    meta = json.loads(manifest.read_text())
    for change, why in (({"step": 11}, "says step 11, the report 10"), ({"job_id": job.pk + 1}, "says job_id"),
                        ({"format": 2}, "is not a format 1 manifest"),
                        ({"files": {"__0_0.distcp": 100, "rank-0.pt": 5}}, "listed file rank-0.pt is missing"),
                        ({"files": {"__0_0.distcp": 99}}, "has 100 bytes, the manifest says 99"),
                        ({"files": {"../x": 1}}, "unsafe file name")):
        manifest.write_text(json.dumps(signed({**meta, **change}, attempt)))
        assert why in services.checkpoint_verify(job.pk, attempt.pk, 10, str(d))[1], change
    manifest.write_text(json.dumps(signed({**meta, "files": {"__0_0.distcp": 100}}, attempt)))
    assert services.checkpoint_verify(job.pk, attempt.pk, 10, str(d))[1] == ""
    # Issue 21 s3: a manifest without the attempt's proof, or with another attempt's, never counts.
    other = start(submit(user))
    for bad in ({k: v for k, v in meta.items() if k != "proof"}, {**signed(meta, other)},
                {**meta, "proof": "0" * 64}, {**meta, "size_bytes": 1}):
        manifest.write_text(json.dumps(bad))
        assert "carries no valid proof of attempt" in services.checkpoint_verify(job.pk, attempt.pk, 10, str(d))[1]
    manifest.write_text(json.dumps(signed(meta, attempt)))
    manifest.write_text("{")
    assert "unreadable manifest" in services.checkpoint_verify(job.pk, attempt.pk, 10, str(d))[1]


@pytest.mark.django_db
def test_the_control_plane_never_resumes_from_outside_the_jobs_checkpoint_directory(user, nodes, ckpt_root):
    job = submit(user, max_restarts=2)
    attempt = start(job)
    good = write_ckpt(ckpt_root, job, attempt, 10)
    services.checkpoint_register(attempt.pk, data={"step": 10, "path": str(good)})
    outside = write_ckpt(ckpt_root / "elsewhere", job, attempt, 20)  # complete, but not in job-<id>/ of the root
    bad = Checkpoint.objects.create(job=job, attempt=attempt, step=20, path=str(outside))
    from jobs.attempts.services.checkpoints import resume_checkpoint

    point = resume_checkpoint(job)
    assert point is not None and point.step == 10
    bad.refresh_from_db()
    assert bad.deleted_at is not None  # written off, never handed to a launch


@pytest.mark.django_db
def test_a_rebalanced_event_is_checked_and_goes_on_the_jobs_timeline(user, nodes):
    """train.balance auto's new split (trainyard/sdk/balance.py, rank 0): a typed event, then a job event."""
    job = submit(user)
    attempt = start(job)
    good = {"kind": "rebalanced", "attempt": attempt.pk, "rank": 0, "step": 6, "counts": [12, 4],
            "previous": [8, 8], "shares": [0.75, 0.25], "speeds": [1500.0, 510.5]}
    kind, data = entries.parse_entry({b"type": b"event", b"data": json.dumps(good).encode()})
    assert kind == "event" and data == good
    for bad, why in (({**good, "shares": [1.5, 0.25]}, "shares.0: Input should be less than or equal to 1"),
                     ({**good, "counts": ["12", 4]}, "counts.0: Input should be a valid integer"),
                     ({**good, "counts": [1] * 5000}, "counts: List should have at most 4096 items")):
        with pytest.raises(entries.EntryError, match=re.escape(why)):
            entries.parse_entry({b"type": b"event", b"data": json.dumps(bad).encode()})
    services.telemetry_ingest([], events=[good])
    event = JobEvent.objects.get(job=job, kind="rebalanced")
    assert event.message == "batch split by measured speed from step 7: rank 0 12, rank 1 4 samples (was 8/8)"
    assert event.data["counts"] == [12, 4] and event.data["speeds"] == [1500.0, 510.5]
