"""User metrics (`sample["metrics"]`, from the SDK's run.log(step, **metrics)): validated and stored in
MetricSample.extra, served by the metrics API and the socket windows; `has_telemetry` on the job."""
from __future__ import annotations

import math

import pytest

from jobs.runs import payloads as runs_payloads
from jobs.telemetry import payloads as telemetry_payloads
from jobs import services
from jobs.models import MetricSample
from jobs.telemetry.ingest import MAX_USER_METRICS, user_metrics

pytestmark = pytest.mark.django_db


def sample(attempt, rank, step, **extra):
    return {"attempt": attempt, "rank": rank, "step": step, "ts": 1764471234.0 + step, "loss": 2.0, **extra}


@pytest.fixture
def running(user, nodes):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "x"}))
    services.schedule_tick()
    return job, job.attempts.get()


@pytest.mark.parametrize("raw, kept, dropped", [
    (None, None, 0),
    ({}, None, 0),
    ({"acc": 0.5, "val/loss": 1, "lr_0": 3e-4, "a.b-c": -2.5}, {"acc": 0.5, "val/loss": 1.0, "lr_0": 3e-4, "a.b-c": -2.5}, 0),
    ({"acc": True}, None, 1),                              # a bool is not a metric
    ({"acc": "0.5", "ok": 1.0}, {"ok": 1.0}, 1),           # strings are not numbers
    ({"acc": None, "inf": math.inf, "nan": math.nan}, None, 3),
    ({"big": 10**400}, None, 1),                           # an int beyond float range
    ({"9lives": 1.0, "has space": 1.0, "é": 1.0, "": 1.0, "x" * 65: 1.0, "x" * 64: 1.0}, {"x" * 64: 1.0}, 5),
    ([1.0, 2.0], None, 1),                                 # not an object
])
def test_user_metric_validation(raw, kept, dropped):
    assert user_metrics(raw) == (kept, dropped)


def test_at_most_32_per_sample_the_rest_dropped():
    raw = {f"m{i:02d}": float(i) for i in range(40)}
    kept, dropped = user_metrics(raw)
    assert len(kept) == MAX_USER_METRICS == 32 and dropped == 8 and list(kept) == [f"m{i:02d}" for i in range(32)]


def test_ingest_stores_them_and_never_fails_the_batch(running, caplog, client_for, user):
    job, attempt = running
    batch = [sample(attempt.pk, 0, 1, metrics={"acc": 0.25, "bad name": 1.0}),
             sample(attempt.pk, 1, 1, metrics={"acc": 0.5, "grad/norm": 3}),
             sample(attempt.pk, 0, 2),  # a sample without user metrics
             sample(attempt.pk, 1, 2, metrics="not an object"),
             sample(attempt.pk, 0, 3, metrics={f"m{i}": 1.0 for i in range(40)})]
    services.telemetry_ingest(batch, events=[])
    rows = {(m.rank, m.step): m.extra for m in MetricSample.objects.filter(job=job)}
    assert rows[(0, 1)] == {"acc": 0.25} and rows[(1, 1)] == {"acc": 0.5, "grad/norm": 3.0}
    assert rows[(0, 2)] is None and rows[(1, 2)] is None and len(rows[(0, 3)]) == 32
    assert "dropped 10 user metric values" in caplog.text
    # cleaned in place: the relay fans out exactly what was stored
    assert batch[0]["metrics"] == {"acc": 0.25} and batch[3]["metrics"] is None
    api = client_for(user).get(f"/api/v1/jobs/{job.pk}/metrics/?per_rank=1").json()
    assert [(r["rank"], r["step"], r["metrics"]) for r in api[:4]] == [
        (0, 1, {"acc": 0.25}), (1, 1, {"acc": 0.5, "grad/norm": 3.0}), (0, 2, None), (1, 2, None)]
    # per step (the default): the user metrics of the lowest rank that logged any
    steps = client_for(user).get(f"/api/v1/jobs/{job.pk}/metrics/").json()
    assert [(r["step"], r["metrics"], r["metrics_rank"]) for r in steps[:2]] == [(1, {"acc": 0.25}, 0), (2, None, None)]
    window, _ = telemetry_payloads.metric_window(job.pk)
    assert window[1]["metrics"] == {"acc": 0.5, "grad/norm": 3.0} and "extra" not in window[1]


def test_has_telemetry_is_decided_from_the_samples(running, user, client_for):
    job, attempt = running
    silent = services.job_submit(user=user, spec=services.submitted_spec({"name": "silent"}))
    c = client_for(user)
    assert c.get(f"/api/v1/jobs/{job.pk}/").json()["has_telemetry"] is False
    services.telemetry_ingest([sample(attempt.pk, 0, 1)], events=[])
    assert c.get(f"/api/v1/jobs/{job.pk}/").json()["has_telemetry"] is True
    listed = {j["id"]: j["has_telemetry"] for j in c.get("/api/v1/jobs/").json()["results"]}
    assert listed == {job.pk: True, silent.pk: False}
    snapshot = runs_payloads.job_snapshot(silent.pk)
    assert snapshot["job"]["has_telemetry"] is False
