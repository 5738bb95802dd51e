"""The job page's profile panel in Chromium, against the real cluster: a communication-heavy job of a
non-staff owner shows communication-bound with its shares, the recommendation and its predicted
gain; the owner's Apply button restarts it from its latest checkpoint with the change."""
from __future__ import annotations

import pytest

from tests.integration.test_profiling import COMM_HEAVY, _carries

from .conftest import login, screenshot
from .test_dashboard import TERMINAL, wait_js
from .test_fault_ui import manage

pytestmark = [pytest.mark.procs, pytest.mark.timeout(900)]
CAROL_PASSWORD = "carol-pw-12345"


def test_owner_sees_the_profile_and_applies_the_recommendation(browser, base, cluster):
    manage(cluster, "shell", "-c",
           "from django.contrib.auth import get_user_model; U = get_user_model(); "
           f"U.objects.filter(username='carol').exists() or U.objects.create_user('carol', password='{CAROL_PASSWORD}')")
    token = manage(cluster, "api_token", "carol").splitlines()[-1]
    status, job = cluster.request("POST", "/api/v1/jobs/", {**COMM_HEAVY, "name": "carol-comm"}, token=token)
    assert status == 201, job
    jid = job["id"]
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    ctx.set_default_timeout(30_000)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        login(page, base, "carol", CAROL_PASSWORD)
        page.goto(f"{base}/jobs/{jid}/")
        wait_js(page, "() => window.trainyard && window.trainyard.socket.stats.snapshots >= 1", 30, "the snapshot")
        # the class arrives live (a `profile` message or the job refresh); the button once a checkpoint exists
        wait_js(page, "() => document.querySelector('#profile-card').dataset.class === 'communication'"
                      " && !document.querySelector('#profile-card .profile-apply').hidden", 300,
                "the panel to show communication-bound with an Apply button")
        cluster.wait_for(lambda: cluster.get(f"/api/v1/jobs/{jid}/checkpoints/")["count"] >= 1, 120,
                         "a first checkpoint")
        card = page.locator("#profile-card")
        assert card.locator(".profile-class").inner_text() == "communication-bound"
        assert card.locator("[data-share=communication] b").inner_text().endswith("%")
        change = cluster.job(jid)["profile"]["recommendation"]["change"]
        said = " ".join(f"{k} {v}" for k, v in change.items())
        assert f"set {', '.join(f'{k} {v}' for k, v in change.items())}" in card.locator(".profile-text").inner_text()
        assert card.locator(".profile-gain").inner_text().startswith("predicted ")
        screenshot(page, "screenshot-profile.png")
        card.locator(".profile-apply").click()
        wait_js(page, "() => /^Applied/.test(document.querySelector('#profile-card .profile-note').textContent)",
                30, "the apply confirmation")
        note = card.locator(".profile-note").inner_text()
        assert all(f"{k} {v}" in note for k, v in change.items()), (note, said)
        wait_js(page, "() => [...document.querySelectorAll('#events li')].some(li => "
                      "li.dataset.kind === 'recommendation_applied')", 30, "the event in the timeline")

        def restarted():
            j = cluster.job(jid)
            return len(j["attempts"]) == 2 and j["attempts"][1]["status"] == "RUNNING" and j
        j = cluster.wait_for(restarted, 180, "the second attempt to run")
        assert _carries(j["spec"], change) and j["attempts"][1]["resumed_from_step"] >= 20
        wait_js(page, "() => document.querySelectorAll('#attempts-body tr[data-attempt]').length === 2", 30,
                "the second attempt on the page")
        assert errors == []
    finally:
        ctx.close()
        cluster.request("POST", f"/api/v1/jobs/{jid}/cancel/", {})
        cluster.wait_status(jid, TERMINAL, 120)
