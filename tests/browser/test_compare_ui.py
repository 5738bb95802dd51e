"""The compare page in Chromium against the real cluster: two real runs of the built-in GPT that
differ in their learning rate (and a job id that does not exist), /compare/?jobs=...: both loss
curves from the bucketed series, the legend's values, the spec diff with train.lr and name, the
identical fields collapsed, another metric and the time axis picked from the page."""
from __future__ import annotations

import pytest

from .test_dashboard import TERMINAL, wait_js
from .test_fault_ui import MODEL

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]

STEPS = 40


def test_compare_two_runs_overlays_their_curves_and_diffs_their_specs(page, base, cluster):
    jobs = [cluster.submit({"name": f"cmp-lr-{lr}", "model": MODEL, "train": {"steps": STEPS, "global_batch": 8,
                                                                             "lr": lr}})
            for lr in (1e-3, 3e-2)]
    for j in jobs:
        assert cluster.wait_status(j["id"], TERMINAL, 240)["status"] == "SUCCEEDED", cluster.logs()
    a, b = (j["id"] for j in jobs)
    api = cluster.get(f"/api/v1/series/?jobs={a},{b}&metric=loss")
    assert [len(s["buckets"]) for s in api["series"]] == [STEPS, STEPS], api  # fewer steps than points: exact

    page.goto(f"{base}/compare/?jobs={a},{b},999999")
    wait_js(page, "() => document.body.dataset.compareReady === '1'", 30, "the compare page's first series")
    assert page.get_attribute("#compare-chart", "data-curves") == "2"
    assert page.input_value("#compare-metric") == "loss"
    options = page.eval_on_selector_all("#compare-metric option", "os => os.map(o => o.value)")
    assert {"loss", "step_s", "samples_per_s"} <= set(options)
    # Each curve is every step of its job (the bucket's last value), labelled with the job.
    drawn = page.evaluate("() => window.trainyardCompare.chart.seriesSteps()")
    assert [d["label"] for d in drawn] == [f"#{a} cmp-lr-0.001", f"#{b} cmp-lr-0.03"]
    assert [d["steps"] for d in drawn] == [[bk["x"] for bk in s["buckets"]] for s in api["series"]]
    # The legend: a colour each, status, and the last value the API gives.
    for s in api["series"]:
        row = page.locator(f"#compare-legend tr[data-job='{s['job']}']")
        assert row.locator(".status").inner_text() == "SUCCEEDED"
        assert float(row.locator(".cmp-last").inner_text()) == pytest.approx(s["buckets"][-1]["last"], rel=1e-3)
    colours = page.eval_on_selector_all("#compare-legend .swatch", "s => s.map(x => getComputedStyle(x).backgroundColor)")
    assert len(set(colours)) == 2
    assert "999999" in page.inner_text("#compare-missing")

    # The spec diff: what differs on top, by dotted path; the rest collapsed.
    diff = page.eval_on_selector_all("#spec-diff tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.innerText))")
    assert diff == [["name", "cmp-lr-0.001", "cmp-lr-0.03"], ["train.lr", "0.001", "0.03"]]
    assert not page.locator("#spec-same").evaluate("d => d.open")
    assert page.locator("#spec-same tr[data-path='model.hidden']").count() == 1
    page.click("#spec-same summary")
    assert page.locator("#spec-same tr[data-path='train.steps'] td").nth(1).inner_text() == str(STEPS)

    # Another metric, then against time: new series read, the URL says what is shown.
    fetches = page.evaluate("() => window.trainyardCompare.state.fetches")
    page.select_option("#compare-metric", "step_s")
    wait_js(page, f"() => window.trainyardCompare.state.fetches > {fetches}", 15, "the step_s series")
    assert page.get_attribute("#compare-chart", "data-curves") == "2"
    page.select_option("#compare-x", "time")
    wait_js(page, f"() => window.trainyardCompare.state.fetches > {fetches + 1}", 15, "the series over time")
    drawn = page.evaluate("() => window.trainyardCompare.chart.seriesSteps()")
    assert len(drawn) == 2 and all(d["steps"][0] == 0 and d["steps"][-1] > 0 for d in drawn)  # seconds since start
    assert "metric=step_s" in page.url and "x=time" in page.url
    page.reload()
    wait_js(page, "() => document.body.dataset.compareReady === '1'", 30, "the page again")
    assert page.input_value("#compare-metric") == "step_s" and page.input_value("#compare-x") == "time"
    assert not page.js_errors, page.js_errors
