"""Issue 26: the job page of a job with many ranks draws the reduced series (a min/mean/max band across
ranks) and the slowest and fastest few ranks by name, never a line per rank; the live path (relay ->
MetricStep -> one reduced row per step) moves the band and the names; a rank picked for drill-down is
read from the series API."""
from __future__ import annotations

import json
import time

import pytest
import redis

from .conftest import screenshot
from .test_dashboard import wait_js
from .test_fault_ui import manage

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

RANKS = 64

SETUP = """
import json
from django.db import transaction
from django.contrib.auth import get_user_model
from jobs import services
from jobs.models import Attempt, Job
from jobs.telemetry.ingest import telemetry_ingest
with transaction.atomic():  # failed before the scheduler could place it: the samples are all simulated
    job = services.job_submit(user=get_user_model().objects.get(username="admin"),
                              spec=services.submitted_spec({"name": "wide-64"}))
    Job.objects.filter(pk=job.pk).update(status=Job.Status.FAILED)
attempt = Attempt.objects.filter(job=job).first() or Attempt.objects.create(job=job, number=1)
Attempt.objects.filter(pk=attempt.pk).update(status=Attempt.Status.ENDED)
telemetry_ingest([{"attempt": attempt.pk, "rank": r, "step": s, "ts": 1.0 + s, "loss": 3.0 - s / 100 + r / 1000,
                   "samples_per_s": 10.0, "step_s": 0.9 if r == 17 else 0.05 if r == 5 else 0.2 + r / 10000}
                  for s in range(1, 31) for r in range(%d)], events=[])
print(json.dumps({"job": job.pk, "attempt": attempt.pk}))
""" % RANKS


def ranks_chart(page) -> dict:
    return page.evaluate("""() => {
        const c = window.trainyard.charts.ranks;
        const root = document.querySelector('#chart-ranks');
        return {series: c.u ? c.u.series.slice(1).map((s) => s.label) : [], band: +root.dataset.band,
                points: +root.dataset.points, named: root.dataset.named,
                slowest: document.querySelector('#named-ranks').dataset.slowest,
                text: document.querySelector('#named-ranks').textContent, last: window.trainyard.steps.lastStep};
    }""")


def test_a_64_rank_job_draws_a_band_and_names_its_slowest_rank_live(page, base, cluster):
    ids = json.loads(manage(cluster, "shell", "-c", SETUP).splitlines()[-1])
    job, attempt = ids["job"], ids["attempt"]
    page.goto(f"{base}/jobs/{job}/")
    wait_js(page, "() => window.trainyard && window.trainyard.socket.stats.snapshots >= 1", 30, "the snapshot")
    wait_js(page, "() => +document.querySelector('#chart-ranks').dataset.band === 30", 15, "the band of 30 steps")
    got = ranks_chart(page)
    # the band (min, max, mean) and the named ranks only: 17 the slowest, 5 the fastest, not 64 lines
    assert got["series"][:3] == ["min over ranks", "max over ranks", "mean over ranks"], got
    assert "rank 17 · slowest" in got["series"] and "rank 5 · fastest" in got["series"], got
    assert len(got["series"]) <= 3 + 6, got
    assert got["slowest"].split(",")[0] == "17" and "Slowest: rank 17" in got["text"], got
    assert got["points"] == 2 * 30 * (len(got["series"]) - 3) // 2, got  # each named rank's 30 samples
    assert int(page.get_attribute("#chart-loss", "data-band")) == 30
    assert int(page.get_attribute("#chart-throughput", "data-points")) > 0
    assert page.evaluate("() => window.trainyard.store.ranks.size") <= 6  # the browser never got 64 ranks' samples

    # Live: the relay ingests 40 more steps where rank 40 is the slow one; the page gets one reduced row
    # per step and the named ranks' samples, the band grows and rank 40 becomes the slowest by name.
    r = redis.Redis.from_url(cluster.redis.url)
    stream = f"trainyard:job:{job}:a{attempt}"
    for step in range(31, 71):
        r.xadd(stream, {"type": "metrics", "data": json.dumps([
            {"attempt": attempt, "rank": rank, "step": step, "ts": time.time(), "loss": 2.0, "samples_per_s": 10.0,
             "step_s": 0.95 if rank == 40 else 0.05 if rank == 5 else 0.2} for rank in range(RANKS)])})
    wait_js(page, "() => +document.querySelector('#chart-ranks').dataset.band === 70", 30, "the band of 70 steps")
    wait_js(page, "() => document.querySelector('#named-ranks').dataset.slowest.split(',')[0] === '40'", 15,
            "rank 40 named the slowest")
    got = ranks_chart(page)
    assert "rank 40 · slowest" in got["series"] and len(got["series"]) <= 3 + 6, got
    assert page.evaluate("() => window.trainyard.socket.stats.byType.telemetry") >= 1
    top = page.evaluate("() => window.trainyard.steps.rows.get(70).step_s")
    assert top[0] == 0.05 and top[2] == 0.95 and top[3] == RANKS

    # Drill-down: any rank by number, from the series API.
    page.fill("#rank-pick input", "33")
    page.click("#rank-pick button")
    wait_js(page, "() => window.trainyard.drill.fetches >= 1", 15, "rank 33's series")
    page.wait_for_timeout(300)
    labels = ranks_chart(page)["series"]
    assert "rank 33 · picked" in labels, labels
    drawn = page.evaluate("() => window.trainyard.chartSteps('ranks').find((s) => s.label === 'rank 33 · picked').steps.length")
    assert drawn == 70
    assert not page.js_errors, page.js_errors
    screenshot(page, "screenshot-wide-job.png")


def test_step_store_replaces_resent_steps_follows_restarts_and_keeps_spikes_when_compacting(page, base):
    """static/js/store.js StepStore in the browser: the merge rules the band charts rely on."""
    page.goto(f"{base}/jobs/")
    result = page.evaluate("""async () => {
        const { StepStore } = await import('/static/js/store.js');
        const row = (attempt, step, ranks, max = 0.3) => ({ attempt, step, ranks, step_s: [0.1, 0.2, max, ranks] });
        const s = new StepStore({ maxSteps: 100 });
        const out = {};
        s.merge([row(7, 1, 32), row(7, 2, 32)]);
        s.merge([row(7, 2, 64, 0.9)]);                       // step 2's other ranks arrived: replaced, not added
        out.resent = { steps: s.steps.length, ranks: s.rows.get(2).ranks, max: s.rows.get(2).step_s[2] };
        for (let i = 3; i <= 40; i++) s.merge([row(7, i, 64)]);
        s.merge([row(9, 31, 64), row(9, 32, 64)]);           // attempt 9 resumed from step 30
        s.merge([row(7, 41, 64)]);                           // late tail of attempt 7: stale
        out.resumed = { last: s.lastStep, at31: s.rows.get(31).attempt, at30: s.rows.get(30).attempt };
        for (let i = 33; i <= 400; i++) s.merge([row(9, i, 64, i === 250 ? 7.5 : 0.3)]);
        const maxes = s.steps.map((st) => s.rows.get(st).step_s[2]);
        out.bounded = { steps: s.steps.length, last: s.lastStep, bucketed: s.bucketed, spike: Math.max(...maxes),
                        total: s.recentTotal('step_s', 64, 1) };
        return out;
    }""")
    assert result["resent"] == {"steps": 2, "ranks": 64, "max": 0.9}
    assert result["resumed"] == {"last": 32, "at31": 9, "at30": 7}
    b = result["bounded"]
    assert b["steps"] <= 100 and b["last"] == 400 and b["bucketed"] and b["spike"] == 7.5
    assert b["total"] == pytest.approx(0.2 * 64)
