"""Server side of the dashboard pages (no processes, no browser): what the HTML carries before any
script runs: inline spec errors, job list throughput in one query, attempts with failures,
empty states, the job page's config for static/js/job.js."""
from __future__ import annotations

import json
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobs.core import dispatch
from jobs import services
from jobs.runs.forms import field_groups, split_errors
from jobs.models import Attempt, Job, MetricSample
from tests.nodes import node_up

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def no_sends(monkeypatch, settings):
    for name in ("send_launch", "send_stop", "request_tick", "publish", "publish_cluster_changed"):
        monkeypatch.setattr(dispatch, name, lambda *a, **k: None)
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice", password="pw-alice-123")


@pytest.fixture
def nodes(db):
    return [node_up({"name": n, "address": a, "slots": 2, "labels": {"rack": "r1"},
                                     "devices": [{"kind": "cpu", "index": 0}, {"kind": "cpu", "index": 1}],
                                     "cpu_percent": 12.0, "mem_percent": 34.0})[0]
            for n, a in (("node-a", "127.0.0.1"), ("node-b", "127.0.0.2"))]


@pytest.fixture
def client_alice(client, alice):
    client.force_login(alice)
    return client


def _running_job(user, name="j", steps=100) -> tuple[Job, Attempt]:
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": name, "train": {"steps": steps}}))
    services.schedule_tick()
    job.refresh_from_db()
    return job, job.attempts.get()


def _samples(attempt: Attempt, steps, sps=(100.0, 120.0)):
    services.telemetry_ingest([
        {"attempt": attempt.pk, "rank": r, "step": s, "ts": 1.0 + s, "loss": 3.0 - s / 100,
         "samples_per_s": sps[r], "tokens_per_s": sps[r] * 128, "step_s": 0.05} for s in steps for r in range(2)],
        events=[])
    assert MetricSample.objects.filter(attempt=attempt).count() == 2 * len(steps)


def test_job_list_shows_progress_queue_position_and_throughput_in_one_query(client_alice, alice, nodes):
    job, attempt = _running_job(alice, "busy")
    _samples(attempt, range(1, 4), sps=(100.0, 120.0))
    idle = services.job_submit(user=alice, spec=services.submitted_spec({"name": "waiting", "resources": {"nodes": 2, "procs_per_node": 2}}))
    with CaptureQueriesContext(connection) as q:
        r = client_alice.get("/jobs/")
    assert r.status_code == 200
    assert sum("jobs_metricstep" in x["sql"] for x in q.captured_queries) == 1, [x["sql"] for x in q.captured_queries]
    html = r.content.decode()
    row = re.search(rf'<tr data-job="{job.pk}">.*?</tr>', html, re.S).group(0)
    assert "220 samples/s" in row  # mean over ranks at the newest step (110) x 2 ranks
    assert "3 / 100" in row
    waiting = re.search(rf'<tr data-job="{idle.pk}">.*?</tr>', html, re.S).group(0)
    assert "#1" in waiting and "samples/s" not in waiting


def test_submit_page_puts_errors_next_to_their_fields(client_alice, nodes):
    r = client_alice.post("/jobs/new/", {"spec": json.dumps({"name": "x", "model": {"layers": 0, "hidden": 65,
                                                                                    "heads": 4}, "bogus": 1})})
    assert r.status_code == 400
    html = r.content.decode()
    layers = re.search(r'<div class="field invalid" data-field="model.layers">.*?</div>', html, re.S).group(0)
    assert 'aria-invalid="true"' in layers and "greater than or equal to 1" in layers and 'value="0"' in layers
    assert "<code>bogus</code>: unknown key" in html  # no field of its own: listed at the top
    assert Job.objects.count() == 0

    r = client_alice.post("/jobs/new/", {"spec": "name: x\nmodel: {hidden: 66, heads: 4}\n"})
    assert r.status_code == 400
    assert re.search(r'<ul class="errors group-errors"><li>hidden \(66\) must be divisible by heads \(4\)', r.content.decode())

    r = client_alice.post("/jobs/new/", {"spec": "name: [unclosed"})
    assert r.status_code == 400 and b"neither valid JSON nor YAML" in r.content


def test_field_groups_read_values_from_yaml_and_defaults_as_placeholders():
    groups = field_groups({"name": "y", "train": {"steps": 7}}, {"train.steps": ["too few"]})
    fields = {f["path"]: f for g in groups for f in g["fields"]}
    assert fields["train.steps"]["value"] == 7 and fields["train.steps"]["errors"] == ["too few"]
    assert fields["model.layers"]["value"] == "" and fields["model.layers"]["placeholder"] == 4
    inline, rest = split_errors({"model.layers": ["a"], "model": ["b"], "comm.period": ["c"]})
    assert inline == {"model.layers": ["a"], "model": ["b"]} and rest == [("comm.period", ["c"])]


def test_job_page_renders_status_attempts_failure_and_empty_checkpoints(client_alice, alice, nodes):
    job, attempt = _running_job(alice, "broken")
    Attempt.objects.filter(pk=attempt.pk).update(status=Attempt.Status.ENDED, outcome="failed:user_error", failure={
        "class": "user_error", "message": "ValueError: boom", "traceback": "Traceback ...\nValueError: boom",
        "rank": 1, "node": "node-b"})
    _samples(attempt, range(1, 3))
    r = client_alice.get(f"/jobs/{job.pk}/")
    assert r.status_code == 200
    html = r.content.decode()
    assert "failed:user_error" in html and "<details><summary><b>user_error</b> (rank 1 on node-b)" in html
    assert "Traceback ...\nValueError: boom" in html
    assert "No checkpoints yet." in html
    assert 'id="cancel-form"' in html  # owner, job not terminal
    config = json.loads(re.search(r'<script id="job-config" type="application/json">(.*?)</script>', html).group(1))
    assert config == {"id": job.pk, "status": job.status, "step": 2, "total_steps": 100, "world": 2,
                      "can_cancel": True, "is_staff": False, "has_telemetry": True}
    assert '<script type="module" src="/static/js/job.js">' in html


def test_cluster_pages_render_nodes_with_slots_and_the_queue(client_alice, alice, nodes):
    _running_job(alice, "running")
    services.job_submit(user=alice, spec=services.submitted_spec({"name": "queued", "resources": {"nodes": 2, "procs_per_node": 2}}))
    html = client_alice.get("/").content.decode()
    assert html.count('class="node"') == 2 and html.count('class="slot used"') == 2
    assert re.search(r'<tbody id="queue"><tr><td class="num">1</td>', html)
    assert "running" in html
    nodes_html = client_alice.get("/nodes/").content.decode()
    assert "2 × cpu" in nodes_html and "1 / 2" in nodes_html
