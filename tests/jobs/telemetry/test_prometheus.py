"""/metrics: Prometheus text format that a strict parser accepts, the figures it exports, and who
may scrape it (staff session or the bearer scrape token; 401/403 otherwise)."""
from __future__ import annotations

import json
import re
import time

import pytest
import redis
from django.test import Client

from jobs.telemetry import prometheus
from jobs import services
from jobs.telemetry.prometheus import Exposition
from trainyard.keys import RELAY_GROUP, RELAY_STATS_KEY, attempt_stream
from tests.conftest import free_port

pytestmark = pytest.mark.django_db

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
SAMPLE_RE = re.compile(rf"^({NAME})(?:\{{((?:{LABEL})(?:,{LABEL})*)?\}})? (\S+)$")
VALUE_RE = re.compile(r"^(?:[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)|NaN|[+-]Inf)$")


def parse(text: str) -> dict[str, dict]:
    """A strict reader of the text exposition format: returns name -> {type, help, samples:
    [(labels, value)]}; fails on any line that is not a sample, # HELP or # TYPE. A histogram's
    _bucket, _sum and _count samples are its family's, with their own name as label __name__."""
    assert text.endswith("\n")
    families: dict[str, dict] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert re.fullmatch(NAME, name) and help_text, line
            assert "help" not in families.setdefault(name, {}), f"second HELP for {name}"
            families[name]["help"] = help_text
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            fam = families.setdefault(name, {})
            assert "type" not in fam and "samples" not in fam, f"TYPE for {name} repeated or after its samples"
            fam["type"] = kind
        else:
            m = SAMPLE_RE.match(line)
            assert m, f"not a sample line: {line!r}"
            name, labels, value = m.groups()
            assert VALUE_RE.match(value), line
            family = name
            if name not in families:  # a histogram's series: <family>_bucket, _sum, _count
                base, _, suffix = name.rpartition("_")
                if suffix in ("bucket", "sum", "count") and families.get(base, {}).get("type") == "histogram":
                    family = base
            assert family in families and "type" in families[family], f"sample before its TYPE: {line!r}"
            pairs = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels or ""))
            if family != name:
                assert name.endswith("_bucket") == ("le" in pairs), f"le only on a histogram's buckets: {line!r}"
                pairs["__name__"] = name
            families[family].setdefault("samples", []).append((pairs, float(value)))
    return families


def value(families, name, **labels):
    hits = [v for lab, v in families[name].get("samples", []) if all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, families.get(name))
    return hits[0]


@pytest.fixture(autouse=True)
def dead_redis(settings, monkeypatch):
    """Point /metrics at a port where nothing listens (tests that need Redis override it)."""
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setattr(prometheus, "_redis", None)
    monkeypatch.delenv(prometheus.TOKEN_ENV, raising=False)


def sample(attempt, rank, step, loss, sps):
    return {"rank": rank, "step": step, "ts": time.time(), "loss": loss, "samples_per_s": sps, "attempt": attempt}


def test_access_needs_staff_or_the_scrape_token(user, staff, monkeypatch):
    c = Client()
    resp = c.get("/metrics")
    assert resp.status_code == 401 and resp["WWW-Authenticate"].startswith("Bearer")
    c.force_login(user)
    assert c.get("/metrics").status_code == 403
    c.force_login(staff)
    resp = c.get("/metrics")
    assert resp.status_code == 200 and resp["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert c.post("/metrics").status_code == 405

    anon = Client()
    assert anon.get("/metrics", HTTP_AUTHORIZATION="Bearer anything").status_code == 401  # no token configured
    monkeypatch.setenv(prometheus.TOKEN_ENV, "s3cret-scrape-token")
    assert anon.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-scrape-token").status_code == 200
    assert anon.get("/metrics", HTTP_AUTHORIZATION="bearer s3cret-scrape-token").status_code == 200
    for wrong in ("Bearer s3cret-scrape-toke", "Bearer s3cret-scrape-token2", "Bearer ", "Token s3cret-scrape-token"):
        assert anon.get("/metrics", HTTP_AUTHORIZATION=wrong).status_code == 401, wrong
    # A wrong bearer token is refused even for a staff session: the header says who is asking.
    c.force_login(staff)
    assert c.get("/metrics", HTTP_AUTHORIZATION="Bearer nope").status_code == 401


def test_exports_jobs_queue_nodes_and_running_job_progress(staff, user, nodes):
    running = services.job_submit(user=user, spec=services.submitted_spec({"name": "run", "train": {"steps": 300}}))
    services.schedule_tick()
    attempt = running.attempts.get()
    services.attempt_ranks(attempt.pk, node_name="node-a", ranks=[{"rank": 0, "local_rank": 0, "pid": 10}])
    services.attempt_ranks(attempt.pk, node_name="node-b", ranks=[{"rank": 1, "local_rank": 0, "pid": 11}])
    services.telemetry_ingest([sample(attempt.pk, 0, 1, 5.0, 100.0), sample(attempt.pk, 1, 1, 5.2, 110.0),
                               sample(attempt.pk, 0, 2, 4.0, 120.0), sample(attempt.pk, 1, 2, 4.4, 130.0)], events=[])
    services.job_submit(user=user, spec=services.submitted_spec({"name": 'queued "one" \\ two', "resources": {"nodes": 2, "procs_per_node": 2}}))
    services.schedule_tick()  # 4 slots wanted, 2 of 4 in use: it stays QUEUED
    c = Client()
    c.force_login(staff)
    fams = parse(c.get("/metrics").content.decode())

    assert value(fams, "trainyard_jobs", status="RUNNING") == 1
    assert value(fams, "trainyard_jobs", status="QUEUED") == 1
    assert value(fams, "trainyard_jobs", status="SUCCEEDED") == 0
    assert value(fams, "trainyard_queue_length") == 1 and value(fams, "trainyard_queue_slots") == 4
    job = {"job": running.pk}
    assert value(fams, "trainyard_job_step", **job) == 2
    assert value(fams, "trainyard_job_total_steps", **job) == 300
    assert value(fams, "trainyard_job_loss", **job) == pytest.approx(4.2)
    assert value(fams, "trainyard_job_samples_per_second", **job) == pytest.approx(250.0)
    labels = fams["trainyard_job_step"]["samples"][0][0]
    assert labels == {"job": str(running.pk), "name": "run", "owner": "alice", "status": "RUNNING"}
    assert value(fams, "trainyard_node_slots", node="node-a") == 2
    assert value(fams, "trainyard_node_slots_used", node="node-a") == 1
    assert value(fams, "trainyard_node_status", node="node-a", status="READY") == 1
    assert value(fams, "trainyard_node_status", node="node-a", status="LOST") == 0
    assert value(fams, "trainyard_node_cpu_percent", node="node-b") == 1.0
    assert value(fams, "trainyard_node_mem_percent", node="node-b") == 2.0
    assert 0 <= value(fams, "trainyard_node_heartbeat_age_seconds", node="node-b") < 60
    assert value(fams, "trainyard_redis_up") == 0  # nothing listens there: the page still renders


def test_label_values_and_numbers_are_escaped():
    exp = Exposition()
    exp.add("x_info", "gauge", "a help\\text\nwith newline", 1, name='a "b"\\c\nd')
    exp.add("x_nan", "gauge", "nan", float("nan"))
    exp.add("x_inf", "gauge", "inf", float("inf"))
    exp.add("x_none", "gauge", "no sample", None)
    text = exp.render()
    fams = parse(text)
    assert 'x_info{name="a \\"b\\"\\\\c\\nd"} 1' in text.splitlines()
    assert fams["x_info"]["samples"][0][0]["name"] == 'a \\"b\\"\\\\c\\nd'
    assert text.splitlines()[0] == "# HELP x_info a help\\\\text with newline"
    assert fams["x_inf"]["samples"][0][1] == float("inf")
    assert "samples" not in fams["x_none"] and fams["x_none"]["type"] == "gauge"


@pytest.mark.procs
def test_relay_counters_backlog_and_lag_from_redis(staff, redis_server, settings, monkeypatch):
    settings.REDIS_URL = redis_server.url
    monkeypatch.setattr(prometheus, "_redis", None)
    r = redis.Redis.from_url(redis_server.url)
    r.hset(RELAY_STATS_KEY, mapping={"samples_total": 1234, "entries_total": 56, "batches_total": 7,
                               "last_batch_unixtime": 1700000000.5, "last_batch_samples": 10,
                               "last_batch_seconds": 0.004, "publish_errors_total": 0})
    stream = attempt_stream(41, 3)
    r.xgroup_create(stream, RELAY_GROUP, id="0", mkstream=True)
    old_ms = int(time.time() * 1000) - 3000  # an entry written 3 s ago and never committed
    r.xadd(stream, {"type": "metrics", "data": json.dumps([])}, id=f"{old_ms}-0")
    r.xadd(stream, {"type": "metrics", "data": json.dumps([])})
    r.xreadgroup(RELAY_GROUP, "relay-1", {stream: ">"}, count=1)
    c = Client()
    c.force_login(staff)
    fams = parse(c.get("/metrics").content.decode())
    assert value(fams, "trainyard_redis_up") == 1
    assert fams["trainyard_relay_samples_total"]["type"] == "counter"
    assert value(fams, "trainyard_relay_samples_total") == 1234
    assert value(fams, "trainyard_relay_entries_total") == 56
    assert value(fams, "trainyard_relay_batches_total") == 7
    assert value(fams, "trainyard_relay_last_batch_timestamp_seconds") == 1700000000.5
    assert value(fams, "trainyard_relay_last_batch_duration_seconds") == 0.004
    assert value(fams, "trainyard_relay_streams") == 1
    assert value(fams, "trainyard_relay_backlog_entries") == 2
    assert value(fams, "trainyard_relay_pending_entries") == 1
    assert 2.5 < value(fams, "trainyard_relay_lag_seconds") < 30
    r.delete(stream)
    fams = parse(c.get("/metrics").content.decode())
    assert value(fams, "trainyard_relay_backlog_entries") == 0 and value(fams, "trainyard_relay_lag_seconds") == 0
