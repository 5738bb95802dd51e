"""ASGI entry point (daphne): HTTP through Django, websockets through Channels."""
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Django's advice under ASGI: no persistent connections (each executor thread would keep its own,
# closed only by that thread); the relay and the Celery workers keep theirs for 60 s.
os.environ.setdefault("TRAINYARD_DB_CONN_MAX_AGE", "0")

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from controlplane.asgi_handler import get_asgi_application  # noqa: E402

# Django's ASGI handler with the (all synchronous) middleware chain run in one thread hop per
# request instead of ~15 (controlplane/asgi_handler.py).
django_asgi_app = get_asgi_application()

from django.conf import settings  # noqa: E402

from controlplane import daphne_bodies  # noqa: E402
from jobs.bundles.api import MULTIPART_OVERHEAD, UPLOAD_PATH, UploadSizeGuard  # noqa: E402
from jobs.runs.routing import websocket_urlpatterns  # noqa: E402
from jobs.access.ws_auth import WebsocketAuthStack  # noqa: E402

# Under daphne: a body is bounded per path from its headers, before any of it is received (the code
# bundle limit on /api/v1/code/ only, TRAINYARD_HTTP_MAX_BODY_BYTES everywhere else), Twisted does not
# parse multipart bodies in memory on the side, and a connection that dawdles over its headers is
# dropped (controlplane/daphne_bodies.py).
daphne_bodies.install(settings.TRAINYARD_HTTP_MAX_BODY_BYTES,
                      header_deadline_s=settings.TRAINYARD_HTTP_HEADER_TIMEOUT_S,
                      path_limits={UPLOAD_PATH: (settings.TRAINYARD_BUNDLE_MAX_BYTES + MULTIPART_OVERHEAD, "file",
                                                 "TRAINYARD_BUNDLE_MAX_BYTES")})

application = ProtocolTypeRouter({
    # daphne serves no files itself: static/ (CSS, ES modules, vendored uPlot) comes through Django's
    # finders, so a checkout works without collectstatic. Behind a CDN/nginx this is simply unused.
    # Code bundle uploads over the size limit, and other bodies over TRAINYARD_HTTP_MAX_BODY_BYTES, are
    # refused before Django spools their body (for ASGI servers other than daphne).
    "http": UploadSizeGuard(ASGIStaticFilesHandler(django_asgi_app), settings.TRAINYARD_BUNDLE_MAX_BYTES,
                            settings.TRAINYARD_HTTP_MAX_BODY_BYTES),
    "websocket": WebsocketAuthStack(URLRouter(websocket_urlpatterns)),
})
