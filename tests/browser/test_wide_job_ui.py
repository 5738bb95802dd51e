"""Issue 26: the job page of a job with many ranks draws the reduced series (a min/mean/max band across
ranks) and the slowest and fastest few ranks by name, never a line per rank; the live path (relay ->
MetricStep -> one reduced row per step) moves the band and the names; a rank picked for drill-down is
read from the series API."""
from __future__ import annotations

import json
import time

import pytest
import redis

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
