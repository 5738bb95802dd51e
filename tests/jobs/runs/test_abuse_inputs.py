"""Issue 15, section 2: inputs cannot exhaust the server. A YAML alias bomb, huge integers, deep
JSON and out-of-range numeric parameters each get a small, fast 400 naming the field; nothing is
created and nothing answers 500."""
from __future__ import annotations

import json
import time

import pytest

from jobs.models import Job
from trainyard.spec import SpecError, parse_text

pytestmark = pytest.mark.django_db


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The "billion laughs": each anchor a list of `width` aliases of the one before; ~340 bytes
    that expand to width**levels references (today 50 MB of error text in 3 s when posted)."""
    lines = ["a0: &a0 [" + ",".join(['"lol"'] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + f"\nname: x\ncomm: {{compression: topk, ratio: *a{levels - 1}}}\n"


def test_the_alias_bomb_is_refused_before_it_expands():
    t0 = time.monotonic()
    with pytest.raises(SpecError) as e:
        parse_text(alias_bomb())
    assert time.monotonic() - t0 < 0.5
    assert "anchors and aliases" in e.value.errors["spec"][0] and len(str(e.value)) < 500


def test_the_form_answers_the_alias_bomb_with_a_small_fast_400(user, nodes, client):
    client.force_login(user)
    t0 = time.monotonic()
    r = client.post("/jobs/new/", {"spec": alias_bomb()})
    elapsed = time.monotonic() - t0
    assert r.status_code == 400
    assert len(r.content) < 200_000 and elapsed < 2, (len(r.content), elapsed)
    assert "anchors and aliases" in r.content.decode()
    assert Job.objects.count() == 0


def test_a_hostile_value_is_never_echoed_whole(user, nodes, client_for):
    # the same expansion written out as JSON (~100 KB) still answers a few hundred bytes
    body = {"name": "x", "comm": {"compression": "topk", "ratio": [["lol"] * 100] * 100}}
    r = client_for(user).post("/api/v1/jobs/", body, format="json")
    assert r.status_code == 400 and "comm.ratio" in r.json()["errors"]
    assert len(r.content) < 2000, len(r.content)


@pytest.mark.parametrize("text", ["name: x\nmodel: {layers: " + "9" * 5000 + "}\n",
                                  '{"name": "x", "model": {"layers": ' + "9" * 5000 + "}}"])
def test_the_form_refuses_an_integer_past_the_digit_limit(user, nodes, client, text):
    client.force_login(user)
    r = client.post("/jobs/new/", {"spec": text})
    assert r.status_code == 400 and "too many digits" in r.content.decode()
    assert Job.objects.count() == 0


def test_the_form_refuses_an_oversized_document(user, nodes, client):
    client.force_login(user)
    r = client.post("/jobs/new/", {"spec": "name: x\n" + "#" * 300_000 + "\n"})
    assert r.status_code == 400 and "larger than" in r.content.decode()


def test_the_form_refuses_deep_yaml_without_recursing(user, nodes, client):
    client.force_login(user)
    r = client.post("/jobs/new/", {"spec": "name: x\nconfig: " + "[" * 20000 + "]" * 20000})
    assert r.status_code == 400 and "nests too deeply" in r.content.decode()


@pytest.mark.parametrize("body", [
    '{"name": "x", "model": {"layers": ' + "9" * 5000 + "}}",       # past Python's int/str limit
    '{"name": "x", "model": {"layers": ' + "9" * 4000 + "}}",       # within it, far past the bound
    '{"name": "x", "parallel": {"tp": ' + "9" * 30 + ", \"dp\": 1}}",
    '{"name": "x", "checkpoint": {"every_steps": 100000000000000000000}}',
    '{"name": "x", "comm": {"sync": "local_sgd", "period": 100000000000000000000}}',
    '{"name": "x", "config": ' + '{"a": ' * 5000 + "{}" + "}" * 5000 + "}",
])
def test_the_api_answers_huge_numbers_and_deep_json_with_400(user, nodes, client_for, body):
    r = client_for(user).post("/api/v1/jobs/", body, content_type="application/json")
    assert r.status_code == 400, r.content[:300]
    assert len(r.content) < 2000 and r.json()["errors"]
    assert Job.objects.count() == 0


@pytest.mark.parametrize("param", ["attempt", "since_step", "rank", "limit"])
def test_metrics_parameters_past_64_bits_are_400(user, nodes, client_for, param):
    from jobs import services

    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "j"}))
    r = client_for(user).get(f"/api/v1/jobs/{job.pk}/metrics/", {param: 10**20})
    assert r.status_code == 400 and param in r.json()["errors"], r.content[:300]


@pytest.mark.parametrize("param", ["attempt", "offset", "rank", "limit"])
def test_logs_parameters_past_64_bits_are_400(user, nodes, client_for, param, settings, tmp_path):
    from jobs import services

    settings.TRAINYARD_ARTIFACT_ROOT = settings.TRAINYARD_KEPT_LOG_ROOT = tmp_path
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "j"}))
    r = client_for(user).get(f"/api/v1/jobs/{job.pk}/logs/", {param: 10**20})
    assert r.status_code == 400 and param in r.json()["errors"], r.content[:300]


def test_a_long_bad_parameter_is_not_echoed_whole(user, nodes, client_for):
    from jobs import services

    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "j"}))
    r = client_for(user).get(f"/api/v1/jobs/{job.pk}/metrics/", {"attempt": "x" * 100_000})
    assert r.status_code == 400 and len(r.content) < 1000


@pytest.mark.parametrize("url", ["/api/v1/jobs/{big}/", "/api/v1/jobs/{big}/metrics/", "/jobs/{big}/",
                                 "/api/v1/jobs/{job}/checkpoints/{big}/pin/"])
def test_ids_past_64_bits_in_the_path_are_not_500(user, staff, nodes, client_for, client, url):
    from jobs import services

    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "j"}))
    client.force_login(staff)
    path = url.format(big=10**20, job=job.pk)
    r = (client_for(staff).post(path, {"pinned": True}, format="json") if path.endswith("/pin/")
         else client.get(path) if path.startswith("/jobs/") else client_for(staff).get(path))
    assert r.status_code in (400, 404), (path, r.status_code, r.content[:300])


def test_rollback_to_a_checkpoint_id_past_64_bits_is_400(user, staff, nodes, client_for):
    from jobs import services

    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "j"}))
    r = client_for(staff).post(f"/api/v1/jobs/{job.pk}/rollback/", {"checkpoint": 10**20}, format="json")
    assert r.status_code in (400, 404), r.content[:300]
    assert "checkpoint" in r.json()["errors"]


def test_quota_numbers_past_64_bits_are_400(staff, teams, client_for):
    r = client_for(staff).put("/api/v1/quotas/", json.dumps([{"team": "vision", "max_slots": 10**20}]),
                              content_type="application/json")
    assert r.status_code == 400, r.content[:300]


def test_an_oversized_json_body_is_413_and_read_no_further(user, nodes, client_for, settings):
    settings.TRAINYARD_JSON_MAX_BYTES = 100_000
    body = json.dumps({"name": "x", "config": {"blob": "x" * 500_000}})
    r = client_for(user).post("/api/v1/jobs/", body, content_type="application/json")
    assert r.status_code == 413 and "TRAINYARD_JSON_MAX_BYTES" in r.content.decode()
    assert Job.objects.count() == 0


def test_deep_json_to_every_json_endpoint_is_400(user, staff, client_for):
    deep = "[" * 100 + "]" * 100
    for path, method in (("/api/v1/plan/", "post"), ("/api/v1/quotas/", "put")):
        r = getattr(client_for(staff), method)(path, deep, content_type="application/json")
        assert r.status_code == 400 and "nests too deeply" in r.content.decode(), (path, r.content[:200])


@pytest.mark.django_db(transaction=True)
def test_a_websocket_frame_nested_too_deeply_or_too_long_gets_a_short_error(user, settings):
    from asgiref.sync import async_to_sync
    from channels.testing import WebsocketCommunicator

    from controlplane.asgi import application

    from tests.jobs.runs.test_consumers import session_headers

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    headers = session_headers(user)

    async def go():
        comm = WebsocketCommunicator(application, "/ws/cluster/", headers=headers)
        assert (await comm.connect())[0]
        assert (await comm.receive_json_from(timeout=5))["type"] == "snapshot"
        await comm.send_to(text_data="[" * 500_000 + "]" * 500_000)
        assert (await comm.receive_json_from(timeout=5))["type"] == "error"
        await comm.send_json_to({"type": "x" * 500_000})
        reply = await comm.receive_output(timeout=5)
        assert len(reply["text"]) < 300 and "unknown message type" in reply["text"]
        await comm.send_json_to({"type": "ping"})  # the socket is still up
        assert (await comm.receive_json_from(timeout=5))["type"] == "pong"
        await comm.disconnect()

    async_to_sync(go)()
