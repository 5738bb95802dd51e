"""controlplane/daphne_bodies.py: each request's body limit is chosen from its path, decoded as daphne
decodes it for the application (so the limit is that of the view the request reaches)."""
from __future__ import annotations

from controlplane import daphne_bodies
from controlplane.daphne_bodies import request_path


def test_request_path_is_the_path_django_sees():
    assert request_path(b"/api/v1/code/") == "/api/v1/code/"
    assert request_path(b"/api/v1/code/?upload=1") == "/api/v1/code/"
    assert request_path(b"/api/v1/%63ode/") == "/api/v1/code/"
    assert request_path(b"/api/v1/jobs/?next=/api/v1/code/") == "/api/v1/jobs/"
    assert request_path("/caf\u00e9".encode()) is None


def test_install_sets_a_default_and_per_path_limits(monkeypatch):
    monkeypatch.setattr(daphne_bodies.BoundedWebRequest, "max_body", 0)
    monkeypatch.setattr(daphne_bodies.BoundedWebRequest, "path_limits", {})
    monkeypatch.setattr(daphne_bodies.http_protocol, "WebRequest", daphne_bodies.http_protocol.WebRequest)
    monkeypatch.setattr(daphne_bodies.http_protocol.HTTPFactory, "buildProtocol",
                        daphne_bodies.http_protocol.HTTPFactory.buildProtocol)
    daphne_bodies.install(1024, path_limits={"/api/v1/code/": (5000, "file", "TRAINYARD_BUNDLE_MAX_BYTES")})
    assert daphne_bodies.BoundedWebRequest.max_body == 1024
    assert daphne_bodies.BoundedWebRequest.path_limits == {"/api/v1/code/": (5000, "file", "TRAINYARD_BUNDLE_MAX_BYTES")}
    assert daphne_bodies.http_protocol.WebRequest is daphne_bodies.BoundedWebRequest


def test_the_asgi_guard_bounds_other_paths_by_content_length():
    """For ASGI servers other than daphne: the same limits from Content-Length."""
    import asyncio

    from jobs.bundles.api import UploadSizeGuard

    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    async def call(path, length):
        sent = []

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-length", str(length).encode())]}
        await UploadSizeGuard(app, 10_000, 1000)(scope, None, send)
        return sent

    over = asyncio.run(call("/api/v1/jobs/", 1001))
    assert over[0]["status"] == 413 and b"TRAINYARD_HTTP_MAX_BODY_BYTES" in over[1]["body"]
    assert asyncio.run(call("/api/v1/jobs/", 1000)) == [] and asyncio.run(call("/api/v1/code/", 5000)) == []
    assert seen == ["/api/v1/jobs/", "/api/v1/code/"]
