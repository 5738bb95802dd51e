"""The experiment page in Chromium against the real cluster: a 3-trial random search over the built-in
GPT's learning rate with ASHA, two trials at once. While it runs the page fills its trial table, the
overlaid curves and parallel coordinates from the API and appends points live from the running
trials' job sockets; when it ends the tiny-lr trials are shown early-stopped (and can be continued),
the best trial is marked, and "Submit best as a job" submits its spec as a plain job."""
from __future__ import annotations

import pytest

from tests.integration.test_experiments import GOOD, SEARCH as INTEGRATION_SEARCH, TEMPLATE, TINY

from .test_dashboard import wait_js

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]

# The integration test's search (seed 4 draws GOOD, TINY, TINY first; reduction 8 keeps only the
# leader at the rung at step 20), three trials of it.
SEARCH = {**INTEGRATION_SEARCH, "max_trials": 3}


def test_experiment_page_shows_trials_curves_and_parallel_coordinates_live(page, base, cluster):
    status, e = cluster.request("POST", "/api/v1/experiments/", {"name": "ui-lr", "spec": TEMPLATE, "search": SEARCH})
    assert status == 201, e
    eid = e["id"]
    page.goto(f"{base}/experiments/{eid}/")
    wait_js(page, "() => document.getElementById('experiment-app').dataset.ready === '1'", 30, "the first render")
    assert page.locator("#experiment-static").is_hidden()  # the script's table replaces the server's

    # live: points from a running trial's socket, before the experiment ends
    wait_js(page, "() => window.trainyardExperiment.state.livePoints > 0", 240, "a live point from a trial's socket")

    def api():
        return cluster.get(f"/api/v1/experiments/{eid}/")

    cluster.wait_for(lambda: api()["status"] not in ("running",), 420, "the experiment's end")
    final = api()
    assert final["status"] == "succeeded", final
    # the page catches up on its next poll
    wait_js(page, "() => document.getElementById('experiment-app').dataset.status === 'succeeded' "
                  "&& document.getElementById('experiment-app').dataset.trials === '3'", 30, "the final state")
    rows = page.eval_on_selector_all("#exp-trials tbody tr", "rs => rs.map(r => [Number(r.dataset.job), r.dataset.status])")
    assert sorted(map(tuple, rows)) == sorted((t["job"], t["status"]) for t in final["trials"])
    stopped = [t for t in final["trials"] if t["status"] == "early_stopped"]
    assert stopped and all(t["values"]["train.lr"] == TINY for t in stopped), final
    assert final["best"]["values"]["train.lr"] == GOOD
    best = final["best"]["job"]
    assert page.locator("#exp-trials tbody tr.best").get_attribute("data-job") == str(best)
    # an early-stopped trial offers to continue from its checkpoint (the owner is looking)
    assert page.locator(f"#exp-trials tr[data-job='{stopped[0]['job']}'] button.exp-continue").count() == 1
    assert f"#{best}" in page.inner_text("#exp-best-text")

    # every trial that reported has a curve; one line per trial in the parallel coordinates
    reported = [t for t in final["trials"] if t["metric"] is not None]
    wait_js(page, f"() => Number(document.getElementById('exp-curves').dataset.curves) === {len(reported)}", 60,
            "a curve per trial that reported")
    lines = page.eval_on_selector_all("#exp-parcoords-plot polyline.trial", "ls => ls.map(l => Number(l.dataset.job))")
    assert sorted(lines) == sorted(t["job"] for t in final["trials"])
    assert page.locator("#exp-parcoords-plot [data-axis='train.lr']").count() == 1

    # the best trial's spec submitted as a plain job
    page.click("#exp-submit-best")
    wait_js(page, "() => window.trainyardExperiment.state.submitted", 30, "the submitted job")
    new = page.evaluate("() => window.trainyardExperiment.state.submitted")
    job = cluster.get(f"/api/v1/jobs/{new}/")
    assert job["spec"]["train"]["lr"] == GOOD and job["experiment"] is None
    cluster.request("POST", f"/api/v1/jobs/{new}/cancel/")
    assert not page.js_errors, page.js_errors
