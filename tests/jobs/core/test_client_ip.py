"""The client address the throttles and the login lockout count against (jobs/core/client_ip.py, issue 21
section 6): a client-sent X-Forwarded-For is believed only from a proxy of TRAINYARD_TRUSTED_PROXIES,
and then only its right-most address that is not a trusted proxy. A client cannot escape its limit by
rotating the header; behind a configured proxy, clients are told apart and the limits still hold."""
from __future__ import annotations

import itertools

import pytest
from django.core.cache import cache
from django.test import Client, RequestFactory
from rest_framework.test import APIClient

from controlplane import security

pytestmark = pytest.mark.django_db

_fresh = itertools.count(1)


@pytest.fixture(autouse=True)
def _fresh_counts():
    cache.clear()
    yield
    cache.clear()


def ip(settings, remote: str, xff: str | None = None, trusted=()) -> str:
    from jobs.core.client_ip import client_ip

    settings.TRAINYARD_TRUSTED_PROXIES = list(trusted)
    extra = {"REMOTE_ADDR": remote, **({"HTTP_X_FORWARDED_FOR": xff} if xff is not None else {})}
    return client_ip(RequestFactory().get("/", **extra))


def rotating() -> str:
    n = next(_fresh)
    return f"203.0.113.{n % 250}, 198.51.100.{n % 7}"


def test_without_trusted_proxies_the_peer_is_the_client(settings):
    assert ip(settings, "192.0.2.7") == "192.0.2.7"
    assert ip(settings, "192.0.2.7", "1.2.3.4") == "192.0.2.7"
    assert ip(settings, "192.0.2.7", "1.2.3.4", trusted=["10.0.0.0/8"]) == "192.0.2.7"  # not a proxy of ours


def test_behind_trusted_proxies_the_right_most_untrusted_address(settings):
    proxies = ["10.0.0.5", "10.1.0.0/16"]
    assert ip(settings, "10.0.0.5", "198.51.100.9", proxies) == "198.51.100.9"
    # the client prepends what it likes; the proxies append what they saw
    assert ip(settings, "10.0.0.5", "1.1.1.1, 2.2.2.2, 198.51.100.9, 10.1.3.4", proxies) == "198.51.100.9"
    assert ip(settings, "10.0.0.5", None, proxies) == "10.0.0.5"  # a proxy that adds nothing
    assert ip(settings, "10.0.0.5", "10.1.0.1", proxies) == "10.1.0.1"  # every hop trusted: the left-most
    assert ip(settings, "10.0.0.5", "198.51.100.9, not-an-address", proxies) == "10.0.0.5"
    assert ip(settings, "10.0.0.5", "198.51.100.9:4242", proxies) == "198.51.100.9"
    assert ip(settings, "::ffff:10.0.0.5", "[2001:db8::1]:443", proxies) == "2001:db8::1"


def test_the_setting_refuses_what_is_not_an_address():
    assert security.trusted_proxies({"TRAINYARD_TRUSTED_PROXIES": " 10.0.0.5, 10.1.0.0/16 ,::1"}) == [
        "10.0.0.5/32", "10.1.0.0/16", "::1/128"]
    assert security.trusted_proxies({}) == []
    with pytest.raises(ValueError, match="TRAINYARD_TRUSTED_PROXIES"):
        security.trusted_proxies({"TRAINYARD_TRUSTED_PROXIES": "proxy.internal"})


def test_rotating_x_forwarded_for_does_not_escape_the_anonymous_limit(settings):
    settings.TRAINYARD_THROTTLE_ANON = "3/min"
    c = APIClient()
    codes = [c.get("/api/v1/jobs/", HTTP_X_FORWARDED_FOR=rotating()).status_code for _ in range(5)]
    assert codes == [401, 401, 401, 429, 429]


def test_rotating_x_forwarded_for_does_not_escape_the_login_rate(user, settings):
    settings.TRAINYARD_LOGIN_RATE = "2/min"
    codes = [APIClient().post("/api/v1/auth/token/", {"username": "alice", "password": "wrong"}, format="json",
                              HTTP_X_FORWARDED_FOR=rotating()).status_code for _ in range(4)]
    assert codes == [400, 400, 429, 429]


def test_behind_a_configured_proxy_clients_are_told_apart_and_still_limited(settings):
    settings.TRAINYARD_TRUSTED_PROXIES = ["127.0.0.1"]  # the test client's REMOTE_ADDR: our proxy
    settings.TRAINYARD_THROTTLE_ANON = "2/min"
    c = APIClient()

    def get(xff):
        return c.get("/api/v1/jobs/", HTTP_X_FORWARDED_FOR=xff).status_code

    assert [get("198.51.100.1"), get("198.51.100.1"), get("198.51.100.1")] == [401, 401, 429]
    assert get("198.51.100.2") == 401  # another client behind the same proxy has its own count
    # the first client forging an address to the left of what the proxy appended is still itself
    assert get("203.0.113.77, 198.51.100.1") == 429


def _login(xff: str, password="wrong", username="alice"):
    return Client().post("/accounts/login/", {"username": username, "password": password},
                         HTTP_X_FORWARDED_FOR=xff)


def test_the_login_lockout_counts_the_same_address(user, settings):
    settings.AXES_FAILURE_LIMIT = 2
    # no trusted proxy: rotating the header does not escape the lockout
    assert [_login(rotating()).status_code for _ in range(3)] == [200, 429, 429]
    assert _login(rotating(), "pw-alice-123").status_code == 429
    from axes.utils import reset

    reset()
    cache.clear()
    # behind the configured proxy: one client's failures lock out that client, not everyone behind it
    settings.TRAINYARD_TRUSTED_PROXIES = ["127.0.0.1"]
    assert [_login("198.51.100.1").status_code for _ in range(2)] == [200, 429]
    assert _login("203.0.113.5, 198.51.100.1", "pw-alice-123").status_code == 429
    assert _login("198.51.100.2", "pw-alice-123").status_code == 302
