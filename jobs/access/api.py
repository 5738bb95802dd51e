"""POST /api/v1/auth/token/: exchange a username and password for a new API token (as
`manage.py api_token USER` prints one), for non-browser clients such as `trainyard login`. The key
is in this one answer only: the database keeps its SHA-256 (jobs/access/tokens.py).

No session, so no CSRF: the view authenticates nothing but the credentials in the body, and a
browser's cookies are ignored. Attempts are throttled per client address
(settings.TRAINYARD_LOGIN_RATE, default 20/min; 429 with Retry-After past it). A wrong username
or password, or an inactive user, is one 400 that does not say which. A username that failed too
often from this address is locked out (django-axes, controlplane/settings.py): 429.
"""
from __future__ import annotations

from django.conf import settings
from django.contrib.auth import authenticate
from drf_spectacular.utils import extend_schema
from rest_framework.exceptions import Throttled
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from jobs.access import services as access_services
from jobs.core.client_ip import client_ip
from jobs.core.dbtext import text_problem
from jobs.core.errors import InvalidInput


LOCKED_OUT = ("too many failed logins for this username from this address: locked out for a while "
              "(TRAINYARD_LOGIN_FAILURE_LIMIT, TRAINYARD_LOGIN_COOLOFF_S)")


class LoginRateThrottle(SimpleRateThrottle):
    """Every token request counts, per client address, against settings.TRAINYARD_LOGIN_RATE."""

    scope = "login"

    def get_rate(self) -> str:
        return getattr(settings, "TRAINYARD_LOGIN_RATE", "20/min")

    def get_ident(self, request) -> str:
        return client_ip(request)  # not DRF's, which believes a client-sent X-Forwarded-For

    def get_cache_key(self, request, view) -> str:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


class AuthTokenView(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes = [LoginRateThrottle]

    @extend_schema(request={"application/json": {"type": "object", "properties": {
        "username": {"type": "string"}, "password": {"type": "string"}}, "required": ["username", "password"]}},
        responses={200: {"type": "object", "properties": {"token": {"type": "string"}, "username": {"type": "string"},
                                                          "is_staff": {"type": "boolean"}}}})
    def post(self, request):
        data = request.data if isinstance(request.data, dict) else {}
        missing = {f: ["required"] for f in ("username", "password")
                   if not isinstance(data.get(f), str) or not data.get(f)}
        if missing:
            raise InvalidInput(missing)
        bad = {f: [why] for f in ("username", "password") if (why := text_problem(data[f]))}
        if bad:  # PostgreSQL's text refuses NUL: the lookup raised (a 500) instead of failing the login
            raise InvalidInput(bad)
        user = authenticate(request, username=data["username"], password=data["password"])
        if getattr(request, "axes_locked_out", False) or getattr(request._request, "axes_locked_out", False):
            raise Throttled(detail=LOCKED_OUT)
        if user is None or not user.is_active:
            raise InvalidInput({"credentials": ["wrong username or password"]})
        return Response({"token": access_services.token_issue(user), "username": user.get_username(), "is_staff": user.is_staff})
