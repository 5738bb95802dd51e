"""Django's ASGI handler with the middleware chain run synchronously, in one worker thread per request.

Django's ASGIHandler builds its middleware chain for async mode. Every MiddlewareMixin middleware
(sessions, CSRF, auth, messages, ...) is "async capable" only by running its process_request and
process_response through sync_to_async, and the view middleware and the (sync) view take further
hops: about fifteen event-loop <-> thread switches per request. All of Trainyard's middleware and
views are synchronous, so this handler builds the chain as WSGI does and runs all of it in one
sync_to_async call: the same code in the same order, measured at ~30% less CPU per API request
under daphne (bench/README.md, "load.py"). Reading the body, streaming the response and the
request_started/finished signals stay Django's own (ASGIHandler.handle).
"""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.base import BaseHandler


class SyncChainASGIHandler(ASGIHandler):
    def __init__(self):
        BaseHandler.__init__(self)
        self.load_middleware(is_async=False)

    async def get_response_async(self, request):
        # thread_sensitive: within the request's ThreadSensitiveContext (ASGIHandler.handle), the
        # same thread as the request_started/finished receivers, as Django's own hops would use.
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)


def get_asgi_application() -> SyncChainASGIHandler:
    """django.core.asgi.get_asgi_application with this handler."""
    import django

    django.setup(set_prefix=False)
    return SyncChainASGIHandler()
