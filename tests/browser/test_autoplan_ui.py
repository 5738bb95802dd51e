"""parallel: auto in the browser (Chromium via Playwright, one real Trainyard): the submit page
previews the planner's plan live as the spec is edited, and an auto job's page shows the chosen
plan's prediction next to what the running job measures."""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]

GPT = {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256}


def wait_text(page, selector: str, predicate, timeout_ms: int = 30_000) -> str:
    for _ in range(timeout_ms // 250):
        loc = page.locator(selector)
        if loc.count():
            text = loc.first.inner_text()
            if predicate(text):
                return text
        page.wait_for_timeout(250)
    raise AssertionError(f"{selector}: never satisfied; last {page.locator(selector).all_inner_texts()}")


def test_the_submit_page_previews_the_plan_as_the_spec_changes(page, base):
    page.goto(f"{base}/jobs/new/")
    page.fill("#id_spec", json.dumps({"name": "preview", "model": GPT, "parallel": "auto",
                                      "resources": {"nodes": 2, "procs_per_node": 1},
                                      "train": {"global_batch": 16}}))
    first = wait_text(page, "#plan-preview-best", lambda t: "dp" in t)
    assert "dp 2" in first and "a step" in first, first
    assert page.locator("#plan-preview").get_attribute("data-state") == "ok"
    # more processes: the preview follows the edit of a field (which rewrites the spec text)
    page.fill("[data-path='resources.procs_per_node']", "2")
    second = wait_text(page, "#plan-preview-best", lambda t: t != first)
    assert "dp 4" in second or "tp 2" in second or "pp 2" in second, second
    # a shape the planner cannot split: the field error shows instead of a plan
    page.fill("#id_spec", json.dumps({"name": "bad", "model": {**GPT, "heads": 3}, "parallel": "auto"}))
    err = wait_text(page, "#plan-preview-error", bool)
    assert "model" in err and page.locator("#plan-preview").get_attribute("data-state") == "error"
    # user code: nothing to plan, the card hides
    page.fill("#id_spec", "name: mine\nentrypoint: {module: mypkg.train}\n")
    page.wait_for_timeout(1500)
    assert page.locator("#plan-preview").is_hidden()
    assert page.js_errors == []


def test_an_auto_job_page_shows_predicted_next_to_measured(page, base, cluster):
    job = cluster.submit({"name": "auto-ui", "model": GPT, "parallel": "auto", "data": {"kind": "demo"},
                          "resources": {"nodes": 2, "procs_per_node": 1},
                          "train": {"global_batch": 16, "steps": 60}, "checkpoint": {"every_steps": 1000}})
    assert job["plan"]["auto"]["chosen"]["step_time_s"] > 0, job["plan"]
    page.goto(f"{base}/jobs/{job['id']}/")
    assert "Chosen by the planner" in page.inner_text("#plan-auto")
    predicted = page.inner_text("#plan-pred-step")
    measured = wait_text(page, "#plan-meas-step", lambda t: t.strip() not in ("", "–"), 180_000)
    assert measured.endswith("s") and predicted.endswith("s"), (predicted, measured)
    assert page.inner_text("#plan-meas-tflops").strip() not in ("", "–")
    assert page.js_errors == []
    done = cluster.wait_status(job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, 240)
    assert done["status"] == "SUCCEEDED", (done, cluster.logs())  # the planner's plan ran as the runtime's
