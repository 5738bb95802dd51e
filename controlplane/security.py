"""Secrets and sessions from the environment (issue 15, section 3), read by one block of
controlplane/settings.py; plain functions of an environ mapping so tests call them directly.

- secret_key: DJANGO_SECRET_KEY, else a key generated once into <var>/secret_key, 0600 in a 0700
  state directory (tightened at start if an older version left them readable).
- allowed_hosts: the local names always, plus DJANGO_ALLOWED_HOSTS; never `*` unless configured.
- trusted_proxies: TRAINYARD_TRUSTED_PROXIES, the reverse proxies whose X-Forwarded-For is believed
  (jobs/core/client_ip.py; default none: the peer's address is the client's).
- ws_origins: TRAINYARD_WS_ORIGINS, the exact origins (scheme://host[:port]) browsers may open
  websockets from; unset means the origin being served (jobs/access/ws_auth.py).
- cookies: HttpOnly and SameSite=Lax always; with TRAINYARD_TLS=1 (served over https, directly or
  behind a proxy that sets X-Forwarded-Proto) Secure cookies, HSTS and the proxy's scheme header.
"""
from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path

from trainyard.private import private_dir, tighten, write_private

LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")
DEFAULT_HSTS_SECONDS = 365 * 86400


def env_list(env: Mapping[str, str], name: str) -> list[str]:
    return [item.strip() for item in env.get(name, "").split(",") if item.strip()]


def secret_key(env: Mapping[str, str], var_dir: Path) -> str:
    tighten(var_dir)  # the state directory (database, admin password) is private even with the key in env
    key = env.get("DJANGO_SECRET_KEY")
    if key:
        return key
    # A per-checkout key persisted under var/ so sessions survive restarts without a committed secret.
    private_dir(var_dir)
    path = var_dir / "secret_key"
    tighten(path)
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = ""
    if not key:
        key = secrets.token_urlsafe(50)
        write_private(path, key)
    return key


def allowed_hosts(env: Mapping[str, str]) -> list[str]:
    """The local names, then DJANGO_ALLOWED_HOSTS (comma-separated) added to them."""
    return list(dict.fromkeys([*LOCAL_HOSTS, *env_list(env, "DJANGO_ALLOWED_HOSTS")]))


def trusted_proxies(env: Mapping[str, str]) -> list[str]:
    """TRAINYARD_TRUSTED_PROXIES: comma-separated addresses or CIDRs of the reverse proxies in front of
    the web (default none). Only a request whose peer is one of them has its X-Forwarded-For read
    (jobs/core/client_ip.py); each entry must parse, or the settings refuse to load."""
    import ipaddress

    out = []
    for item in env_list(env, "TRAINYARD_TRUSTED_PROXIES"):
        try:
            out.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            raise ValueError(f"TRAINYARD_TRUSTED_PROXIES: {item[:100]!r} is not an address or CIDR "
                             "(e.g. 10.0.0.5, 10.0.0.0/24, ::1)") from None
    return out


def ws_origins(env: Mapping[str, str]) -> list[str]:
    """TRAINYARD_WS_ORIGINS: comma-separated origins such as https://trainyard.example.com (a
    default port may be left out). Each must be scheme://host[:port] with http or https."""
    from urllib.parse import urlsplit

    out = []
    for origin in env_list(env, "TRAINYARD_WS_ORIGINS"):
        try:
            parts = urlsplit(origin)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError:
            parts = None
        if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
                or parts.path not in ("", "/") or parts.query or parts.username):
            raise ValueError(f"TRAINYARD_WS_ORIGINS: {origin[:100]!r} is not an origin like https://host[:port]")
        out.append(origin)
    return out


def cookie_settings(env: Mapping[str, str]) -> dict:
    """Session and CSRF cookie flags; Secure, HSTS and the proxy's scheme header when TRAINYARD_TLS=1."""
    out = {"SESSION_COOKIE_HTTPONLY": True, "SESSION_COOKIE_SAMESITE": "Lax", "CSRF_COOKIE_SAMESITE": "Lax",
           # The page's JavaScript reads the CSRF cookie (static/js/util.js), so it is not HttpOnly.
           "CSRF_COOKIE_HTTPONLY": False}
    if env.get("TRAINYARD_TLS", "0") == "1":
        out |= {"SESSION_COOKIE_SECURE": True, "CSRF_COOKIE_SECURE": True,
                "SECURE_HSTS_SECONDS": int(env.get("TRAINYARD_HSTS_SECONDS") or DEFAULT_HSTS_SECONDS),
                # daphne listens on 127.0.0.1 behind the TLS proxy, which must set this header.
                "SECURE_PROXY_SSL_HEADER": ("HTTP_X_FORWARDED_PROTO", "https")}
    return out


def derived_key(secret: str, purpose: str) -> str:
    """A key for one purpose derived from `secret` (HMAC-SHA256, hex): the node credentials' master
    key by default, so a fresh `make run` needs no second secret file."""
    import hashlib
    import hmac

    return hmac.new(secret.encode(), f"trainyard:{purpose}".encode(), hashlib.sha256).hexdigest()
