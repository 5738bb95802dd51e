"""The fault-tolerance dashboard (issue 4): the checkpoints table with staff Roll back / Pin, the
timeline with coloured kinds and evidence, failure suggestions, the straggler banner, rollback/restart
markers on the charts, and quarantined node cards with Clear.

Three layers:
- server side (no processes): what the HTML carries for staff and for everyone else;
- the page fed crafted websocket messages and mocked API answers (page.route): every rendering rule
  and error path, deterministic;
- the real flow on a real cluster: submit, wait for checkpoints, roll back from the page as admin,
  watch the new attempt finish; a non-staff user sees no buttons and the API refuses them; clear a
  quarantined node from its card.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from tests.conftest import REPO

from .conftest import login, screenshot
from .test_dashboard import SMALL_MODEL, TERMINAL, assert_no_duplicates_or_gaps, chart_stats, wait_js
from tests.nodes import node_up

MODEL = {k.split(".")[1]: v for k, v in SMALL_MODEL.items()}
BOB_PASSWORD = "bob-pw-12345"
CHARTS = ("loss", "throughput", "breakdown", "ranks")


# ---------------------------------------------------------------- helpers

def manage(cluster, *args: str) -> str:
    """Run manage.py against the cluster's database (same env as its processes)."""
    out = subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, env=cluster.env, check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def api(cluster, method: str, path: str, body=None, token: str | None = None):
    return cluster.request(method, path, body, token)


def iso(seconds: float) -> str:
    return (datetime(2025, 1, 1, 10, 0, tzinfo=timezone.utc) + timedelta(seconds=seconds)).isoformat()


def row_states(page) -> dict[int, str]:
    return {int(k): v for k, v in page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
        '#checkpoints-body tr[data-checkpoint]')].map(r => [r.dataset.checkpoint, r.dataset.state]))""").items()}


def finished_job(cluster, name: str = "fault-ui-base") -> dict:
    job = cluster.submit({"name": name, "model": {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 32},
                          "train": {"steps": 12, "global_batch": 8}})
    return cluster.wait_status(job["id"], TERMINAL, 180)


def stop_socket(page) -> None:
    """Crafted messages only from here on: a live push would overwrite them at a random moment."""
    page.evaluate("() => window.trainyard.socket.stop()")


def feed(page, msg: dict) -> None:
    page.evaluate("(m) => window.trainyard.onMessage(m)", msg)


# ---------------------------------------------------------------- server side (no processes)

@pytest.fixture
def quiet(monkeypatch, settings, db):
    """No Celery/Channels sends, fast password hashing, two registered nodes."""
    from jobs.core import dispatch
    for name in ("send_launch", "send_stop", "request_tick", "publish", "publish_cluster_changed"):
        monkeypatch.setattr(dispatch, name, lambda *a, **k: None)
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    for n, a in (("node-a", "127.0.0.1"), ("node-b", "127.0.0.2")):
        node_up({"name": n, "address": a, "slots": 2, "devices": [{"kind": "cpu", "index": 0}]})


@pytest.mark.django_db
def test_job_page_checkpoints_table_for_staff_and_others(client, django_user_model, quiet):
    from django.utils import timezone as dj_tz

    from jobs import services
    from jobs.models import Checkpoint
    alice = django_user_model.objects.create_user("alice", password="pw-alice-123")
    staff = django_user_model.objects.create_user("root", password="pw-root-123", is_staff=True)
    job = services.job_submit(user=alice, spec=services.submitted_spec({"name": "ck"}))
    for step, extra in ((10, {"deleted_at": dj_tz.now()}), (20, {"pinned": True}), (30, {"superseded": True})):
        Checkpoint.objects.create(job=job, step=step, path=f"/tmp/ck-{job.pk}-{step}", size_bytes=2048, **extra)

    client.force_login(alice)
    html = client.get(f"/jobs/{job.pk}/").content.decode()
    config = json.loads(re.search(r'<script id="job-config" type="application/json">(.*?)</script>', html).group(1))
    assert config["is_staff"] is False
    assert "rollback-confirm" not in html and "<th>Actions</th>" not in html
    rows = dict(re.findall(r'<tr data-checkpoint="\d+" data-step="(\d+)" class="ck-(\w+)">', html))
    assert rows == {"10": "deleted", "20": "active", "30": "superseded"}
    assert '<span class="badge b-pinned">pinned</span>' in html
    seed = json.loads(re.search(r'<script id="job-checkpoints" type="application/json">(.*?)</script>', html).group(1))
    assert [(c["step"], c["deleted"], c["pinned"], c["superseded"]) for c in seed] == [
        (30, False, False, True), (20, False, True, False), (10, True, False, False)]

    client.force_login(staff)
    html = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="rollback-confirm"' in html and "<th>Actions</th>" in html
    assert json.loads(re.search(r'<script id="job-config" type="application/json">(.*?)</script>',
                                html).group(1))["is_staff"] is True


@pytest.mark.django_db
def test_node_cards_show_quarantine_and_clear_for_staff_only(client, django_user_model, quiet):
    from django.utils import timezone as dj_tz

    from jobs.models import Node
    Node.objects.filter(name="node-b").update(status=Node.Status.QUARANTINED, quarantined_at=dj_tz.now(),
                                               quarantine_reason="implicated in 3 failures within 10 min")
    alice = django_user_model.objects.create_user("alice", password="pw-alice-123")
    staff = django_user_model.objects.create_user("root", password="pw-root-123", is_staff=True)
    for user, sees_button in ((alice, False), (staff, True)):
        client.force_login(user)
        for path in ("/", "/nodes/"):
            html = client.get(path).content.decode()
            card = re.search(r'<article class="node s-quarantined-card" data-node="node-b">.*?</article>', html, re.S)
            assert card, path
            assert "implicated in 3 failures within 10 min" in card.group(0)
            assert ('data-action="clear"' in card.group(0)) is sees_button, (user.username, path)
            assert '<article class="node" data-node="node-a">' in html


# ---------------------------------------------------------------- crafted messages, mocked API

RANKS = [{"rank": 0, "node": "node-a", "pid": 11}, {"rank": 1, "node": "node-b", "pid": 12}]
HANG = {"class": "hang", "retry": True, "rank": 1, "node": "node-b",
        "message": "no step progress for 31 s (timeout 30 s)",
        "traceback": 'Thread 0x7f (most recent call first):\n  File "trainer.py", line 88 in step',
        "suggestion": "Look for a collective that one rank never reached."}
STRAGGLER = {"rank": 1, "node": "node-b", "ratio": 1.45, "work_s": 0.061, "median_s": 0.042, "since_step": 40}


def fake_attempts() -> list[dict]:
    return [
        {"id": 1001, "number": 1, "status": "ENDED", "outcome": "rolled_back", "stop_reason": "rollback",
         "resumed_from": None, "resumed_from_step": None, "failure": {}, "ranks": RANKS,
         "created_at": iso(0), "started_at": iso(1), "ended_at": iso(60)},
        {"id": 1002, "number": 2, "status": "ENDED", "outcome": "failed:hang", "stop_reason": "hang",
         "resumed_from": 502, "resumed_from_step": 20, "failure": HANG, "ranks": RANKS,
         "created_at": iso(61), "started_at": iso(62), "ended_at": iso(120)},
        {"id": 1003, "number": 3, "status": "RUNNING", "outcome": None, "stop_reason": "",
         "resumed_from": 505, "resumed_from_step": 30, "failure": {}, "ranks": RANKS,
         "created_at": iso(121), "started_at": iso(122), "ended_at": None},
    ]


def ck(cid: int, step: int, attempt: int, **extra) -> dict:
    return {"id": cid, "step": step, "attempt": attempt, "created_at": iso(step), "size_bytes": 3 * 1024 * 1024,
            "blocking_s": 0.012, "save_s": 0.4, "superseded": False, "pinned": False, "deleted": False,
            "path": f"/ck/step-{step}", **extra}


FAKE_CHECKPOINTS = [ck(500, 5, 1001, deleted=True), ck(501, 10, 1001), ck(502, 20, 1001, pinned=True),
                    ck(503, 30, 1001, superseded=True), ck(504, 40, 1001, superseded=True), ck(505, 30, 1002)]


def ev(eid: int, kind: str, message: str, t: float, **data) -> dict:
    return {"id": eid, "kind": kind, "message": message, "created_at": iso(t), "attempt": None, "data": data}


FAKE_EVENTS = [
    ev(9001, "attempt_started", "attempt 1 started", 1),
    ev(9002, "checkpoint_deleted", "checkpoint at step 5 deleted by retention", 30, checkpoint=500, step=5),
    ev(9003, "rollback", "admin rolled back to the checkpoint at step 20", 59, checkpoint=502, step=20,
       superseded=[503, 504]),
    ev(9004, "attempt_ended", "attempt 1 ended: rolled_back", 60, outcome="rolled_back"),
    ev(9005, "resumed", "resumed from step 20 in 0.2 s", 63, step=20, load_s=0.2),
    ev(9006, "hang_detected", "no step progress for 31 s", 119, last_step=35, idle_s=31.0, timeout_s=30.0),
    ev(9007, "attempt_ended", "attempt 2 ended: failed:hang", 120, outcome="failed:hang", evidence=HANG),
    ev(9008, "restart", "restarting from step 30", 121, resume_step=30, checkpoint=505),
    ev(9009, "straggler", "rank 1 on node-b is 45% slower", 130, rank=1, node="node-b", ratio=1.45),
]


def fake_samples() -> list[dict]:
    """Attempt 1001 ran to step 40 and was rolled back to 20; 1002 ran 21..35 and hung; 1003 resumed at 30.
    In the snapshot's order (step, rank, attempt), as the server sends them."""
    out = []
    for attempt, first, last in ((1001, 1, 40), (1002, 21, 35), (1003, 31, 60)):
        for step in range(first, last + 1):
            for rank in (0, 1):
                out.append({"attempt": attempt, "rank": rank, "step": step, "ts": 1.0 + step, "loss": 3 - step / 50,
                            "samples_per_s": 100.0 + rank, "tokens_per_s": 6400.0, "step_s": 0.04 + rank / 100,
                            "data_s": 0.001, "compute_s": 0.03, "comm_s": 0.005, "optim_s": 0.001})
    return sorted(out, key=lambda s: (s["step"], s["rank"], s["attempt"]))


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_job_page_renders_checkpoints_timeline_stragglers_and_markers(page, base, cluster):
    real = finished_job(cluster)
    job_id = real["id"]
    job = {**real, "status": "RUNNING", "status_reason": "", "restarts": 2, "attempts": fake_attempts(),
           "stragglers": [STRAGGLER],
           "health": {"last_progress_at": iso(130), "hang_timeout_s": 30.0, "hang_timeout_source": "auto"}}
    served = {"job": job}
    posted: list[tuple[str, dict, str]] = []
    answers = {"rollback": [], "pin": []}

    def serve_job(route):
        if route.request.method == "GET":
            route.fulfill(status=200, content_type="application/json", body=json.dumps(served["job"]))
        else:
            route.continue_()

    def serve_post(kind):
        def handler(route):
            req = route.request
            posted.append((kind, req.post_data_json, req.headers.get("x-csrftoken", "")))
            status, body = answers[kind].pop(0)
            route.fulfill(status=status, content_type="application/json", body=json.dumps(body))
        return handler

    page.route(re.compile(rf".*/api/v1/jobs/{job_id}/$"), serve_job)
    page.route(re.compile(rf".*/api/v1/jobs/{job_id}/rollback/$"), serve_post("rollback"))
    page.route(re.compile(rf".*/api/v1/jobs/{job_id}/checkpoints/\d+/pin/$"), serve_post("pin"))

    page.goto(f"{base}/jobs/{job_id}/")
    wait_js(page, "() => window.trainyard && window.trainyard.socket.stats.snapshots >= 1", 30, "the snapshot")
    stop_socket(page)
    page.evaluate("() => { const t = window.trainyard; t.store.clear(); t.state.checkpoints.clear(); "
                  "t.state.events.clear(); }")
    feed(page, {"type": "snapshot", "job": job, "samples": fake_samples(), "logs": [], "events": FAKE_EVENTS,
                "checkpoints": FAKE_CHECKPOINTS})

    # Straggler banner from job.stragglers, hang timeout from job.health.
    alerts = page.locator("#job-alerts")
    assert alerts.is_visible()
    assert "Straggler: rank 1 on node-b is 45% slower than the median" in alerts.text_content()
    assert "61.0 ms vs 42.0 ms a step, since step 40" in alerts.text_content()
    assert page.text_content("#job-hang") == "hang timeout 30.0 s (auto)"

    # Checkpoints: merged by id (two at step 30), newest step first, a state badge each, staff buttons.
    assert row_states(page) == {504: "superseded", 505: "active", 503: "superseded", 502: "active", 501: "active",
                                500: "deleted"}
    order = page.evaluate("() => [...document.querySelectorAll('#checkpoints-body tr')].map(r => +r.dataset.checkpoint)")
    assert order == [504, 505, 503, 502, 501, 500]
    row = page.locator('#checkpoints-body tr[data-checkpoint="505"]')
    cells = [c.strip() for c in row.locator("td").all_text_contents()]
    assert cells[0] == "step 30" and cells[1] == "#2" and cells[3] == "3.0 MiB" and cells[4] == "12.0 ms / 400 ms"
    assert cells[5] == "active" and cells[6] == "Roll backPin"
    assert page.locator('#checkpoints-body tr[data-checkpoint="502"] .b-pinned').count() == 1
    assert page.text_content('#checkpoints-body tr[data-checkpoint="502"] button[data-action=pin]') == "Unpin"
    assert page.locator('#checkpoints-body tr[data-checkpoint="500"] button').count() == 0  # deleted: nothing to do
    assert page.text_content('#checkpoints-body tr[data-checkpoint="501"] td:nth-child(2)') == "#1"

    # A live checkpoint message updates its row by id; a new one goes on top.
    feed(page, {"type": "checkpoint", "checkpoint": {**FAKE_CHECKPOINTS[5], "superseded": True}})
    feed(page, {"type": "checkpoint", "checkpoint": ck(507, 50, 1003)})
    states = row_states(page)
    assert states[505] == "superseded" and states[507] == "active" and len(states) == 7
    assert page.get_attribute("#checkpoints-body tr:first-child", "data-checkpoint") == "507"

    # Attempts: resumed-from says why, the hang's suggestion shows, its traceback folds.
    resumed = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#attempts-body tr[data-attempt]')]
        .map(r => [r.dataset.number, r.children[4].textContent]))""")
    assert resumed == {"3": "step 30 (restart)", "2": "step 20 (rollback)", "1": "start"}
    failure = page.locator('#attempts-body tr[data-failure="1002"]')
    assert "Suggestion: Look for a collective that one rank never reached." in failure.text_content()
    assert "hang (rank 1 on node-b): no step progress for 31 s" in failure.locator("summary").text_content()
    assert not failure.locator("pre.tb").is_visible()
    screenshot(page, "screenshot-fault-crafted.png")
    failure.locator("summary").click()
    assert failure.locator("pre.tb").is_visible() and "trainer.py" in failure.locator("pre.tb").text_content()

    # Timeline: kinds coloured by class, evidence folded; an expanded one stays open as events arrive.
    wait_js(page, "() => document.querySelectorAll('#events li[data-id]').length === 9", 5, "the timeline")
    classes = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#events li[data-id]')]
        .map(li => [li.dataset.id, li.className + '|' + li.querySelector('.ev-kind').className]))""")
    expect = {"9001": "ok", "9002": "info", "9003": "warn", "9004": "warn", "9005": "info", "9006": "bad",
              "9007": "bad", "9008": "warn", "9009": "warn"}
    assert classes == {k: f"ev-{v}|ev-kind kb-{v}" for k, v in expect.items()}
    hang_ended = page.locator('#events li[data-id="9007"]')
    hang_ended.locator("summary").click()
    evidence = json.loads(hang_ended.locator(".ev-evidence pre").text_content())
    assert evidence == HANG
    assert page.locator('#events li[data-id="9001"] details').count() == 0  # no data, no evidence block
    feed(page, {"type": "event", "event": ev(9010, "checkpoint", "checkpoint at step 50", 140, step=50)})
    wait_js(page, "() => document.querySelector('#events li').dataset.id === '9010'", 5, "the new event on top")
    assert page.evaluate("() => document.querySelector('#events li[data-id=\"9007\"] details').open")

    # Charts: one rollback and one restart marker; each step once, from the attempt that owns it now.
    wait_js(page, "() => window.trainyard.charts.loss.markersDrawn === 2", 5, "two markers drawn")
    for name in CHARTS:
        assert page.get_attribute(f"#chart-{name}", "data-markers") == "rollback@20,restart@30", name
    stats = chart_stats(page)
    assert_no_duplicates_or_gaps(stats, world=2)
    assert {r: (s["min"], s["max"]) for r, s in stats["ranks"].items()} == {"0": (1, 60), "1": (1, 60)}
    owners = page.evaluate("() => [10, 20, 21, 30, 31, 35, 36, 60].map(s => window.trainyard.store.rows.get(s).get(1).attempt)")
    assert owners == [1001, 1001, 1002, 1002, 1003, 1003, 1003, 1003]

    # straggler_cleared -> one GET of the job -> the banner goes.
    served["job"] = {**job, "stragglers": []}
    fetches = page.evaluate("() => window.trainyard.state.jobFetches")
    feed(page, {"type": "event", "event": ev(9011, "straggler_cleared", "rank 1 caught up", 150, rank=1)})
    wait_js(page, f"() => window.trainyard.state.jobFetches > {fetches} && "
                  "document.querySelector('#job-alerts').hidden", 5, "the banner to go")

    # Roll back: a confirm naming the step; "Keep running" backs out; a refusal shows inline.
    page.click('#checkpoints-body tr[data-checkpoint="503"] button[data-action=rollback]')
    assert page.is_visible("#rollback-confirm")
    assert page.text_content("#rollback-question") == (
        f"Roll back job {job_id} to step 30? The running attempt stops; later checkpoints are superseded.")
    page.click("#rollback-no")
    assert page.is_hidden("#rollback-confirm") and not posted
    answers["rollback"].append((400, {"errors": {"checkpoint": ["checkpoint 503 (step 30): its files are missing"]}}))
    page.click('#checkpoints-body tr[data-checkpoint="503"] button[data-action=rollback]')
    page.click("#rollback-yes")
    wait_js(page, "() => !document.querySelector('#checkpoint-note').hidden", 5, "the refusal")
    note = page.locator("#checkpoint-note")
    assert note.text_content() == ("Roll back to step 30 refused: checkpoint: checkpoint 503 (step 30): "
                                   "its files are missing")
    assert "bad" in note.get_attribute("class") and page.is_hidden("#rollback-confirm")

    served["job"] = {**job, "stragglers": [], "status": "STOPPING", "status_reason": "rolling back to step 20"}
    answers["rollback"].append((202, served["job"]))
    page.click('#checkpoints-body tr[data-checkpoint="502"] button[data-action=rollback]')
    page.click("#rollback-yes")
    wait_js(page, "() => document.querySelector('#checkpoint-note').textContent.startsWith('Rollback to step 20')", 5,
            "the rollback note")
    assert "bad" not in note.get_attribute("class")
    assert page.text_content("#job-reason") == "rolling back to step 20"
    csrf = page.evaluate("() => document.querySelector('input[name=csrfmiddlewaretoken]').value")
    assert [p[:2] for p in posted] == [("rollback", {"checkpoint": 503}), ("rollback", {"checkpoint": 502})]
    assert all(p[2] for p in posted) and csrf

    # Pin and unpin: the answer updates the row; a refusal shows inline.
    answers["pin"].append((200, ck(501, 10, 1001, pinned=True)))
    page.click('#checkpoints-body tr[data-checkpoint="501"] button[data-action=pin]')
    wait_js(page, "() => document.querySelector('#checkpoints-body tr[data-checkpoint=\"501\"]').dataset.pinned === '1'",
            5, "the pin")
    assert page.text_content('#checkpoints-body tr[data-checkpoint="501"] button[data-action=pin]') == "Unpin"
    answers["pin"].append((409, {"errors": {"checkpoint": ["checkpoint 502 is the job's only one"]}}))
    page.click('#checkpoints-body tr[data-checkpoint="502"] button[data-action=pin]')
    wait_js(page, "() => document.querySelector('#checkpoint-note').textContent.startsWith('Unpin')", 5, "refusal")
    assert posted[-2][:2] == ("pin", {"pinned": True}) and posted[-1][:2] == ("pin", {"pinned": False})
    assert row_states(page)[502] == "active"

    # A finished job shows no straggler banner, whatever the last job JSON listed.
    served["job"] = {**job, "status": "RUNNING"}
    feed(page, {"type": "event", "event": ev(9012, "straggler", "rank 1 is slower", 160, rank=1)})
    wait_js(page, "() => !document.querySelector('#job-alerts').hidden", 5, "the banner back")
    served["job"] = {**job, "status": "SUCCEEDED"}
    feed(page, {"type": "status", "status": "SUCCEEDED", "status_reason": "", "step": 60})
    assert page.is_hidden("#job-alerts")
    fetches = page.evaluate("() => window.trainyard.state.jobFetches")
    wait_js(page, f"() => window.trainyard.state.jobFetches > {fetches}", 5, "the refresh")
    page.wait_for_timeout(100)
    assert page.is_hidden("#job-alerts")
    assert not page.js_errors, page.js_errors


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_nodes_page_quarantined_card_clears_from_the_button(page, base, cluster):
    page.goto(f"{base}/nodes/")
    wait_js(page, "() => window.trainyard.socket.stats.snapshots >= 1", 30, "the cluster snapshot")
    stop_socket(page)
    nodes = cluster.get("/api/v1/nodes/")["results"]
    since = (datetime.now(timezone.utc) - timedelta(seconds=125)).isoformat()
    reason = "implicated in 3 failures within 10 min (attempts 4, 5, 6)"
    quarantined = [{**n, "status": "QUARANTINED", "quarantined_at": since, "quarantine_reason": reason}
                   if n["name"] == "node-b" else n for n in nodes]
    feed(page, {"type": "nodes", "nodes": quarantined})
    card = page.locator('#nodes .node[data-node="node-b"]')
    assert "s-quarantined-card" in card.get_attribute("class")
    screenshot(page, "screenshot-nodes-quarantine.png")
    assert card.locator(".status").text_content() == "QUARANTINED"
    box = card.locator(".quarantine").text_content()
    assert f"Quarantined 2 min ago: {reason}" in box
    assert page.locator('#nodes .node[data-node="node-a"] .quarantine').count() == 0
    assert page.get_attribute('#node-table tr[data-node="node-b"] td:nth-child(2)', "title") == f"quarantined: {reason}"

    answers = [(403, {"errors": {"detail": ["only staff may clear a quarantine"]}}),
               (200, {**quarantined[1], "status": "READY", "quarantined_at": None, "quarantine_reason": ""})]
    posted: list[str] = []

    def clear(route):
        posted.append(route.request.headers.get("x-csrftoken", ""))
        status, body = answers.pop(0)
        route.fulfill(status=status, content_type="application/json", body=json.dumps(body))

    page.route(re.compile(r".*/api/v1/nodes/node-b/clear/$"), clear)
    card.locator("button[data-action=clear]").click()
    wait_js(page, "() => !document.querySelector('#node-error').hidden", 5, "the refusal")
    assert page.text_content("#node-error") == "Clear quarantine of node-b refused: only staff may clear a quarantine"
    card.locator("button[data-action=clear]").click()
    wait_js(page, "() => !document.querySelector('#nodes .node[data-node=\"node-b\"] .quarantine')", 5, "the cleared card")
    assert card.locator(".status").text_content() == "READY" and page.is_hidden("#node-error")
    assert len(posted) == 2 and all(posted)
    assert not page.js_errors, page.js_errors


# ---------------------------------------------------------------- the real flow

@pytest.mark.procs
@pytest.mark.timeout(600)
def test_rollback_from_the_page_resumes_and_finishes(page, base, cluster):
    steps = 150
    job = cluster.submit({"name": "rollback-ui", "model": MODEL, "train": {"steps": steps, "global_batch": 8},
                          "checkpoint": {"every_steps": 10, "keep": 100}})
    job_id = job["id"]
    page.goto(f"{base}/jobs/{job_id}/")
    wait_js(page, "() => document.querySelectorAll('#checkpoints-body tr[data-state=active]').length >= 2", 180,
            "two checkpoints in the table")
    states = row_states(page)
    steps_by_id = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
        '#checkpoints-body tr[data-checkpoint]')].map(r => [r.dataset.checkpoint, +r.dataset.step]))""")
    steps_by_id = {int(k): v for k, v in steps_by_id.items()}
    target = min((c for c, s in states.items() if s == "active"), key=lambda c: steps_by_id[c])
    target_step = steps_by_id[target]

    page.click(f'#checkpoints-body tr[data-checkpoint="{target}"] button[data-action=rollback]')
    assert page.text_content("#rollback-question") == (
        f"Roll back job {job_id} to step {target_step}? The running attempt stops; later checkpoints are superseded.")
    with page.expect_response(lambda r: r.url.endswith(f"/api/v1/jobs/{job_id}/rollback/")) as resp:
        page.click("#rollback-yes")
    assert resp.value.status == 202, resp.value.text()
    t0 = time.monotonic()
    # Every checkpoint after the target that existed then is superseded now (pushed over the socket).
    later = [c for c, s in steps_by_id.items() if s > target_step]
    assert later
    wait_js(page, f"""() => {json.dumps(later)}.every(id => document.querySelector(
        `#checkpoints-body tr[data-checkpoint="${{id}}"]`)?.dataset.state === 'superseded')""", 30,
            "the later checkpoints superseded")
    assert row_states(page)[target] == "active"

    # A new attempt resumes from the target; the charts mark the rollback; the job finishes.
    wait_js(page, "() => document.querySelectorAll('#attempts-body tr[data-attempt]').length >= 2", 60, "attempt 2")
    wait_js(page, f"() => (document.querySelector('#chart-loss').dataset.markers || '').split(',')"
                  f".includes('rollback@{target_step}')", 60, "the rollback marker")
    wait_js(page, "() => document.body.dataset.jobStatus === 'SUCCEEDED'", 240, "SUCCEEDED after the rollback")
    print(f"job {job_id}: rolled back to step {target_step}, SUCCEEDED {time.monotonic() - t0:.1f} s later")
    wait_js(page, f"() => document.querySelector('#job-step').textContent.trim() === '{steps} / {steps}'", 15,
            "the final step in the header")
    final = cluster.job(job_id)
    assert final["step"] == steps and final["status"] == "SUCCEEDED"
    first, second = sorted(final["attempts"], key=lambda a: a["number"])[:2]
    assert first["outcome"] in ("rolled_back", "succeeded"), first  # the latter if it had finished before the click
    assert second["resumed_from_step"] == target_step and second["resumed_from"] == target
    wait_js(page, f"() => document.querySelector('#attempts-body tr[data-number=\"2\"]')?.children[4].textContent"
                  f" === 'step {target_step} (rollback)'", 15, "the attempts table")
    assert page.evaluate("() => window.trainyard.charts.loss.markersDrawn") >= 1
    assert "ev-warn" in page.get_attribute("#events li[data-kind=rollback]", "class")
    screenshot(page, "screenshot-rollback.png")
    # The new attempt's checkpoints are active and after the target.
    wait_js(page, f"""() => [...document.querySelectorAll('#checkpoints-body tr[data-state=active]')]
        .some(r => +r.dataset.step > {target_step})""", 30, "a checkpoint of the new attempt")

    # Each step once per rank, from the attempt that owns it, live and after a reload (snapshot).
    wait_js(page, f"() => Object.values(window.trainyard.stats()).every(s => s.max === {steps})", 30, "the last step")
    assert_no_duplicates_or_gaps(chart_stats(page), world=2)
    page.reload()
    wait_js(page, "() => window.trainyard && window.trainyard.socket.stats.snapshots >= 1", 30, "the snapshot")
    wait_js(page, f"() => (document.querySelector('#chart-loss').dataset.markers || '').includes('rollback@{target_step}')",
            15, "the marker after a reload")
    stats = chart_stats(page)
    assert_no_duplicates_or_gaps(stats, world=2)
    assert all(s["max"] == steps for s in stats["ranks"].values())
    assert not page.js_errors, page.js_errors


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_non_staff_sees_no_rollback_or_clear_buttons_and_the_api_refuses(browser, base, cluster):
    manage(cluster, "shell", "-c",
           "from django.contrib.auth import get_user_model; U = get_user_model(); "
           f"U.objects.filter(username='bob').exists() or U.objects.create_user('bob', password='{BOB_PASSWORD}')")
    token = manage(cluster, "api_token", "bob").splitlines()[-1]
    status, job = api(cluster, "POST", "/api/v1/jobs/", {
        "name": "bob-ck", "model": {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 32},
        "train": {"steps": 30, "global_batch": 8}, "checkpoint": {"every_steps": 10}}, token=token)
    assert status == 201, job
    assert cluster.wait_status(job["id"], TERMINAL, 180)["status"] == "SUCCEEDED"
    status, cks = api(cluster, "GET", f"/api/v1/jobs/{job['id']}/checkpoints/", token=token)
    assert status == 200 and cks["count"] >= 1, cks

    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    try:
        login(page, base, "bob", BOB_PASSWORD)
        page.goto(f"{base}/jobs/{job['id']}/")
        wait_js(page, "() => window.trainyard && window.trainyard.socket.stats.snapshots >= 1", 30, "the snapshot")
        wait_js(page, f"() => document.querySelectorAll('#checkpoints-body tr[data-checkpoint]').length === {cks['count']}",
                15, "bob's checkpoints")
        assert page.locator("#checkpoints-body button").count() == 0
        assert page.locator("#rollback-confirm").count() == 0
        assert page.locator("#checkpoint-table th").count() == 6
        # The server refuses too, with the API's message.
        cid = cks["results"][-1]["id"]
        refused = page.evaluate("""async ([job, cid]) => {
            const { postJSON, errorText } = await import('/static/js/util.js');
            const r = await postJSON(`/api/v1/jobs/${job}/rollback/`, { checkpoint: cid });
            const p = await postJSON(`/api/v1/jobs/${job}/checkpoints/${cid}/pin/`, { pinned: true });
            return [r.status, errorText(r.data, r.status), p.status];
        }""", [job["id"], cid])
        assert refused == [403, "only staff may roll a job back", 403]

        page.goto(f"{base}/nodes/")
        wait_js(page, "() => window.trainyard.socket.stats.snapshots >= 1", 30, "the cluster snapshot")
        stop_socket(page)
        nodes = cluster.get("/api/v1/nodes/")["results"]
        feed(page, {"type": "nodes", "nodes": [{**n, "status": "QUARANTINED", "quarantined_at": iso(0),
                                                "quarantine_reason": "flaky"} for n in nodes]})
        assert page.locator("#nodes .quarantine").count() == len(nodes)
        assert page.locator("#nodes button[data-action=clear]").count() == 0
        status, _ = api(cluster, "POST", "/api/v1/nodes/node-b/clear/", {}, token=token)
        assert status == 403
    finally:
        ctx.close()


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_quarantined_node_is_cleared_from_its_card(page, base, cluster):
    reason = "implicated in 3 failures within 10 min (browser test)"
    manage(cluster, "shell", "-c",
           "from django.utils import timezone; from jobs.models import Node; "
           "Node.objects.filter(name='node-b').update(status=Node.Status.QUARANTINED, "
           f"quarantined_at=timezone.now(), quarantine_reason='{reason}')")
    try:
        page.goto(f"{base}/nodes/")
        wait_js(page, "() => window.trainyard.socket.stats.snapshots >= 1", 30, "the cluster snapshot")
        card = page.locator('#nodes .node[data-node="node-b"]')
        assert card.locator(".status").text_content() == "QUARANTINED"
        assert reason in card.locator(".quarantine").text_content()
        with page.expect_response(lambda r: r.url.endswith("/api/v1/nodes/node-b/clear/")) as resp:
            card.locator("button[data-action=clear]").click()
        assert resp.value.status == 200, resp.value.text()
        wait_js(page, "() => !document.querySelector('#nodes .node[data-node=\"node-b\"] .quarantine')", 15,
                "the cleared card")
        assert card.locator(".status").text_content() == "READY"
        node = next(n for n in cluster.get("/api/v1/nodes/")["results"] if n["name"] == "node-b")
        assert node["status"] == "READY" and node["quarantined_at"] is None and node["quarantine_reason"] == ""
        assert not page.js_errors, page.js_errors
    finally:  # leave the cluster as the other tests expect it
        manage(cluster, "shell", "-c",
               "from jobs.models import Node; Node.objects.filter(name='node-b', status='QUARANTINED')"
               ".update(status='READY', quarantined_at=None, quarantine_reason='')")


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_sdk_script_rolled_back_from_the_page_resumes_at_the_target_and_runs_every_step_once(page, base, cluster):
    """The user's own code (examples/sdk_ddp, uploaded as a bundle) rolled back from the page:
    run.restore loads the target, the new attempt runs target+1.. and the lineage has each step once."""
    from tests.integration.test_user_code import EXAMPLES, upload
    from tests.test_entrypoint import pack_dir

    status, body = upload(cluster, pack_dir(EXAMPLES / "sdk_ddp"))
    assert status in (200, 201), body
    steps = 200
    job = cluster.submit({"name": "sdk-rollback-ui", "code": {"bundle": body["bundle"]},
                          "entrypoint": {"script": "train.py"}, "train": {"steps": steps},
                          "config": {"hidden": 32, "batch": 16, "step_sleep_s": 0.05},
                          "resources": {"nodes": 2, "procs_per_node": 1},
                          "checkpoint": {"every_steps": 10, "keep": 100}})
    job_id = job["id"]
    page.goto(f"{base}/jobs/{job_id}/")
    wait_js(page, "() => document.querySelectorAll('#checkpoints-body tr[data-state=active]').length >= 2", 180,
            "two checkpoints of the script in the table")
    steps_by_id = {int(k): v for k, v in page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
        '#checkpoints-body tr[data-checkpoint]')].map(r => [r.dataset.checkpoint, +r.dataset.step]))""").items()}
    target = min((c for c, s in row_states(page).items() if s == "active"), key=lambda c: steps_by_id[c])
    target_step = steps_by_id[target]

    page.click(f'#checkpoints-body tr[data-checkpoint="{target}"] button[data-action=rollback]')
    with page.expect_response(lambda r: r.url.endswith(f"/api/v1/jobs/{job_id}/rollback/")) as resp:
        page.click("#rollback-yes")
    assert resp.value.status == 202, resp.value.text()
    wait_js(page, f"() => (document.querySelector('#chart-loss').dataset.markers || '').split(',')"
                  f".includes('rollback@{target_step}')", 60, "the rollback marker")
    wait_js(page, "() => document.body.dataset.jobStatus === 'SUCCEEDED'", 240, "SUCCEEDED after the rollback")

    final = cluster.job(job_id)
    assert final["step"] == steps and final["status"] == "SUCCEEDED", final
    second = sorted(final["attempts"], key=lambda a: a["number"])[1]
    assert second["resumed_from_step"] == target_step and second["resumed_from"] == target, second
    # run.restore returned the target's step: the new attempt's first sample is the step after it.
    status, samples = cluster.request("GET", f"/api/v1/jobs/{job_id}/metrics/?per_rank=1&attempt={second['id']}&limit=10000")
    assert status == 200 and min(s["step"] for s in samples) == target_step + 1, samples[:3]
    assert all("lr" in s["metrics"] for s in samples)  # the script's own metric, after the resume too
    wait_js(page, f"() => Object.values(window.trainyard.stats()).every(s => s.max === {steps})", 30, "the last step")
    assert_no_duplicates_or_gaps(chart_stats(page), world=2)
    assert not page.js_errors, page.js_errors


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_nodes_page_control_plane_panel_shows_beat_down_and_back_without_a_reload(page, base, cluster):
    """Issue 16 section 5: beat killed -> its row turns DOWN within the stamp TTL (10 s) plus one 5 s
    poll, while the rest stay UP; started again -> UP. The panel is fetched, not pushed: pushes come
    through the very processes it shows."""
    page.goto(f"{base}/nodes/")
    state = "(p) => document.querySelector(`#cp-processes tr[data-process=\"${p}\"] .status`)?.textContent"
    assert page.evaluate(state, "beat") == "UP" and page.evaluate(state, "control") == "UP"
    cluster.kill_proc("beat")
    try:
        page.wait_for_function(f"() => ({state})('beat') === 'DOWN'", timeout=20_000)
        assert [page.evaluate(state, p) for p in ("web", "redis", "control", "relay", "agent:node-a")] == ["UP"] * 5
    finally:
        cluster.start_proc("beat")
    page.wait_for_function(f"() => ({state})('beat') === 'UP'", timeout=60_000)
    assert not page.js_errors, page.js_errors
