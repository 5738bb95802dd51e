"""The live dashboard in a real browser (issue 3, section 2): log in, submit from the form, watch the
charts fill over the websocket with no metric polling, see SUCCEEDED without reloading, reload mid-run
without duplicate points, cancel from the job page, inline spec errors, phone-width layout."""
from __future__ import annotations

import json
import re
import time

import pytest

from .conftest import PASSWORD, login, screenshot

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]

SMALL_MODEL = {"model.layers": 2, "model.hidden": 64, "model.heads": 4, "model.seq_len": 64}
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def points(page, chart: str = "loss") -> int:
    return int(page.get_attribute(f"#chart-{chart}", "data-points") or 0)


def wait_js(page, expr: str, timeout_s: float, what: str):
    try:
        return page.wait_for_function(expr, timeout=timeout_s * 1000)
    except Exception as exc:  # Playwright's TimeoutError: say what we waited for and what the page had
        state = page.evaluate("() => window.trainyard ? {status: document.body.dataset.jobStatus, "
                              "sock: window.trainyard.socket.stats, live: document.querySelector('#live-indicator')"
                              "?.dataset.state} : null")
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; page state: {state}") from exc


def chart_stats(page) -> dict:
    return page.evaluate("""() => {
        const s = window.trainyard.stats();
        const out = {};
        for (const [rank, v] of Object.entries(s)) out[rank] = {points: v.points, distinct: v.distinct, min: v.min,
                                                                max: v.max, steps: v.steps};
        return {ranks: out, downsampled: window.trainyard.store.downsampled,
                loss: window.trainyard.chartSteps('loss')};
    }""")


def assert_no_duplicates_or_gaps(stats: dict, world: int) -> None:
    assert len(stats["ranks"]) == world, stats["ranks"].keys()
    for rank, s in stats["ranks"].items():
        assert s["points"] == s["distinct"], f"rank {rank}: {s['points']} points for {s['distinct']} steps"
        if not stats["downsampled"]:
            assert s["min"] == 1, f"rank {rank} starts at step {s['min']}"
            assert s["points"] == s["max"] - s["min"] + 1, f"rank {rank} has gaps: {s['steps']}"
    for series in stats["loss"]:  # what uPlot actually draws
        assert len(series["steps"]) == len(set(series["steps"])), series["label"]


def test_sample_store_merges_by_key_and_stays_bounded(page, base):
    """static/js/store.js in the browser: the merge rules the charts rely on."""
    page.goto(f"{base}/jobs/")
    result = page.evaluate("""async () => {
        const { SampleStore } = await import('/static/js/store.js');
        const mk = (attempt, rank, step) => ({ attempt, rank, step, loss: 1 / step, samples_per_s: 10 + rank });
        const range = (a, b) => Array.from({ length: b - a + 1 }, (_, i) => a + i);
        const both = (attempt, steps) => steps.flatMap((s) => [mk(attempt, 0, s), mk(attempt, 1, s)]);
        const out = {};
        const s = new SampleStore({ maxSteps: 100 });
        s.merge(both(7, range(1, 40)));
        s.merge(both(7, range(1, 40)));                         // the same again: a snapshot after a reconnect
        out.afterReplay = { steps: s.steps.length, points: s.stats()[0].points, distinct: s.stats()[0].distinct };
        s.merge([mk(7, 0, 41)]);
        out.partialSum = s.sumColumn('samples_per_s', 2).slice(-2); // step 41 lacks rank 1
        s.merge(both(9, range(31, 35)));                        // attempt 9 resumed from step 30
        s.merge([mk(7, 1, 42)]);                                // late tail of attempt 7: stale
        const attempts = new Set();
        for (const row of s.rows.values()) for (const x of row.values()) attempts.add(x.attempt);
        out.resumed = { last: s.lastStep, attempts: [...attempts].sort((a, b) => a - b),
                        at31: s.rows.get(31).get(1).attempt, at30: s.rows.get(30).get(1).attempt };
        s.merge(both(9, range(36, 400)));
        const st = s.stats();
        out.bounded = { steps: s.steps.length, last: s.lastStep, downsampled: s.downsampled,
                        distinct: st[0].points === st[0].distinct && st[1].points === st[1].distinct };
        return out;
    }""")
    assert result["afterReplay"] == {"steps": 40, "points": 40, "distinct": 40}
    assert result["partialSum"] == [21, None]
    assert result["resumed"] == {"last": 35, "attempts": [7, 9], "at31": 9, "at30": 7}
    assert result["bounded"]["steps"] <= 100 and result["bounded"]["last"] == 400
    assert result["bounded"]["downsampled"] and result["bounded"]["distinct"]


def test_login_page_and_live_cluster_overview(browser, base):
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    try:
        page.goto(f"{base}/jobs/")
        assert "/accounts/login/" in page.url  # pages need a login
        login(page, base, password="wrong-password")
        assert "/accounts/login/" in page.url and page.locator(".errors").count() == 1
        login(page, base, password=PASSWORD)
        assert page.url == f"{base}/"
        # The overview goes live over /ws/cluster/: both agents' cards with their slots.
        wait_js(page, "() => document.querySelector('#live-indicator').dataset.state === 'live'", 30, "cluster socket")
        wait_js(page, "() => document.querySelectorAll('#nodes .node').length === 2", 30, "two node cards")
        assert page.locator("#nodes .node .slot").count() == 4
        assert "2/2 ready" in page.text_content("#nodes-summary")
    finally:
        ctx.close()


def test_spec_fields_sync_and_inline_errors(page, base):
    page.goto(f"{base}/jobs/new/")
    spec = json.loads(page.input_value("#id_spec"))
    assert spec["name"] == "gpt-demo" and page.input_value("[data-path='model.layers']") == str(spec["model"]["layers"])
    # a select of a Literal sends its string, a bool field a JSON boolean; "default" removes the key
    page.select_option("[data-path='parallel.recompute']", "full")
    page.select_option("[data-path='parallel.shard_optimizer']", "true")
    assert json.loads(page.input_value("#id_spec"))["parallel"] == {"recompute": "full", "shard_optimizer": True}
    page.select_option("[data-path='parallel.shard_optimizer']", "")
    page.select_option("[data-path='parallel.recompute']", "")
    assert "parallel" not in json.loads(page.input_value("#id_spec"))
    page.fill("#id_spec", json.dumps({**spec, "parallel": {"shard_optimizer": False}}))  # text -> the field
    page.wait_for_function("() => document.querySelector(\"[data-path='parallel.shard_optimizer']\").value === 'false'")
    page.fill("#id_spec", json.dumps(spec))
    # fields -> text, in the text's own format (YAML here)
    page.click("#format-toggle button[data-format=yaml]")
    assert "model: {" in page.input_value("#id_spec")
    page.fill("[data-path='model.layers']", "3")
    assert re.search(r"layers: 3\b", page.input_value("#id_spec"))
    # text -> fields
    page.fill("#id_spec", "name: typed\ntrain: {steps: 77}\n")
    page.wait_for_function("() => document.querySelector(\"[data-path='train.steps']\").value === '77'")
    assert page.input_value("[data-path='name']") == "typed" and page.input_value("[data-path='model.layers']") == ""
    # An entrypoint spec (the user's own code) turns the built-in model and data fields off, and back on.
    page.fill("#id_spec", "name: mine\nentrypoint: {module: mypkg.train}\n")
    page.wait_for_function("() => document.querySelector('fieldset[data-group=model]').disabled")
    assert page.locator("[data-path='data.kind']").is_disabled()  # a control inside the disabled fieldset
    assert page.locator("[data-path='model.layers']").is_disabled()
    assert page.locator("[data-path='train.steps']").is_enabled()
    page.fill("#id_spec", "name: typed\ntrain: {steps: 77}\n")
    page.wait_for_function("() => !document.querySelector('fieldset[data-group=model]').disabled")
    assert page.locator("[data-path='data.kind']").is_enabled()

    # A field error sits next to its field, the page answers 400 and keeps what was typed.
    page.fill("#id_spec", json.dumps({"name": "bad", "model": {"layers": 0}, "train": {"steps": 10}}))
    with page.expect_response(lambda r: r.request.method == "POST" and r.url.endswith("/jobs/new/")) as resp:
        page.click("#submit-button")
    assert resp.value.status == 400
    field = page.locator(".field[data-field='model.layers']")
    assert "greater than or equal to 1" in field.locator(".field-error").text_content()
    assert field.locator("input").get_attribute("aria-invalid") == "true"
    assert field.locator("input").input_value() == "0"
    assert json.loads(page.input_value("#id_spec"))["model"]["layers"] == 0

    # An error with no field of its own (unparseable text) is listed above the form.
    page.fill("#id_spec", "{not json: [")
    with page.expect_response(lambda r: r.request.method == "POST" and r.url.endswith("/jobs/new/")) as resp:
        page.click("#submit-button")
    assert resp.value.status == 400
    assert "neither valid JSON nor YAML" in page.text_content("#spec-errors")
    assert not page.js_errors, page.js_errors


def test_submit_from_form_charts_fill_live_until_succeeded(page, base, cluster):
    page.goto(f"{base}/jobs/new/")
    page.fill("[data-path='name']", "browser-demo")
    for path, value in {**SMALL_MODEL, "train.steps": 150, "train.global_batch": 16}.items():
        page.fill(f"[data-path='{path}']", str(value))
    spec = json.loads(page.input_value("#id_spec"))
    assert spec["model"]["hidden"] == 64 and spec["train"]["steps"] == 150 and spec["resources"]["nodes"] == 2

    after_load: list[tuple[str, str]] = []
    watching = {"on": False}
    page.on("request", lambda r: watching["on"] and after_load.append((r.method, r.url)))
    navigations: list[str] = []
    page.on("framenavigated", lambda f: f == page.main_frame and navigations.append(f.url))
    with page.expect_navigation():
        page.click("#submit-button")
    page.wait_for_load_state("load")
    m = re.search(r"/jobs/(\d+)/$", page.url)
    assert m, page.url
    job_id = int(m.group(1))
    watching["on"] = True
    navigations.clear()
    t0 = time.monotonic()
    page.evaluate("""() => { window.__points = []; const c = document.querySelector('#chart-loss');
        new MutationObserver(() => window.__points.push(+c.dataset.points))
            .observe(c, { attributes: true, attributeFilter: ['data-points'] }); }""")

    # Points arrive over the socket: the loss chart grows while the page stays put.
    wait_js(page, "() => +document.querySelector('#chart-loss').dataset.points > 0", 150, "the first loss points")
    first = points(page)
    wait_js(page, "() => document.body.dataset.jobStatus === 'SUCCEEDED'", 180, "SUCCEEDED on the page")
    assert page.evaluate("() => window.trainyard.socket.stats.byType.telemetry") > 0
    elapsed = time.monotonic() - t0
    assert page.text_content("#job-status").strip() == "SUCCEEDED"
    assert not navigations, f"the page navigated: {navigations}"

    # No polling: after load the page asked for no metrics and nothing but the job itself, once per
    # status message (to refresh attempts) or event that changes the job (a straggler flagged, ...).
    wait_js(page, "() => window.trainyard.state.jobFetches >= 1", 10, "the attempts refresh")
    page.wait_for_timeout(500)
    status_msgs = page.evaluate("() => window.trainyard.state.statusMessages + window.trainyard.state.eventRefreshes")
    non_static = [(m_, u) for m_, u in after_load if "/static/" not in u]
    assert not [u for _, u in non_static if "/metrics" in u], non_static
    # Once finished, the log panel loads the kept logs' newest page (one or two GETs, never a poll).
    kept = [(m_, u) for m_, u in non_static if u.startswith(f"{base}/api/v1/jobs/{job_id}/logs/?")]
    assert 1 <= len(kept) <= 2 and all(m_ == "GET" for m_, _ in kept), kept
    non_static = [x for x in non_static if x not in kept]
    assert all(m_ == "GET" and u == f"{base}/api/v1/jobs/{job_id}/" for m_, u in non_static), non_static
    assert len(non_static) <= status_msgs, (non_static, status_msgs)

    # Every step of both ranks, once each, the same as the database holds.
    wait_js(page, "() => +document.querySelector('#chart-loss').dataset.points === 300", 30, "all 150 steps of both ranks")
    assert first < 300, f"the chart had {first} points at first sight: nothing was seen arriving live"
    seen = sorted(set(page.evaluate("() => window.__points")))
    assert len(seen) >= 3 and seen[-1] == 300, f"the loss chart did not grow in steps: {seen}"
    stats = chart_stats(page)
    assert_no_duplicates_or_gaps(stats, world=2)
    db: dict[int, set[int]] = {}
    for s in cluster.metrics(job_id):
        db.setdefault(s["rank"], set()).add(s["step"])
    assert {int(r): set(s["steps"]) for r, s in stats["ranks"].items()} == db
    for chart in ("throughput", "breakdown", "ranks", "bytes"):
        assert points(page, chart) > 0, chart

    # The rest of the page followed along: attempts (ranks on both nodes), events, logs, header.
    wait_js(page, "() => document.querySelector('#attempts-body').textContent.includes('succeeded')", 15,
            "the attempt outcome")
    attempts = page.text_content("#attempts-body")
    assert "node-a" in attempts and "node-b" in attempts
    # The plan: the card says what dp means; each rank's role and the bytes it holds (its
    # rank_plan event, through the relay and the job JSON the page re-renders the attempts from).
    assert "data parallel replicas" in page.text_content("#plan-card")
    wait_js(page, "() => document.querySelectorAll('#attempts-body .rank-role').length === 2", 15, "the ranks' roles")
    roles = page.eval_on_selector_all("#attempts-body .rank-role", "els => els.map(e => e.textContent)")
    assert all("the whole model · params" in r and "optim" in r for r in roles), roles
    assert "succeeded" in page.text_content("#events")
    assert page.evaluate("() => window.trainyard.logs.total") > 0
    assert page.text_content("#job-step").strip() == "150 / 150"
    assert page.locator("#cancel-form").count() == 0 or page.locator("#cancel-form").is_hidden()
    # The checkpoints table shows what the API lists (default checkpoint.every_steps: 50).
    api_steps = [c["step"] for c in cluster.get(f"/api/v1/jobs/{job_id}/checkpoints/")["results"]]
    wait_js(page, f"() => document.querySelectorAll('#checkpoints-body tr[data-checkpoint]').length === {len(api_steps)}",
            15, "the checkpoints table")
    assert page.evaluate("() => [...document.querySelectorAll('#checkpoints-body tr[data-checkpoint]')]"
                         ".map(r => +r.dataset.step)") == api_steps
    if not api_steps:
        assert page.text_content("#checkpoints-body").strip() == "No checkpoints yet."
    sock = page.evaluate("() => window.trainyard.socket.stats")
    unsequenced = sock["byType"].get("pong", 0) + sock["byType"].get("error", 0)
    assert sock["acks"] == sock["messages"] - unsequenced and sock["byType"].get("error", 0) == 0, sock
    assert not page.js_errors, page.js_errors
    print(f"job {job_id}: first point to SUCCEEDED in {elapsed:.1f} s, {points(page)} loss points")
    screenshot(page, "screenshot-job.png")


def test_reload_mid_run_then_cancel_from_the_page(page, context, base, cluster):
    overview = context.new_page()
    overview.goto(f"{base}/")
    wait_js(overview, "() => document.querySelector('#live-indicator').dataset.state === 'live'", 30, "cluster socket")

    job = cluster.submit({"name": "browser-long", "model": {k.split(".")[1]: v for k, v in SMALL_MODEL.items()},
                          "train": {"steps": 20000, "global_batch": 16}})
    job_id = job["id"]
    # The overview shows it without a reload (cluster socket), first queued or running.
    wait_js(overview, f"() => !!document.querySelector('#running tr[data-job=\"{job_id}\"], #queue tr[data-job=\"{job_id}\"]')",
            30, "the new job on the overview")

    page.goto(f"{base}/jobs/{job_id}/")
    wait_js(page, "() => Object.values(window.trainyard.stats()).filter(s => s.points >= 15).length === 2", 150,
            "15 steps of both ranks")
    wait_js(overview, f"() => !!document.querySelector('#running tr[data-job=\"{job_id}\"]')", 30,
            "the job among the running ones")
    screenshot(overview, "screenshot-cluster.png")

    # Reload mid-run: the snapshot and the live stream meet without gaps or duplicates.
    page.reload()
    wait_js(page, "() => window.trainyard && window.trainyard.socket.stats.snapshots >= 1", 30, "the snapshot")
    resumed = page.evaluate("() => window.trainyard.store.lastStep")
    wait_js(page, f"() => Object.values(window.trainyard.stats()).every(s => s.max >= {resumed + 15})", 60,
            "live steps after the snapshot")
    assert page.evaluate("() => window.trainyard.socket.stats.byType.telemetry") > 0
    assert_no_duplicates_or_gaps(chart_stats(page), world=2)

    # A server restart: the page says so, reconnects with backoff, merges the new snapshot, goes on.
    snapshots = page.evaluate("() => window.trainyard.socket.stats.snapshots")
    cluster.kill_proc("web")
    wait_js(page, "() => document.querySelector('#live-indicator').dataset.state === 'reconnecting'", 10,
            "the reconnecting indicator")
    cluster.start_proc("web")
    wait_js(page, f"() => window.trainyard.socket.stats.snapshots > {snapshots} && "
                  "document.querySelector('#live-indicator').dataset.state === 'live'", 40, "a reconnect")
    resumed = page.evaluate("() => window.trainyard.store.lastStep")
    wait_js(page, f"() => Object.values(window.trainyard.stats()).every(s => s.max >= {resumed + 10})", 60,
            "live steps after the reconnect")
    assert_no_duplicates_or_gaps(chart_stats(page), world=2)

    # Cancel from the page: one POST (form + CSRF), then STOPPING -> CANCELLED arrive live.
    navigations: list[str] = []
    with page.expect_navigation():
        page.click("#cancel-form button")
    assert page.url == f"{base}/jobs/{job_id}/"
    page.on("framenavigated", lambda f: f == page.main_frame and navigations.append(f.url))
    assert "Cancel requested" in page.text_content("main")
    wait_js(page, "() => document.body.dataset.jobStatus === 'CANCELLED'", 90, "CANCELLED on the page")
    assert not navigations, navigations
    assert page.locator("#cancel-form").count() == 0 or page.locator("#cancel-form").is_hidden()
    wait_js(page, "() => document.querySelector('#attempts-body').textContent.includes('cancelled')", 15,
            "the attempt outcome")
    assert cluster.job(job_id)["status"] == "CANCELLED"
    wait_js(overview, f"() => !document.querySelector('#running tr[data-job=\"{job_id}\"]')", 30,
            "the job gone from the running list")
    errors = [e for e in page.js_errors if not e.startswith("WebSocket connection to")]  # the restart's refusals
    assert not errors, errors
    overview.close()


def _finished_job(cluster) -> int:
    jobs = cluster.get("/api/v1/jobs/")["results"]
    done = [j for j in jobs if j["status"] == "SUCCEEDED"]
    if done:
        return done[0]["id"]
    job = cluster.submit({"name": "phone", "model": {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 32},
                          "train": {"steps": 20, "global_batch": 8}})
    assert cluster.wait_status(job["id"], TERMINAL, 180)["status"] == "SUCCEEDED"
    return job["id"]


def test_phone_width_pages_do_not_overflow(browser, context, base, cluster):
    job_id = _finished_job(cluster)
    phone = browser.new_context(viewport={"width": 390, "height": 844}, storage_state=context.storage_state(),
                                is_mobile=True, has_touch=True)
    page = phone.new_page()
    try:
        for path in (f"/jobs/{job_id}/", "/", "/jobs/", "/jobs/new/", "/nodes/"):
            page.goto(f"{base}{path}")
            if path.startswith("/jobs/") and path != "/jobs/" and path != "/jobs/new/":
                wait_js(page, "() => +document.querySelector('#chart-loss').dataset.points > 0", 30, "the charts")
                widest = page.evaluate("() => Math.max(...[...document.querySelectorAll('canvas')]"
                                       ".map(c => c.getBoundingClientRect().right))")
                assert widest <= 390, f"a chart reaches x={widest}"
                screenshot(page, "screenshot-job-phone.png")
            sizes = page.evaluate("() => ({body: document.body.scrollWidth, doc: document.documentElement.scrollWidth,"
                                  " inner: window.innerWidth})")
            assert sizes["inner"] == 390, sizes
            assert sizes["body"] <= sizes["inner"] + 1 and sizes["doc"] <= sizes["inner"] + 1, (path, sizes)
    finally:
        phone.close()
