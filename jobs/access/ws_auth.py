"""Websocket authentication: browsers use their session and must come from an allowed Origin;
non-browser clients send `Authorization: Token <key>` and no Origin (docs/architecture.md, section 7).

A socket with an Origin that is not ours is refused at the handshake (cross-site websocket
hijacking would otherwise ride on the session cookie). "Ours" is exact: scheme, host and port
equal to one of settings.TRAINYARD_WS_ORIGINS (TRAINYARD_WS_ORIGINS), or, when that is empty, to
the origin being served: the socket's own scheme (wss, or https from the TLS proxy's header) and
its Host, which must be in ALLOWED_HOSTS. Before, any Origin whose host name matched
ALLOWED_HOSTS passed, whatever its scheme and port (http://localhost:9999, another local app,
could open sockets on the dashboard's session).

A socket without an Origin is not a browser, so its cookies are ignored and only a token
(jobs/access/tokens.py, hashed) authenticates it; scope["token_id"] says which, so revoking that token
closes the socket (jobs/runs/consumers.py).
"""
from __future__ import annotations

from urllib.parse import urlsplit

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.http.request import split_domain_port, validate_host

from jobs.access import tokens

DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin such as https://example.com:8443, the default port made
    explicit; None for anything that is not an http(s) origin ("null", a path, credentials)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if (parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.username is not None
            or parts.path not in ("", "/") or parts.query or parts.fragment):
        return None
    return parts.scheme, parts.hostname.lower(), port or DEFAULT_PORTS[parts.scheme]


def served_origin(scope, headers: dict) -> tuple[str, str, int] | None:
    """The origin this socket is served as: its scheme and Host, if the Host is one of ALLOWED_HOSTS."""
    host = headers.get(b"host", b"").decode("latin1")
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return None
    secure = scope.get("scheme") == "wss"
    proxy = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if proxy:  # ("HTTP_X_FORWARDED_PROTO", "https") -> header x-forwarded-proto
        name = proxy[0].removeprefix("HTTP_").replace("_", "-").lower().encode("latin1")
        secure = secure or headers.get(name, b"").decode("latin1").split(",")[0].strip() == proxy[1]
    return origin_key(f"{'https' if secure else 'http'}://{host}")


def origin_allowed(origin: bytes, scope, headers: dict) -> bool:
    key = origin_key(origin.decode("latin1"))
    if key is None:
        return False
    configured = getattr(settings, "TRAINYARD_WS_ORIGINS", None)
    if configured:
        return key in {origin_key(o) for o in configured}
    return key == served_origin(scope, headers)


@database_sync_to_async
def _token_user(key: str):
    """(user, token id) for a token key; (AnonymousUser, None) for a wrong key or an inactive user."""
    token = tokens.lookup(key)
    if token is None or not token.user.is_active:
        return AnonymousUser(), None
    return token.user, token.pk


class OriginOrTokenMiddleware:
    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin")
        if origin is not None:
            if not origin_allowed(origin, scope, headers):
                return await WebsocketDenier()(scope, receive, send)
        else:
            auth = headers.get(b"authorization", b"").decode("latin1")
            scope = dict(scope)
            if auth.startswith("Token ") and len(auth) > 6:
                scope["user"], scope["token_id"] = await _token_user(auth[6:].strip())
            else:
                scope["user"] = AnonymousUser()
        return await self.inner(scope, receive, send)


def WebsocketAuthStack(inner):  # noqa: N802 - reads like Channels' own AuthMiddlewareStack
    return AuthMiddlewareStack(OriginOrTokenMiddleware(inner))
