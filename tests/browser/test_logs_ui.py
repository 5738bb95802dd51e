"""Issue 12: kept logs paged on a finished job's page, a chart per user metric, and "telemetry
unavailable" for a job that never sent a sample.

Server side (no processes): what the first paint says. In the browser, on a real cluster: a finished
built-in job's kept logs paged and downloaded from the page; a job that failed before its first step
(a token file too short for one window: a traceback, no samples) says telemetry is unavailable; then
samples carrying user metrics go through its real job stream, the relay stores them, and the page
charts each metric live and again after a reload.
"""
from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
import redis

from jobs.core import dispatch
from jobs import services

from .conftest import screenshot
from .test_dashboard import TERMINAL, wait_js
from tests.nodes import node_up

FINISHED_MSG = "Telemetry unavailable: no attempt of this job sent metrics"


# ---------------------------------------------------------------- server side (no processes)

@pytest.fixture
def alice_client(client, django_user_model, monkeypatch, settings, db):
    for name in ("send_launch", "send_stop", "request_tick", "publish", "publish_cluster_changed"):
        monkeypatch.setattr(dispatch, name, lambda *a, **k: None)
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    for n, a in (("node-a", "127.0.0.1"), ("node-b", "127.0.0.2")):
        node_up({"name": n, "address": a, "slots": 2, "cpu_percent": 1.0, "mem_percent": 1.0})
    alice = django_user_model.objects.create_user("alice", password="pw-alice-123")
    client.force_login(alice)
    client.alice = alice
    return client


def _finished(user, *, samples: bool):
    from jobs.models import Job

    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "j"}))
    services.schedule_tick()
    attempt = job.attempts.get()
    if samples:
        services.telemetry_ingest([{"attempt": attempt.pk, "rank": 0, "step": 1, "ts": 1.0, "loss": 2.0}], events=[])
    Job.objects.filter(pk=job.pk).update(status=Job.Status.FAILED)
    return job


def _config(html: str) -> dict:
    return json.loads(re.search(r'<script id="job-config" type="application/json">(.*?)</script>', html).group(1))


def test_first_paint_says_telemetry_unavailable_only_without_samples(alice_client):
    silent = _finished(alice_client.alice, samples=False)
    html = alice_client.get(f"/jobs/{silent.pk}/").content.decode()
    note = re.search(r'<p class="note" id="telemetry-note"[^>]*>', html).group(0)
    assert "hidden" not in note and FINISHED_MSG in html
    assert re.search(r'<div class="charts" id="charts" hidden>', html)
    assert _config(html)["has_telemetry"] is False
    reported = _finished(alice_client.alice, samples=True)
    html = alice_client.get(f"/jobs/{reported.pk}/").content.decode()
    assert re.search(r'<p class="note" id="telemetry-note"[^>]*hidden>', html)
    assert '<div class="charts" id="charts">' in html and _config(html)["has_telemetry"] is True


# ---------------------------------------------------------------- in the browser, real cluster

def _page_ready(page, base, job_id):
    page.goto(f"{base}/jobs/{job_id}/")
    wait_js(page, "() => window.trainyard && window.trainyard.socket.stats.snapshots >= 1", 30, "the snapshot")


def _kept_state(page) -> dict:
    return page.evaluate("""() => {
        const root = document.querySelector('#kept-logs');
        return {hidden: root.hidden, offset: Number(root.dataset.offset), total: Number(root.dataset.total),
                range: root.querySelector('.kept-range').textContent,
                lines: [...root.querySelectorAll('.kept-pane .ln')].map((l) => l.textContent.replace(/\\n$/, '')),
                tabs: [...root.querySelectorAll('.kept-tabs button')].map((b) => b.dataset.rank),
                liveHidden: document.querySelector('#log-pane').hidden,
                loads: window.trainyard.kept.loads};
    }""")


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_finished_job_pages_its_kept_logs(page, base, cluster):
    job = cluster.submit({"name": "kept-logs", "model": {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 32},
                          "train": {"steps": 30, "global_batch": 8}})
    done = cluster.wait_status(job["id"], TERMINAL, 300)
    assert done["status"] == "SUCCEEDED", done
    api = cluster.get(f"/api/v1/jobs/{job['id']}/logs/?rank=1&limit=5000")
    assert api["attempt"] == done["attempts"][-1]["id"] and api["total"] >= 13  # steps 1, 3, ..., 30 and more
    assert any(line.startswith("rank 1 step 30/30") for line in api["lines"]), api["lines"][-5:]

    _page_ready(page, base, job["id"])
    wait_js(page, "() => window.trainyard.kept.loads >= 1", 30, "the kept logs")
    first = _kept_state(page)
    assert not first["hidden"] and first["liveHidden"] and first["tabs"] == ["0", "1"]
    assert any(x.startswith("rank 0 finished steps 30") for x in first["lines"][-3:]), first["lines"][-3:]

    # Page through rank 1 five lines at a time: first, next, last, and back.
    page.evaluate("() => { window.trainyard.kept.limit = 5; }")
    page.click("#kept-logs .kept-tabs button[data-rank='1']")
    wait_js(page, "() => window.trainyard.kept.page.rank === 1", 15, "rank 1")
    total = _kept_state(page)["total"]
    assert total == api["total"]
    page.click("#kept-logs [data-page=first]")
    wait_js(page, "() => window.trainyard.kept.page.offset === 0", 15, "the first page")
    state = _kept_state(page)
    assert state["lines"] == api["lines"][:5] and state["range"] == f"lines 1–5 of {total}"
    page.click("#kept-logs [data-page=next]")
    wait_js(page, "() => window.trainyard.kept.page.offset === 5", 15, "the second page")
    assert _kept_state(page)["lines"] == api["lines"][5:10]
    assert page.is_disabled("#kept-logs [data-page=last]") is False
    page.click("#kept-logs [data-page=last]")
    wait_js(page, f"() => window.trainyard.kept.page.offset === {total - 5}", 15, "the last page")
    assert _kept_state(page)["lines"] == api["lines"][-5:]
    assert page.is_disabled("#kept-logs [data-page=next]")
    screenshot(page, "screenshot-kept-logs.png")

    href = page.get_attribute("#kept-logs .kept-download", "href")
    assert "download=1" in href and "rank=1" in href
    cookies = {c["name"]: c["value"] for c in page.context.cookies()}
    req = urllib.request.Request(base + href, headers={"Cookie": f"sessionid={cookies['sessionid']}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Disposition"].startswith("attachment")
        assert resp.read().decode().splitlines() == api["lines"]
    assert not page.js_errors, page.js_errors


def _tiny_token_file(cluster) -> str:
    """Two uint16 tokens: the submit check passes (an even-sized file under the data root), the
    runtime cannot fill one window and fails before its first step."""
    (cluster.dir / "data" / "tiny.bin").write_bytes(b"\x01\x00\x02\x00")
    return "tiny.bin"


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_no_telemetry_message_then_user_metric_charts(page, base, cluster):
    job = cluster.submit({"name": "no-telemetry", "data": {"kind": "tokens", "path": _tiny_token_file(cluster)},
                          "max_restarts": 0, "model": {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 32},
                          "train": {"steps": 10, "global_batch": 8}})
    done = cluster.wait_status(job["id"], TERMINAL, 300)
    assert done["status"] == "FAILED" and done["has_telemetry"] is False, done
    assert cluster.get(f"/api/v1/jobs/{job['id']}/metrics/?per_rank=1") == []
    logs = cluster.get(f"/api/v1/jobs/{job['id']}/logs/?limit=5000")
    assert any("cannot fill one window" in line for line in logs["lines"]), logs["lines"][-10:]

    _page_ready(page, base, job["id"])
    note = page.locator("#telemetry-note")
    assert note.is_visible() and FINISHED_MSG in note.text_content()
    assert page.locator("#charts").is_hidden()
    wait_js(page, "() => window.trainyard.kept.loads >= 1", 30, "the kept logs")
    assert any("cannot fill one window" in x for x in _kept_state(page)["lines"])
    screenshot(page, "screenshot-no-telemetry.png")

    # Samples with user metrics through the job's real stream, as the SDK's run.log(step, acc=..., **{"val/loss": ...})
    # sends them; the relay stores and fans them out: the page charts each metric live.
    attempt = done["attempts"][-1]["id"]
    r = redis.Redis.from_url(cluster.redis.url)
    for step in range(1, 11):
        r.xadd(f"trainyard:job:{job['id']}:a{attempt}", {"type": "metrics", "data": json.dumps([
            {"attempt": attempt, "rank": rank, "step": step, "ts": time.time(), "loss": 3.0 - step / 10,
             "metrics": {"acc": step / 10 + rank / 100, "val/loss": 2.0 - step / 20, "bad name": 1.0}}
            for rank in (0, 1)])})
    wait_js(page, "() => document.querySelectorAll('#charts .user-metric').length === 2", 30, "two user metric charts")
    wait_js(page, "() => document.querySelector('#charts [data-metric=\"acc\"]').dataset.points === '20'", 30,
            "20 points of acc")
    assert note.is_hidden() and page.locator("#charts").is_visible()
    names = page.evaluate("() => [...document.querySelectorAll('#charts .user-metric')].map((c) => c.dataset.metric)")
    assert names == ["acc", "val/loss"]
    assert page.locator("#charts [data-metric='acc'] h2").text_content().startswith("acc")
    assert not page.js_errors, page.js_errors

    # Stored, not only relayed: the API and a reload show the same.
    rows = cluster.get(f"/api/v1/jobs/{job['id']}/metrics/?per_rank=1")
    assert len(rows) == 20 and rows[-1]["metrics"] == {"acc": 1.01, "val/loss": 1.5}
    assert cluster.get(f"/api/v1/jobs/{job['id']}/")["has_telemetry"] is True
    _page_ready(page, base, job["id"])
    wait_js(page, "() => document.querySelector('#charts [data-metric=\"val/loss\"]')?.dataset.points === '20'", 30,
            "val/loss after a reload")
    assert page.locator("#telemetry-note").is_hidden()
    screenshot(page, "screenshot-user-metrics.png")
    assert not page.js_errors, page.js_errors


# ---------------------------------------------------------------- the examples, end to end

def _upload(cluster, name: str) -> str:
    from tests.integration.test_user_code import EXAMPLES, upload
    from tests.test_entrypoint import pack_dir

    status, body = upload(cluster, pack_dir(EXAMPLES / name))
    assert status in (200, 201), body
    return body["bundle"]


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_sdk_example_charts_its_own_metric_and_plain_example_says_no_telemetry(page, base, cluster):
    sdk = cluster.submit({"name": "sdk-page", "code": {"bundle": _upload(cluster, "sdk_ddp")},
                          "entrypoint": {"script": "train.py"}, "train": {"steps": 12},
                          "config": {"hidden": 32, "batch": 16, "step_sleep_s": 0.02},
                          "resources": {"nodes": 2, "procs_per_node": 1}, "checkpoint": {"every_steps": 6}})
    plain = cluster.submit({"name": "plain-page", "code": {"bundle": _upload(cluster, "plain")},
                            "entrypoint": {"script": "train.py", "args": ["--steps", "12"]},
                            "resources": {"nodes": 2, "procs_per_node": 1}})
    done = {j["id"]: cluster.wait_status(j["id"], TERMINAL, 300) for j in (sdk, plain)}
    assert done[sdk["id"]]["status"] == "SUCCEEDED" and done[sdk["id"]]["has_telemetry"] is True, done[sdk["id"]]
    assert done[plain["id"]]["status"] == "SUCCEEDED" and done[plain["id"]]["has_telemetry"] is False, done[plain["id"]]

    # The SDK script's run.log(step, loss=..., samples=..., lr=...): lr is its own metric, charted per rank.
    _page_ready(page, base, sdk["id"])
    wait_js(page, "() => document.querySelector('#charts [data-metric=\"lr\"]')?.dataset.points === '24'", 30,
            "the lr chart with 12 steps of 2 ranks")
    assert int(page.get_attribute("#chart-loss", "data-points")) == 24
    assert page.locator("#telemetry-note").is_hidden()
    screenshot(page, "screenshot-sdk-metrics.png")

    # The plain script: no charts, the notice, and its own output paged from the kept files.
    _page_ready(page, base, plain["id"])
    assert page.locator("#telemetry-note").is_visible() and page.locator("#charts").is_hidden()
    wait_js(page, "() => window.trainyard.kept.loads >= 1", 30, "the kept logs")
    lines = _kept_state(page)["lines"]
    assert "plain: rank 0/2 on cpu, 12 steps" in lines and "plain: rank 0 done" in lines, lines
    assert not page.js_errors, page.js_errors
