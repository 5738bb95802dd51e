"""Notifications end to end through the real cluster (tests/integration/cluster.py, whose `notify`
process is the notifications' own Celery worker): a job that fails reaches a webhook receiver this
test runs on 127.0.0.1 (signature verified with the secret the API showed once) and an SMTP sink
(aiosmtpd); receivers that hang are tried TRAINYARD_WEBHOOK_TRIES times, each try timed out and
logged, while the control worker's schedule ticks keep their pace and a job submitted meanwhile
starts at once."""
from __future__ import annotations

import json
import re
import time
from datetime import datetime

import pytest

from tests.jobs.notify.sinks import Receiver, SmtpSink, signature_ok
from tests.test_entrypoint import pack_dir

from .cluster import Cluster
from .test_user_code import EXAMPLES, manage, upload

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
TIMEOUT_S, TRIES, BACKOFF_S = 2, 3, 1
TICK = re.compile(r"jobs\.tasks\.schedule_tick\[[^\]]+\] succeeded in ([0-9.]+)s")


@pytest.fixture(scope="module")
def smtp():
    with SmtpSink() as sink:
        yield sink


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smtp):
    c = Cluster(tmp_path_factory.mktemp("notify"))
    c.env.update({"TRAINYARD_WEBHOOK_ALLOW": "127.0.0.1", "TRAINYARD_WEBHOOK_TIMEOUT_S": str(TIMEOUT_S),
                  "TRAINYARD_WEBHOOK_TRIES": str(TRIES), "TRAINYARD_WEBHOOK_BACKOFF_S": str(BACKOFF_S),
                  "EMAIL_HOST": "127.0.0.1", "EMAIL_PORT": str(smtp.port), "DEFAULT_FROM_EMAIL": "ty@test.example",
                  "TRAINYARD_PUBLIC_URL": "https://ty.test.example"})
    try:
        c.start()
        yield c
    finally:
        c.stop()


def failing_job(cluster: Cluster, bundle: str, name: str) -> dict:
    """A job whose attempt fails at once as user_error (a python missing on the nodes): no torchrun."""
    return cluster.submit({"name": name, "code": {"bundle": bundle}, "entrypoint": {"script": "train.py"},
                           "python": "/usr/nowhere/bin/python", "resources": {"nodes": 2, "procs_per_node": 1},
                           "max_restarts": 0})


def ticks(cluster: Cluster) -> list[float]:
    """Every schedule tick the control worker ran so far: how long each took."""
    return [float(s) for s in TICK.findall((cluster.dir / "control.log").read_text(errors="replace"))]


def hook(cluster: Cluster, url: str) -> tuple[int, str]:
    status, body = cluster.request("POST", "/api/v1/webhooks/", {"url": url, "events": ["job.ended"]})
    assert status == 201, body
    return body["id"], body["secret"]


def deliveries(cluster: Cluster, hook_id: int) -> list[dict]:
    return cluster.get(f"/api/v1/webhooks/{hook_id}/deliveries/")["results"]


def test_a_failed_job_reaches_the_webhook_and_the_mail_and_hung_receivers_never_slow_the_ticks(cluster, smtp):
    manage(cluster, "shell", "-c", "from django.contrib.auth.models import User; "
                                   "User.objects.filter(username='admin').update(email='admin@test.example')")
    status, body = upload(cluster, pack_dir(EXAMPLES / "plain"))
    assert status == 201, body
    bundle = body["bundle"]
    status, refused = cluster.request("POST", "/api/v1/webhooks/", {"url": "http://127.0.0.2:9/h", "events": ["job.ended"]})
    assert status == 400 and "does not allow" in refused["errors"]["url"][0]
    status, _ = cluster.request("POST", "/api/v1/subscriptions/", {"events": ["job.ended"]})
    assert status == 201

    with Receiver() as good, Receiver(delay_s=60) as hung:
        good_id, secret = hook(cluster, good.url())
        hung_ids = [hook(cluster, hung.url(f"/slow/{i}"))[0] for i in range(3)]  # more than the notify worker's 2 slots

        before_t0, before = time.monotonic(), len(ticks(cluster))
        time.sleep(10)  # the tick's pace with nothing to deliver: a rate over time, not an event to await
        base_rate = (len(ticks(cluster)) - before) / (time.monotonic() - before_t0)

        job = failing_job(cluster, bundle, "doomed")
        done = cluster.wait_status(job["id"], TERMINAL, 120)
        assert done["status"] == "FAILED" and done["attempts"][0]["outcome"] == "failed:user_error", done

        # the webhook: signed with the secret shown once, the job's failure and its class
        assert good.arrived.wait(90), cluster.logs()
        (headers, raw, _), = good.requests
        assert signature_ok(secret, raw, headers["x-trainyard-signature"]), headers
        doc = json.loads(raw)
        assert (doc["event"], doc["job"]["id"], doc["job"]["status"]) == ("job.ended", job["id"], "FAILED")
        assert doc["job"]["failure_class"] == "user_error" and doc["job"]["url"].endswith(f"/jobs/{job['id']}/")
        # the mail, through the real SMTP backend to the sink
        assert smtp.arrived.wait(90), cluster.logs()
        sender, to, msg = smtp.messages[0]
        assert (sender, to) == ("ty@test.example", ["admin@test.example"])
        assert msg["Subject"].startswith(f'[Trainyard] job {job["id"]} "doomed" failed (user_error)')

        # while the hung receivers hold the notify worker: the ticks keep their pace, a new job starts at once
        during_t0, during = time.monotonic(), len(ticks(cluster))
        second = failing_job(cluster, bundle, "meanwhile")
        cluster.wait_status(second["id"], TERMINAL, 60)
        events = cluster.get(f"/api/v1/jobs/{second['id']}/events/?page_size=100")["results"]
        at = {e["kind"]: e["created_at"] for e in events}
        start_latency = (datetime.fromisoformat(at["attempt_started"]) - datetime.fromisoformat(at["submitted"])).total_seconds()

        def all_failed():
            rows = [d for h in hung_ids for d in deliveries(cluster, h) if d["event"] == "job.ended"]
            return len(rows) >= 3 and all(d["status"] == "failed" for d in rows) and rows
        rows = cluster.wait_for(all_failed, 180, "the hung receivers' deliveries to spend their tries")
        window = time.monotonic() - during_t0
        tick_times = ticks(cluster)
        during_rate = (len(tick_times) - during) / window

    for d in rows:
        assert d["tries"] == TRIES and [a["number"] for a in d["attempts"]] == list(range(1, TRIES + 1)), d
        for a in d["attempts"]:
            assert a["status_code"] is None and "timed out" in a["error"], a
            assert TIMEOUT_S * 0.8 < a["duration_s"] < TIMEOUT_S * 3 + 1, a
    first, second_try = rows[0]["attempts"][:2]
    gap = (datetime.fromisoformat(second_try["started_at"]) - datetime.fromisoformat(first["started_at"])).total_seconds()
    assert gap >= TIMEOUT_S + BACKOFF_S * 0.9, rows[0]  # the try, then the backoff
    good_log = deliveries(cluster, good_id)
    assert [(d["status"], d["tries"], d["attempts"][0]["status_code"]) for d in good_log][-1] == ("delivered", 1, 200)
    print(json.dumps({"tick_rate_before_per_s": round(base_rate, 2), "tick_rate_during_per_s": round(during_rate, 2),
                      "window_s": round(window, 1), "slowest_tick_s": max(tick_times[during:] or [0]),
                      "second_job_start_latency_s": start_latency}))
    assert during_rate >= 0.7 * base_rate, (base_rate, during_rate)
    assert max(tick_times[during:]) < 2.0 and start_latency < 5.0, (tick_times[during:], start_latency)
