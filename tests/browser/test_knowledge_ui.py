"""The knowledge-base page (issue 13) in a real browser against a real cluster: a short demo-GPT
job on both nodes finishes, and /knowledge/ (reached from the nav bar) lists its configuration
with the measured step time the API reports, memory, throughput, and the best plan for its
shape; the filter form narrows the table and names a bad value."""
from __future__ import annotations

import pytest

from .conftest import screenshot

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def test_the_knowledge_page_lists_a_finished_job(page, base, cluster):
    job = cluster.submit({"name": "kb-ui", "train": {"steps": 20, "global_batch": 32},
                          "resources": {"nodes": 2, "procs_per_node": 1}})
    done = cluster.wait_status(job["id"], TERMINAL, 300)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())
    rec = cluster.wait_for(lambda: next((r for r in cluster.get("/api/v1/knowledge/")["results"]
                                         if r["job"] == job["id"] and r["measured"]["warm_steps"] == 17), None),
                           60, "the job's knowledge record")

    page.goto(f"{base}/")
    page.click('nav a[href="/knowledge/"]')
    page.wait_for_url(f"{base}/knowledge/")
    assert page.locator('nav a[href="/knowledge/"].active').count() == 1
    row = page.locator(f'#knowledge-table tr[data-job="{job["id"]}"]')
    assert row.count() == 1
    text = row.inner_text()
    assert f"{job['id']} · kb-ui" in text and "gpt 4×128, 4 heads, seq 128" in text and "2×1 cpu" in text
    assert "dp 2, micro-batch 16" in text
    step_ms = f"{rec['measured']['step_time_s'] * 1000:.1f} ms"
    assert row.locator('[data-col="step"]').inner_text().startswith(step_ms)
    assert row.locator('[data-col="mem"]').inner_text().endswith(("MB", "GB"))
    # the spec chose this plan; the planner's prediction for it sits beside the measurement
    assert row.locator('[data-col="pred-step"]').inner_text() == f"{rec['predicted']['step_time_s'] * 1000:.1f} ms"
    best = page.locator("#knowledge-best tbody tr", has_text="gpt 4×128, 4 heads")
    assert best.count() == 1 and "dp 2" in best.inner_text()
    screenshot(page, "screenshot-knowledge.png")
    with page.expect_navigation():
        row.locator(f'a[href="/jobs/{job["id"]}/"]').click()
    assert page.url == f"{base}/jobs/{job['id']}/"

    # the filter form: another kind hides it; a bad number is named next to the form
    page.goto(f"{base}/knowledge/")
    page.select_option('#knowledge-filters select[name="kind"]', "mlp")
    with page.expect_navigation():
        page.click('#knowledge-filters button[type="submit"]')
    assert page.url.endswith("kind=mlp&device=&layers=&hidden=")
    assert page.locator(f'#knowledge-table tr[data-job="{job["id"]}"]').count() == 0
    assert "No measured configurations yet" in page.locator("#knowledge-table").inner_text()
    page.select_option('#knowledge-filters select[name="kind"]', "")
    page.fill('#knowledge-filters input[name="layers"]', "0")
    with page.expect_navigation():
        page.click('#knowledge-filters button[type="submit"]')
    assert "layers: must be a whole number from 1" in page.locator('.field-error[data-field="layers"]').inner_text()
    assert page.js_errors == []
