"""The scheduling dashboard (issue 5) in a real browser against a real cluster (no training):

- /quotas/ as admin: edit a team's quota inline (PUT with the CSRF token), see the saved value and a
  new audit row; -1 shows the server's error next to the input and saves nothing; a change made
  elsewhere (the API) reaches the page over the cluster socket;
- a non-staff user gets 403 on /quotas/, no Quotas link and no node control buttons;
- Cordon / Uncordon and Drain (preempt, behind a confirm) from the nodes page;
- a queued job's position, predicted start, borrowing badge and preemption events on its page.
"""
from __future__ import annotations

import json
import re
import time
from datetime import datetime, timedelta, timezone

import pytest

from .conftest import login, screenshot
from .test_dashboard import wait_js
from .test_fault_ui import api, feed, manage, stop_socket

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

BOB_PASSWORD = "bob-pw-12345"


def make_team(cluster, name: str) -> None:
    manage(cluster, "shell", "-c", "from django.contrib.auth.models import Group; "
           f"Group.objects.get_or_create(name='{name}')")


def quota_row(page, name: str):
    return page.locator(f'#quota-rows tr[data-kind="team"][data-name="{name}"]')


def audit_subjects(page) -> list[str]:
    return page.locator("#quota-audit tr[data-change] td:nth-child(3)").all_text_contents()


def node_status(page, name: str) -> str:
    return page.locator(f'#nodes .node[data-node="{name}"] .node-head .status').text_content()


def node_buttons(page, name: str) -> list[str]:
    return page.locator(f'#nodes .node[data-node="{name}"] .node-actions button').all_text_contents()


# ---------------------------------------------------------------- quotas

def test_admin_edits_a_quota_inline_and_sees_the_audit_row(page, base, cluster):
    make_team(cluster, "vision")
    csrf: list[str] = []
    page.on("request", lambda r: r.method == "PUT" and r.url.endswith("/api/v1/quotas/")
            and csrf.append(r.headers.get("x-csrftoken", "")))
    page.goto(f"{base}/quotas/")
    assert page.locator('nav a[href="/quotas/"].active').count() == 1
    wait_js(page, "() => window.trainyard && window.trainyard.socket.stats.snapshots >= 1", 30, "the cluster socket")
    row = quota_row(page, "vision")
    assert row.locator('input[name="max_slots"]').input_value() == ""  # no quota yet
    audit_before = page.locator("#quota-audit tr[data-change]").count()

    # Save: the row shows the server's answer, the note says so, a new audit row on top.
    row.locator('input[name="max_slots"]').fill("3")
    row.locator('input[name="device_hours"]').fill("50")
    with page.expect_response(lambda r: r.url.endswith("/api/v1/quotas/") and r.request.method == "PUT") as resp:
        row.locator("button[data-action=save]").click()
    assert resp.value.status == 200, resp.value.text()
    wait_js(page, "() => document.querySelector('#quota-rows tr[data-name=\"vision\"] .row-note')"
                  ".textContent === 'Saved.'", 10, "the saved note")
    assert page.text_content("#quota-note") == "Saved the quota of team vision: 3 slots, 50 device-hours."
    assert row.locator('td[data-col="device_hours_used"]').text_content() == "0 / 50"
    wait_js(page, f"() => document.querySelectorAll('#quota-audit tr[data-change]').length === {audit_before + 1}",
            10, "the new audit row")
    top = page.locator("#quota-audit tr[data-change]").first
    cells = top.locator("td").all_text_contents()
    assert cells[1] == "admin" and cells[2] == "team:vision" and cells[3] == "none → 3 slots, 50 device-h", cells
    assert csrf and all(csrf)
    rows = {r["team"]: r for r in cluster.get("/api/v1/quotas/")["results"] if r["team"]}
    assert rows["vision"]["max_slots"] == 3 and rows["vision"]["device_hours"] == 50

    # -1: the server's message next to the input, nothing saved, no audit row.
    row.locator('input[name="max_slots"]').fill("-1")
    with page.expect_response(lambda r: r.url.endswith("/api/v1/quotas/") and r.request.method == "PUT") as resp:
        row.locator('input[name="max_slots"]').press("Enter")
    assert resp.value.status == 400
    error = row.locator('.field-error[data-error-for="max_slots"]')
    error.wait_for()
    assert "must be a whole number of slots >= 0, got -1" in error.text_content()
    assert row.locator('input[name="max_slots"]').get_attribute("aria-invalid") == "true"
    assert row.locator('input[name="device_hours"]').get_attribute("aria-invalid") is None
    assert row.locator(".row-note").text_content() == "Not saved."
    assert page.is_hidden("#quota-note")
    rows = {r["team"]: r for r in cluster.get("/api/v1/quotas/")["results"] if r["team"]}
    assert rows["vision"]["max_slots"] == 3
    assert page.locator("#quota-audit tr[data-change]").count() == audit_before + 1
    screenshot(page, "screenshot-quotas.png")

    # A fix clears the error. Then a change made elsewhere reaches the page over the socket.
    row.locator('input[name="max_slots"]').fill("4")
    row.locator("button[data-action=save]").click()
    wait_js(page, "() => !document.querySelector('#quota-rows .field-error')", 10, "the error cleared")
    page.locator("h1").click()  # nothing focused: live updates may replace the inputs
    status, _ = api(cluster, "PUT", "/api/v1/quotas/", {"team": "vision", "max_slots": 7, "device_hours": None})
    assert status == 200
    wait_js(page, "() => document.querySelector('#quota-rows tr[data-name=\"vision\"] input[name=max_slots]')"
                  ".value === '7'", 15, "the quota changed elsewhere")
    assert row.locator('input[name="device_hours"]').input_value() == ""
    wait_js(page, f"() => document.querySelectorAll('#quota-audit tr[data-change]').length === {audit_before + 3}",
            10, "the audit log refreshed")

    # A reload shows what the server has.
    page.reload()
    assert quota_row(page, "vision").locator('input[name="max_slots"]').input_value() == "7"
    assert audit_subjects(page)[:3] == ["team:vision"] * 3
    assert not page.js_errors, page.js_errors


def test_non_staff_gets_403_and_no_node_controls(browser, base, cluster):
    manage(cluster, "shell", "-c",
           "from django.contrib.auth import get_user_model; U = get_user_model(); "
           f"U.objects.filter(username='bob').exists() or U.objects.create_user('bob', password='{BOB_PASSWORD}')")
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    try:
        login(page, base, "bob", BOB_PASSWORD)
        assert page.locator('nav a[href="/quotas/"]').count() == 0
        resp = page.goto(f"{base}/quotas/")
        assert resp.status == 403
        page.goto(f"{base}/nodes/")
        wait_js(page, "() => window.trainyard.socket.stats.snapshots >= 1", 30, "the cluster snapshot")
        assert page.locator("#nodes .node").count() == 2
        assert page.locator("#nodes .node-actions").count() == 0
        assert page.locator("#nodes button").count() == 0 and page.locator("#node-confirm").count() == 0
        token = manage(cluster, "api_token", "bob").splitlines()[-1]
        assert api(cluster, "POST", "/api/v1/nodes/node-a/cordon/", {}, token=token)[0] == 403
        assert api(cluster, "PUT", "/api/v1/quotas/", {"team": "vision", "max_slots": 1}, token=token)[0] == 403
    finally:
        ctx.close()


def test_quota_and_nodes_pages_fit_a_phone(browser, context, base, cluster):
    phone = browser.new_context(viewport={"width": 390, "height": 844}, storage_state=context.storage_state(),
                                is_mobile=True, has_touch=True)
    page = phone.new_page()
    try:
        for path in ("/quotas/", "/nodes/"):
            page.goto(f"{base}{path}")
            sizes = page.evaluate("() => ({body: document.body.scrollWidth, doc: document.documentElement.scrollWidth,"
                                  " inner: window.innerWidth})")
            assert sizes["body"] <= sizes["inner"] + 1 and sizes["doc"] <= sizes["inner"] + 1, (path, sizes)
    finally:
        phone.close()


# ---------------------------------------------------------------- nodes

def test_cordon_drain_and_uncordon_from_the_nodes_page(page, base, cluster):
    posted: list[str] = []
    page.on("request", lambda r: r.method == "POST" and "/api/v1/nodes/" in r.url and posted.append(r.url))
    try:
        page.goto(f"{base}/nodes/")
        wait_js(page, "() => window.trainyard.socket.stats.snapshots >= 1", 30, "the cluster snapshot")
        assert node_status(page, "node-a") == "READY"
        assert node_buttons(page, "node-a") == ["Cordon", "Drain (finish)", "Drain (preempt)"]
        card = page.locator('#nodes .node[data-node="node-a"]')

        with page.expect_response(lambda r: r.url.endswith("/api/v1/nodes/node-a/cordon/")) as resp:
            card.locator("button[data-action=cordon]").click()
        assert resp.value.status == 200, resp.value.text()
        wait_js(page, "() => document.querySelector('#nodes .node[data-node=\"node-a\"] .status').textContent "
                      "=== 'CORDONED'", 10, "CORDONED")
        assert card.locator(".drain").text_content() == "Cordoned: no new work; running jobs continue"
        screenshot(page, "screenshot-nodes-controls.png")
        assert node_buttons(page, "node-a") == ["Drain (finish)", "Drain (preempt)", "Uncordon"]
        assert node_status(page, "node-b") == "READY"
        wait_js(page, "() => document.querySelector('#node-table tr[data-node=\"node-a\"] td:nth-child(2)')"
                      ".textContent.includes('cordon')", 10, "the table")

        # Drain (preempt) asks first; Cancel sends nothing.
        before = len(posted)
        card.locator('button[data-action=drain][data-mode=preempt]').click()
        assert page.is_visible("#node-confirm")
        assert "Running jobs on node-a will checkpoint and move" in page.text_content("#node-question")
        page.click("#node-no")
        assert page.is_hidden("#node-confirm") and len(posted) == before
        card.locator('button[data-action=drain][data-mode=preempt]').click()
        with page.expect_response(lambda r: r.url.endswith("/api/v1/nodes/node-a/drain/")) as resp:
            page.click("#node-yes")
        assert resp.value.status == 200 and resp.value.json()["drain_mode"] == "preempt"
        wait_js(page, "() => document.querySelector('#nodes .node[data-node=\"node-a\"] .status').textContent "
                      "=== 'DRAINING'", 10, "DRAINING")
        assert node_buttons(page, "node-a") == ["Uncordon"]

        with page.expect_response(lambda r: r.url.endswith("/api/v1/nodes/node-a/uncordon/")) as resp:
            card.locator("button[data-action=uncordon]").click()
        assert resp.value.status == 200
        wait_js(page, "() => document.querySelector('#nodes .node[data-node=\"node-a\"] .status').textContent "
                      "=== 'READY'", 10, "READY")
        assert card.locator(".drain").count() == 0 and page.is_hidden("#node-error")
        node = next(n for n in cluster.get("/api/v1/nodes/")["results"] if n["name"] == "node-a")
        assert node["status"] == "READY" and node["drain_mode"] == ""

        # A refusal shows inline (a mocked 400; the real API only refuses non-staff and bad modes).
        page.route(re.compile(r".*/api/v1/nodes/node-b/cordon/$"), lambda route: route.fulfill(
            status=400, content_type="application/json", body='{"errors": {"action": ["not now"]}}'))
        page.locator('#nodes .node[data-node="node-b"] button[data-action=cordon]').click()
        wait_js(page, "() => !document.querySelector('#node-error').hidden", 5, "the refusal")
        assert page.text_content("#node-error") == "Cordon of node-b refused: action: not now"
        assert node_status(page, "node-b") == "READY"
        assert not page.js_errors, page.js_errors
    finally:
        for n in ("node-a", "node-b"):
            api(cluster, "POST", f"/api/v1/nodes/{n}/uncordon/", {})


# ---------------------------------------------------------------- queued job: position, start, preemption

def test_queued_job_shows_position_predicted_start_borrowing_and_preemptions(page, base, cluster):
    for n in ("node-a", "node-b"):  # nothing can start: the job stays queued, no training runs
        assert api(cluster, "POST", f"/api/v1/nodes/{n}/cordon/", {})[0] == 200
    job = None
    try:
        job = cluster.submit({"name": "waits", "train": {"steps": 5}})
        page.goto(f"{base}/jobs/")
        tr = page.locator(f'#job-table tr[data-job="{job["id"]}"]')
        assert "#1" in tr.locator("td.queue-pos").text_content()
        assert tr.locator(".eta-text").text_content() == "unknown"
        assert tr.locator(".eta-text").get_attribute("title") == "no prediction yet"

        page.goto(f"{base}/jobs/{job['id']}/")
        wait_js(page, "() => window.trainyard && window.trainyard.socket.stats.snapshots >= 1", 30, "the snapshot")
        assert page.is_visible("#queue-stat") and page.text_content("#job-queue-pos") == "#1"
        assert page.text_content("#job-eta") == "unknown" and page.is_hidden("#job-borrowing")

        # Crafted from here on: the socket stops, and the job GETs that events and status messages
        # trigger answer with what the test says the server has.
        stop_socket(page)
        now = datetime.now(timezone.utc)
        start_at = (now + timedelta(minutes=4, seconds=20)).isoformat()
        queued = {**cluster.job(job["id"]), "queue_position": 2, "predicted_start_at": start_at}
        served = {"job": queued}
        page.route(re.compile(rf".*/api/v1/jobs/{job['id']}/$"), lambda route: route.fulfill(
            status=200, content_type="application/json", body=json.dumps(served["job"])))
        feed(page, {"type": "snapshot", "job": queued, "samples": [], "logs": [], "events": [], "checkpoints": []})
        assert page.text_content("#job-queue-pos") == "#2" and page.text_content("#job-eta") == "in ~4 min"
        title = page.get_attribute("#job-eta", "title")
        assert title and title != "no prediction yet" and re.search(r"\d\d:\d\d:\d\d", title)

        # Running on borrowed slots, then preempted: amber events with the reason, back in the queue.
        reason = "reclaimed: team vision needs its quota back (job 99)"
        feed(page, {"type": "snapshot", "samples": [], "logs": [], "events": [], "checkpoints": [],
                    "job": {**queued, "status": "RUNNING", "borrowing": True, "queue_position": None,
                            "predicted_start_at": None}})
        assert page.is_visible("#job-borrowing") and page.is_hidden("#queue-stat")
        t = now.isoformat()
        preempted = f"preempted ({reason}); resumes from the checkpoint at step 40"
        served["job"] = {**queued, "queue_position": 1, "predicted_start_at": None, "borrowing": False,
                         "status_reason": preempted}
        feed(page, {"type": "event", "event": {"id": 10**9, "kind": "preempt_requested", "created_at": t,
                                               "message": f"preemption requested: {reason}", "attempt": None,
                                               "data": {"reason": reason, "for_job": 99, "grace_s": 60}}})
        feed(page, {"type": "event", "event": {
            "id": 10**9 + 1, "kind": "preempted", "created_at": t, "attempt": None,
            "message": f"preempted: {reason}; resumes from the checkpoint at step 40",
            "data": {"reason": reason, "resume_step": 40}}})
        feed(page, {"type": "status", "status": "QUEUED", "status_reason": preempted})
        wait_js(page, "() => document.querySelectorAll('#events li[data-kind^=preempt]').length === 2", 5,
                "the preemption events")
        for kind in ("preempt_requested", "preempted"):
            li = page.locator(f"#events li[data-kind={kind}]")
            assert "ev-warn" in li.get_attribute("class") and li.locator(".ev-kind.kb-warn").count() == 1
            assert reason in li.text_content()
        detail = page.locator("#events li[data-kind=preempt_requested] .ev-detail").text_content()
        assert detail == "for job 99 · grace 60.0 s"
        assert page.locator("#events li[data-kind=preempted] .ev-detail").text_content() == "resumes from step 40"
        assert page.get_attribute("#events li[data-kind=preempt_requested] .ev-detail a", "href") == "/jobs/99/"
        assert "preempt" in page.get_attribute("#job-reason", "class")
        assert page.text_content("#job-reason").startswith("preempted (reclaimed")
        assert page.is_visible("#queue-stat")
        wait_js(page, "() => window.trainyard.state.jobFetches >= 1 && "
                      "document.querySelector('#job-queue-pos').textContent === '#1'", 5, "the refreshed job")
        assert page.text_content("#job-eta") == "unknown" and page.is_hidden("#job-borrowing")
        assert page.text_content("#job-reason") == preempted
        screenshot(page, "screenshot-preempted.png")
        assert not page.js_errors, page.js_errors
    finally:
        if job is not None:
            api(cluster, "POST", f"/api/v1/jobs/{job['id']}/cancel/", {})
        for n in ("node-a", "node-b"):
            api(cluster, "POST", f"/api/v1/nodes/{n}/uncordon/", {})
        if job is not None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and cluster.job(job["id"])["status"] not in ("CANCELLED", "SUCCEEDED",
                                                                                           "FAILED"):
                time.sleep(0.2)
