"""Request rate limits (issue 15): every API request counts against its client's rate, and job
submissions (API and form) against a stricter one. Past a rate: 429 with Retry-After and a message
naming the limit and its setting.

Rates use DRF's syntax ("120/min") and are read from Django settings on every request, so they are
configurable by environment (controlplane/settings.py) and per test. Counts live in Django's cache:
the default local-memory cache counts per web process (N daphne processes allow N x the rate);
point CACHES at Redis to count across processes.

Login throttling with lockout is django-axes (controlplane/settings.py, AXES_*), not here. "Client
address" is jobs/core/client_ip.py's everywhere (the peer, or behind a trusted proxy what it saw), never
a client-sent X-Forwarded-For.
"""
from __future__ import annotations

from django.conf import settings
from rest_framework.exceptions import Throttled
from rest_framework.permissions import IsAuthenticated
from rest_framework.throttling import SimpleRateThrottle

from jobs.core.client_ip import client_ip


class _ExplainedRateThrottle(SimpleRateThrottle):
    """A SimpleRateThrottle whose rate is a Django setting and whose refusal says which."""

    setting = ""
    what = ""

    def get_ident(self, request) -> str:
        # DRF's own reads a client-sent X-Forwarded-For whole: rotating it escaped the limit
        return client_ip(request)

    def get_rate(self) -> str | None:
        return getattr(settings, self.setting, None) or None  # empty: no limit

    def allow_request(self, request, view) -> bool:
        # DRF parses the rate once, at construction: a fresh throttle per request reads the current setting.
        if super().allow_request(request, view):
            return True
        wait = self.wait()
        raise Throttled(wait=wait, detail=f"too many {self.what}: at most {self.rate} ({self.setting}); "
                                          f"retry in {max(1, round(wait or 1))} s")


class AnonThrottle(_ExplainedRateThrottle):
    """Requests without credentials, per client address."""

    scope, setting, what = "anon", "TRAINYARD_THROTTLE_ANON", "requests without credentials from this address"

    def get_cache_key(self, request, view):
        if request.user and request.user.is_authenticated:
            return None
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


class UserThrottle(_ExplainedRateThrottle):
    """Requests of a logged-in user (session or token), per user, whatever the address."""

    scope, setting, what = "user", "TRAINYARD_THROTTLE_USER", "requests from this user"

    def get_cache_key(self, request, view):
        if not (request.user and request.user.is_authenticated):
            return None
        return self.cache_format % {"scope": self.scope, "ident": request.user.pk}


class SubmitThrottle(_ExplainedRateThrottle):
    """Job submissions (POST /api/v1/jobs/ and the /jobs/new/ form), per user."""

    scope, setting, what = "submit", "TRAINYARD_THROTTLE_SUBMIT", "job submissions from this user"

    def get_cache_key(self, request, view):
        ident = request.user.pk if request.user and request.user.is_authenticated else self.get_ident(request)
        return self.cache_format % {"scope": self.scope, "ident": ident}


class IsAuthenticatedOrThrottled(IsAuthenticated):
    """The API's default permission: DRF checks permissions before throttles, so a flood without
    credentials would get 401 forever and never meet AnonThrottle. Here a refused anonymous request
    counts against TRAINYARD_THROTTLE_ANON first: 429 past it, else the usual 401."""

    def has_permission(self, request, view) -> bool:
        if super().has_permission(request, view):
            return True
        AnonThrottle().allow_request(request, view)  # raises Throttled past the rate
        return False


def submit_refusal(request) -> str | None:
    """For the form view (a plain Django request): the 429 message when this submission is over
    TRAINYARD_THROTTLE_SUBMIT, else None (and the submission is counted)."""
    try:
        SubmitThrottle().allow_request(request, None)
    except Throttled as exc:
        return str(exc.detail)
    return None
