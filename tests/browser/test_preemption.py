"""Issue 5 end to end with real processes: an admin lowers a team's quota on the quota page while
that team's job runs; the job becomes borrowing, another team's job within its quota reclaims the
capacity: the borrowing job checkpoints, exits (cooperative preemption), the other job starts and
finishes, and the preempted job resumes from its preemption checkpoint and finishes all its steps."""
from __future__ import annotations

import pytest

from tests.integration.cluster import Cluster

from .conftest import login
from .test_fault_ui import api, manage

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("preempt"))
    # The policy reclaims only when waiting for the borrower would take longer than this; the test
    # job's predicted run time is short, so reclaim at once.
    c.env["TRAINYARD_RECLAIM_WAIT_S"] = "0"
    try:
        c.start()
        yield c
    finally:
        c.stop()  # conftest's `browser` fixture runs against this module's cluster


def member(cluster, username: str, team: str) -> str:
    manage(cluster, "shell", "-c",
           "from django.contrib.auth.models import Group, User; "
           f"g, _ = Group.objects.get_or_create(name='{team}'); "
           f"u, _ = User.objects.get_or_create(username='{username}'); u.groups.add(g)")
    return manage(cluster, "api_token", username)


def spec(name: str, steps: int, nodes: int, procs: int) -> dict:
    return {"name": name, "model": {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 2, "seq_len": 64},
            "train": {"steps": steps, "global_batch": 16}, "resources": {"nodes": nodes, "procs_per_node": procs},
            "checkpoint": {"every_steps": 25, "keep": 3}}


def test_lowering_a_quota_from_the_ui_preempts_the_borrower_with_a_checkpoint(cluster, browser):
    vera, nick = member(cluster, "vera", "vision"), member(cluster, "nick", "nlp")
    status, body = api(cluster, "PUT", "/api/v1/quotas/", [{"team": "vision", "max_slots": 4},
                                                            {"team": "nlp", "max_slots": 2}])
    assert status == 200, body
    status, big = api(cluster, "POST", "/api/v1/jobs/", spec("vision-big", 400, 2, 2), token=vera)
    assert status == 201, big
    cluster.wait_for(lambda: cluster.get(f"/api/v1/jobs/{big['id']}/checkpoints/")["count"] > 0, 240,
                     "the vision job's first checkpoint")
    status, small = api(cluster, "POST", "/api/v1/jobs/", spec("nlp-small", 60, 1, 2), token=nick)
    assert status == 201, small
    cluster.wait_for(lambda: "waiting" in cluster.job(small["id"])["status_reason"], 30, "the nlp job to wait")
    assert cluster.job(big["id"])["borrowing"] is False  # within its quota of 4: nobody may reclaim

    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    base = f"http://127.0.0.1:{cluster.port}"
    login(page, base)
    page.goto(f"{base}/quotas/")
    row = page.locator('#quota-rows tr[data-kind="team"][data-name="vision"]')
    row.locator('input[name="max_slots"]').fill("2")
    with page.expect_response(lambda r: r.url.endswith("/api/v1/quotas/") and r.request.method == "PUT") as resp:
        row.locator("button[data-action=save]").click()
    assert resp.value.status == 200

    preempted = cluster.wait_for(lambda: (j := cluster.job(big["id"]))["attempts"][0]["outcome"] == "preempted" and j,
                                 120, "the vision job to be preempted")
    first = preempted["attempts"][0]
    assert "vision" in first["failure"]["message"] and "nlp" in first["failure"]["message"]
    ckpts = cluster.get(f"/api/v1/jobs/{big['id']}/checkpoints/?page_size=500")["results"]
    # the preemption checkpoint: saved at the step the attempt stopped, not an older periodic one
    assert max(c["step"] for c in ckpts) == first["last_step"], (ckpts, first)
    events = cluster.get(f"/api/v1/jobs/{big['id']}/events/?page_size=500")["results"]
    kinds = [e["kind"] for e in events]
    assert "preempt_requested" in kinds and "preempted" in kinds and "preempt_forced" not in kinds

    done_small = cluster.wait_status(small["id"], TERMINAL, 300)
    assert done_small["status"] == "SUCCEEDED", done_small
    done_big = cluster.wait_status(big["id"], TERMINAL, 400)
    assert done_big["status"] == "SUCCEEDED" and done_big["step"] == 400, done_big
    second = done_big["attempts"][1]
    assert second["resumed_from_step"] == first["last_step"]
    rows = cluster.metrics(big["id"])
    assert sorted((r["rank"], r["step"]) for r in rows) == [(k, s) for k in range(4) for s in range(1, 401)]
    page.goto(f"{base}/jobs/{big['id']}/")
    assert "preempted" in page.text_content("#events")
