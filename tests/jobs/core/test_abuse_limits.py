"""Issue 15, section 2: limits on abuse. Each limit answers 429 (or websocket close 4429) with a
reason naming its setting, and is configurable; the other tests run with them out of reach
(tests/jobs/conftest.py)."""
from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.core.cache import cache
from django.test import Client
from rest_framework.test import APIClient

from jobs import services
from jobs.access import services as access_services
from jobs.models import Job

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_counts():
    cache.clear()  # the throttles count in Django's cache, which outlives a test's database
    yield
    cache.clear()


def test_requests_without_credentials_are_throttled_per_address(settings):
    settings.TRAINYARD_THROTTLE_ANON = "3/min"
    c = APIClient()
    assert [c.get("/api/v1/jobs/").status_code for _ in range(3)] == [401, 401, 401]
    r = c.get("/api/v1/jobs/")
    assert r.status_code == 429 and int(r["Retry-After"]) > 0
    assert "TRAINYARD_THROTTLE_ANON" in r.json()["errors"]["detail"][0]


def test_a_users_requests_are_throttled(user, other, settings, client_for):
    settings.TRAINYARD_THROTTLE_USER = "4/min"
    c = client_for(user)
    assert [c.get("/api/v1/jobs/").status_code for _ in range(4)] == [200] * 4
    r = c.get("/api/v1/nodes/")
    assert r.status_code == 429 and "TRAINYARD_THROTTLE_USER" in r.json()["errors"]["detail"][0]
    assert client_for(other).get("/api/v1/jobs/").status_code == 200  # per user


def test_submissions_have_a_stricter_rate_on_the_api_and_the_form(user, nodes, settings, client_for):
    settings.TRAINYARD_THROTTLE_SUBMIT = "2/min"
    c = client_for(user)
    assert [c.post("/api/v1/jobs/", {"name": f"j{i}"}, format="json").status_code for i in range(2)] == [201, 201]
    r = c.post("/api/v1/jobs/", {"name": "j3"}, format="json")
    assert r.status_code == 429 and "TRAINYARD_THROTTLE_SUBMIT" in r.json()["errors"]["detail"][0]
    assert c.get("/api/v1/jobs/").status_code == 200  # reads are not submissions
    page = Client()
    page.force_login(user)
    r = page.post("/jobs/new/", {"spec": '{"name": "j4"}'})
    assert r.status_code == 429 and "TRAINYARD_THROTTLE_SUBMIT" in r.content.decode()
    assert Job.objects.count() == 2


def test_a_user_may_queue_only_so_many_jobs(user, other, nodes, settings, client_for):
    settings.TRAINYARD_MAX_QUEUED_JOBS_PER_USER = 2
    big = {"name": "big", "resources": {"nodes": 2, "procs_per_node": 2}}  # the whole cluster: jobs wait
    first = services.job_submit(user=user, spec=services.submitted_spec(big))
    services.schedule_tick()  # the first starts; the next two wait
    c = client_for(user)
    assert [c.post("/api/v1/jobs/", big, format="json").status_code for _ in range(2)] == [201, 201]
    r = c.post("/api/v1/jobs/", big, format="json")
    assert r.status_code == 429
    assert "TRAINYARD_MAX_QUEUED_JOBS_PER_USER" in r.json()["errors"]["spec"][0]
    page = Client()
    page.force_login(user)
    r = page.post("/jobs/new/", {"spec": '{"name": "form"}'})
    assert r.status_code == 429 and "queued jobs" in r.content.decode()
    assert client_for(other).post("/api/v1/jobs/", big, format="json").status_code == 201  # per user
    services.job_cancel(Job.objects.filter(owner=user, status="QUEUED").first(), user=user)
    assert c.post("/api/v1/jobs/", big, format="json").status_code == 201
    assert first.pk


def _login(client, password, username="alice"):
    return client.post("/accounts/login/", {"username": username, "password": password})


def test_a_login_flood_locks_the_username_out(user, other, settings):
    settings.AXES_FAILURE_LIMIT = 3
    c = Client()
    assert [_login(c, "wrong").status_code for _ in range(2)] == [200, 200]  # the form again, with an error
    r = _login(c, "wrong")
    assert r.status_code == 429
    assert _login(c, "pw-alice-123").status_code == 429  # even the right password, during the cool-off
    api = APIClient().post("/api/v1/auth/token/", {"username": "alice", "password": "pw-alice-123"}, format="json")
    assert api.status_code == 429 and "TRAINYARD_LOGIN_FAILURE_LIMIT" in api.json()["errors"]["detail"][0]
    assert _login(Client(), "pw-bob-123", "bob").status_code == 302  # another user logs in

    key = access_services.token_issue(user)  # an API token is no password: it still works
    assert APIClient(HTTP_AUTHORIZATION=f"Token {key}").get("/api/v1/jobs/").status_code == 200


def test_a_login_after_a_lockout_cools_off(user, settings):
    from datetime import timedelta

    settings.AXES_FAILURE_LIMIT = 2
    settings.AXES_COOLOFF_TIME = timedelta(seconds=0.5)
    c = Client()
    _login(c, "wrong")
    assert _login(c, "wrong").status_code == 429
    import time

    time.sleep(0.6)
    assert _login(c, "pw-alice-123").status_code == 302


@pytest.mark.django_db(transaction=True)
def test_a_user_may_hold_only_so_many_websockets(user, other, settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.TRAINYARD_MAX_SOCKETS_PER_USER = 2
    from controlplane.asgi import application

    from tests.jobs.runs.test_consumers import session_headers

    mine, theirs = session_headers(user), session_headers(other)

    async def go():
        held = []
        for _ in range(2):
            comm = WebsocketCommunicator(application, "/ws/cluster/", headers=mine)
            assert (await comm.connect())[0]
            assert (await comm.receive_json_from(timeout=5))["type"] == "snapshot"
            held.append(comm)
        extra = WebsocketCommunicator(application, "/ws/cluster/", headers=mine)
        await extra.connect()
        closed = await extra.receive_output(timeout=5)
        assert closed["type"] == "websocket.close" and closed["code"] == 4429
        assert "TRAINYARD_MAX_SOCKETS_PER_USER" in closed["reason"]
        other_user = WebsocketCommunicator(application, "/ws/cluster/", headers=theirs)
        assert (await other_user.connect())[0]  # per user
        await other_user.disconnect()
        await held.pop().disconnect()  # closing one frees its place
        again = WebsocketCommunicator(application, "/ws/cluster/", headers=mine)
        assert (await again.connect())[0]
        assert (await again.receive_json_from(timeout=5))["type"] == "snapshot"
        for comm in (*held, again):
            await comm.disconnect()

    async_to_sync(go)()
