"""Request bodies under daphne: bounded, and not parsed by Twisted.

daphne (4.2) serves HTTP with Twisted's `http.Request`, which by default parses every POST
multipart/form-data body into `request.args`, the whole body in memory, and with it several
copies: a 48 MiB code bundle upload made daphne's RSS peak 14x that, at ~720 MiB, before Django
saw a byte (Twisted documents this: `parsePOSTFormSubmission` "can use large amounts of memory
for large uploads"; daphne never reads `args`). Twisted also receives the whole body before daphne
hands the request to the application, so no limit in Django or ASGI middleware can stop a body
from arriving.

`install(max_body, path_limits=...)` makes daphne's request class one that skips that parse and
answers 413 and closes the connection as soon as a body's Content-Length, or the bytes of a chunked
body, pass the limit of the request's path, before the body is read. The limit is decided from the
request line once the headers are in (before authentication, before any body byte is accepted):
`path_limits` names the paths that take more (controlplane/asgi.py: /api/v1/code/, the code
bundle limit TRAINYARD_BUNDLE_MAX_BYTES plus the multipart envelope), every other path gets
`max_body` (TRAINYARD_HTTP_MAX_BODY_BYTES, 1 MiB): before, every path took a 100 MB body from
anyone. The path is decoded as daphne decodes it for the application (query string dropped,
percent-escapes undone), so a request reaches the view its limit was chosen for. daphne imports
the application before it builds a protocol, so every request gets it.

With `header_deadline_s` (settings.TRAINYARD_HTTP_HEADER_TIMEOUT_S) a connection that has not sent
its first request's headers that long after opening is dropped (a slow-loris client, which Twisted's
per-byte idle timeout never stops).
"""
from __future__ import annotations

import json

from urllib.parse import unquote

from daphne import http_protocol

_original = http_protocol.WebRequest


def request_path(target: bytes) -> str | None:
    """The path the application will see for a request-target, as daphne computes it (the query
    string dropped, percent-escapes undone); None when it is not ASCII (daphne refuses those)."""
    try:
        return unquote(target.split(b"?", 1)[0].decode("ascii"))
    except UnicodeDecodeError:
        return None


class BoundedWebRequest(_original):
    max_body = 0
    """Set by install(): the limit of every path not in `path_limits`."""
    path_limits: dict[str, tuple[int, str, str]] = {}
    """Set by install(): path -> (limit, the field its refusal names, the setting that sets it)."""
    default_setting = "TRAINYARD_HTTP_MAX_BODY_BYTES"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._parsePOSTFormSubmission = False  # Twisted's own multipart parse: the whole body in memory
        self._body_bytes = 0
        self._refused = False
        self._limit, self._field, self._setting = self.max_body, "detail", self.default_setting

    def gotLength(self, length):
        # Twisted calls this once every header of the request has arrived (the request line's target
        # is on the channel; the request's own uri is set only once the body is in).
        self.channel.trainyard_headers_done = True
        super().gotLength(length)
        path = request_path(getattr(self.channel, "_path", b"") or b"")
        self._limit, self._field, self._setting = self.path_limits.get(
            path, (self.max_body, "detail", self.default_setting))
        if length is not None and length > self._limit:
            self._refuse(f"the request body is {length} bytes; the largest accepted is {self._limit} "
                         f"({self._setting})")

    def handleContentChunk(self, data):
        if self._refused:
            return
        self._body_bytes += len(data)
        if self._body_bytes > self._limit:
            self._refuse(f"the request body is over {self._limit} bytes ({self._setting})")
            return
        super().handleContentChunk(data)

    def requestReceived(self, command, path, version):
        if self._refused:
            return
        super().requestReceived(command, path, version)

    def _refuse(self, message: str) -> None:
        self._refused = True
        body = json.dumps({"errors": {self._field: [message]}}).encode()
        head = ("HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        self.channel.transport.write(head + body)
        self.channel.transport.loseConnection()


_original_build = http_protocol.HTTPFactory.buildProtocol


def _abort_without_headers(protocol) -> None:
    # Twisted's factory returns a wrapper; the HTTPChannel (the requests' `channel`) is inside it.
    channel = getattr(protocol, "_channel", protocol)
    transport = getattr(channel, "transport", None)
    if not getattr(channel, "trainyard_headers_done", False) and transport is not None:
        transport.abortConnection()


def _build_with_header_deadline(factory, addr):
    # Slow loris: Twisted's only limit is an idle timeout (12 h) that every byte resets, so a client
    # sending a header byte every few seconds (a websocket upgrade never finished) holds its socket,
    # and a few hundred such clients the process's file descriptors. A connection must finish its
    # first request's headers within the deadline, or it is dropped.
    channel = _original_build(factory, addr)
    if _header_deadline_s:
        channel.callLater(_header_deadline_s, _abort_without_headers, channel)
    return channel


_header_deadline_s = 0.0


def install(max_body: int, header_deadline_s: float = 0.0, *,
            path_limits: dict[str, tuple[int, str, str]] | None = None) -> None:
    """Every request daphne builds from now on is a BoundedWebRequest: a body over `max_body`, or
    over its path's limit in `path_limits` ({path: (limit, field, setting)}), is refused from its
    headers; with `header_deadline_s`, every connection that has not sent its first request's
    headers that long after it opened is dropped."""
    global _header_deadline_s
    BoundedWebRequest.max_body = int(max_body)
    BoundedWebRequest.path_limits = {p: (int(n), f, s) for p, (n, f, s) in (path_limits or {}).items()}
    http_protocol.WebRequest = BoundedWebRequest
    _header_deadline_s = float(header_deadline_s)
    http_protocol.HTTPFactory.buildProtocol = _build_with_header_deadline
