"""Websocket authentication: browsers use their session and must come from an allowed Origin;
non-browser clients send `Authorization: Token <key>` and no Origin (docs/architecture.md, section 7).

A socket with an Origin that is not ours is refused at the handshake (cross-site websocket
hijacking would otherwise ride on the session cookie). A socket without an Origin is not a
browser, so its cookies are ignored and only a token authenticates it.
"""
from __future__ import annotations

from urllib.parse import urlparse

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.utils.http import is_same_domain


def origin_allowed(origin: bytes, host: bytes | None) -> bool:
    try:
        parsed = urlparse(origin.decode("latin1"))
    except ValueError:
        return False
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return False
    if host is not None and parsed.netloc.lower() == host.decode("latin1").lower():
        return True  # same origin as the page that opened the socket
    return any(pattern == "*" or is_same_domain(parsed.hostname, pattern) for pattern in settings.ALLOWED_HOSTS)


@database_sync_to_async
def _token_user(key: str):
    from rest_framework.authtoken.models import Token

    try:
        token = Token.objects.select_related("user").get(key=key)
    except Token.DoesNotExist:
        return AnonymousUser()
    return token.user if token.user.is_active else AnonymousUser()


class OriginOrTokenMiddleware:
    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin")
        if origin is not None:
            if not origin_allowed(origin, headers.get(b"host")):
                return await WebsocketDenier()(scope, receive, send)
        else:
            auth = headers.get(b"authorization", b"").decode("latin1")
            scope = dict(scope)
            if auth.startswith("Token ") and len(auth) > 6:
                scope["user"] = await _token_user(auth[6:].strip())
            else:
                scope["user"] = AnonymousUser()
        return await self.inner(scope, receive, send)


def WebsocketAuthStack(inner):  # noqa: N802 - reads like Channels' own AuthMiddlewareStack
    return AuthMiddlewareStack(OriginOrTokenMiddleware(inner))
