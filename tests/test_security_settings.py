"""Issue 15, section 3: ALLOWED_HOSTS, websocket origins and cookie flags as the real settings module
computes them from the environment (one process per environment)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane import security

REPO = Path(__file__).resolve().parent.parent
NAMES = ["ALLOWED_HOSTS", "TRAINYARD_WS_ORIGINS", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SESSION_COOKIE_HTTPONLY",
         "SESSION_COOKIE_SAMESITE", "CSRF_COOKIE_SAMESITE", "SECURE_HSTS_SECONDS", "SECURE_PROXY_SSL_HEADER"]
SHOW = f"""
import json
from django.conf import settings
print(json.dumps({{n: getattr(settings, n, None) for n in {NAMES!r}}}))
"""


def settings_under(tmp_path, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "TRAINYARD_"))}
    base |= {"DJANGO_SETTINGS_MODULE": "controlplane.settings", "TRAINYARD_VAR_DIR": str(tmp_path / "var"), **env}
    out = subprocess.run([sys.executable, "-c", SHOW], cwd=REPO, env=base, check=True, timeout=60,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def test_defaults_local_hosts_only_and_no_secure_cookies_over_http(tmp_path):
    s = settings_under(tmp_path)
    # before: ["127.0.0.1", "localhost", "testserver"], and DJANGO_ALLOWED_HOSTS replaced the local names
    assert s["ALLOWED_HOSTS"] == ["127.0.0.1", "localhost", "[::1]"] and "*" not in s["ALLOWED_HOSTS"]
    assert s["TRAINYARD_WS_ORIGINS"] == []
    assert s["SESSION_COOKIE_HTTPONLY"] is True and s["SESSION_COOKIE_SAMESITE"] == "Lax"
    assert s["CSRF_COOKIE_SAMESITE"] == "Lax"
    assert s["SESSION_COOKIE_SECURE"] is False and s["CSRF_COOKIE_SECURE"] is False
    assert s["SECURE_HSTS_SECONDS"] == 0 and s["SECURE_PROXY_SSL_HEADER"] is None


def test_tls_switch_sets_secure_cookies_hsts_and_the_proxy_header(tmp_path):
    s = settings_under(tmp_path, TRAINYARD_TLS="1", DJANGO_ALLOWED_HOSTS="ty.example, ty2.example",
                       TRAINYARD_WS_ORIGINS="https://ty.example")
    assert s["ALLOWED_HOSTS"] == ["127.0.0.1", "localhost", "[::1]", "ty.example", "ty2.example"]
    assert s["TRAINYARD_WS_ORIGINS"] == ["https://ty.example"]
    assert s["SESSION_COOKIE_SECURE"] is True and s["CSRF_COOKIE_SECURE"] is True
    assert s["SECURE_HSTS_SECONDS"] == 365 * 86400
    assert s["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert s["SESSION_COOKIE_HTTPONLY"] is True and s["SESSION_COOKIE_SAMESITE"] == "Lax"


@pytest.mark.parametrize("bad", ["ty.example", "https://ty.example/path", "ftp://ty.example", "https://u:p@ty.example",
                                 "https://ty.example:99999", "null"])
def test_a_malformed_websocket_origin_is_refused_at_start(bad):
    with pytest.raises(ValueError, match="TRAINYARD_WS_ORIGINS"):
        security.ws_origins({"TRAINYARD_WS_ORIGINS": bad})


def test_hsts_seconds_configurable():
    assert security.cookie_settings({"TRAINYARD_TLS": "1", "TRAINYARD_HSTS_SECONDS": "3600"})["SECURE_HSTS_SECONDS"] == 3600
