"""POST /api/v1/auth/token/: username + password -> a new API token (trainyard login)."""
import hashlib

import pytest
from django.core.cache import cache
from django.test import Client
from rest_framework.test import APIClient

from jobs.models import ApiToken

pytestmark = pytest.mark.django_db
URL = "/api/v1/auth/token/"


@pytest.fixture(autouse=True)
def _fresh_throttle():
    cache.clear()
    yield
    cache.clear()


def test_password_gives_a_new_token_kept_only_as_its_hash(user, nodes):
    r = APIClient().post(URL, {"username": "alice", "password": "pw-alice-123"}, format="json")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body == {"token": body["token"], "username": "alice", "is_staff": False} and len(body["token"]) == 43
    assert ApiToken.objects.get(user=user).digest == hashlib.sha256(body["token"].encode()).hexdigest()
    again = APIClient().post(URL, {"username": "alice", "password": "pw-alice-123"}, format="json").json()
    assert again["token"] != body["token"]  # the key cannot be shown again: each login gets its own
    for key in (body["token"], again["token"]):
        c = APIClient()
        c.credentials(HTTP_AUTHORIZATION=f"Token {key}")
        assert c.get("/api/v1/jobs/").status_code == 200


@pytest.mark.parametrize("payload, field", [
    ({"username": "alice", "password": "wrong"}, "credentials"),
    ({"username": "nobody", "password": "pw-alice-123"}, "credentials"),
    ({"username": "alice"}, "password"),
    ({"password": "pw-alice-123"}, "username"),
    ({"username": ["alice"], "password": "pw-alice-123"}, "username"),
])
def test_bad_credentials_are_400_naming_the_field_and_create_no_token(user, payload, field):
    r = APIClient().post(URL, payload, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json()["errors"]
    assert not ApiToken.objects.exists()


def test_inactive_user_gets_no_token(user):
    user.is_active = False
    user.save()
    r = APIClient().post(URL, {"username": "alice", "password": "pw-alice-123"}, format="json")
    assert r.status_code == 400 and r.json()["errors"] == {"credentials": ["wrong username or password"]}


def test_no_csrf_needed_and_session_ignored(user, staff):
    """A non-browser client posts without a CSRF token; a browser session does not make the
    request count as anyone (only the body's credentials do)."""
    c = Client(enforce_csrf_checks=True)
    c.force_login(staff)
    r = c.post(URL, {"username": "alice", "password": "pw-alice-123"}, content_type="application/json")
    assert r.status_code == 200 and r.json()["username"] == "alice"
    r = c.post(URL, {"username": "alice", "password": "nope"}, content_type="application/json")
    assert r.status_code == 400


def test_attempts_are_throttled_per_client(user, settings):
    settings.TRAINYARD_LOGIN_RATE = "3/min"
    c = APIClient()
    codes = [c.post(URL, {"username": "alice", "password": "wrong"}, format="json").status_code for _ in range(3)]
    assert codes == [400, 400, 400]
    r = c.post(URL, {"username": "alice", "password": "pw-alice-123"}, format="json")
    assert r.status_code == 429 and "throttled" in r.json()["errors"]["detail"][0]
    assert int(r["Retry-After"]) > 0
    assert not ApiToken.objects.exists()
