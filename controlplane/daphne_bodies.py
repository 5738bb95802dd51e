"""Request bodies under daphne: bounded, and not parsed by Twisted.

daphne (4.2) serves HTTP with Twisted's `http.Request`, which by default parses every POST
multipart/form-data body into `request.args`, the whole body in memory, and with it several
copies: a 48 MiB code bundle upload made daphne's RSS peak 14x that, at ~720 MiB, before Django
saw a byte (Twisted documents this: `parsePOSTFormSubmission` "can use large amounts of memory
for large uploads"; daphne never reads `args`). Twisted also receives the whole body before daphne
hands the request to the application, so no limit in Django or ASGI middleware can stop a body
from arriving.

`install(max_body)` makes daphne's request class one that skips that parse and answers 413 and
closes the connection as soon as a body's Content-Length, or the bytes of a chunked body, pass
`max_body`, before the body is read. controlplane/asgi.py installs it with the code bundle limit
(TRAINYARD_BUNDLE_MAX_BYTES plus the multipart envelope), the largest body any endpoint takes;
daphne imports the application before it builds a protocol, so every request gets it.

With `header_deadline_s` (settings.TRAINYARD_HTTP_HEADER_TIMEOUT_S) a connection that has not sent
its first request's headers that long after opening is dropped (a slow-loris client, which Twisted's
per-byte idle timeout never stops).
"""
from __future__ import annotations

import json

from daphne import http_protocol

_original = http_protocol.WebRequest


class BoundedWebRequest(_original):
    max_body = 0
    """Set by install(); bodies over it are refused."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._parsePOSTFormSubmission = False  # Twisted's own multipart parse: the whole body in memory
        self._body_bytes = 0
        self._refused = False

    def gotLength(self, length):
        # Twisted calls this once every header of the request has arrived.
        self.channel.trainyard_headers_done = True
        super().gotLength(length)
        if length is not None and length > self.max_body:
            self._refuse(f"the request body is {length} bytes; the largest accepted is {self.max_body}")

    def handleContentChunk(self, data):
        if self._refused:
            return
        self._body_bytes += len(data)
        if self._body_bytes > self.max_body:
            self._refuse(f"the request body is over {self.max_body} bytes")
            return
        super().handleContentChunk(data)

    def requestReceived(self, command, path, version):
        if self._refused:
            return
        super().requestReceived(command, path, version)

    def _refuse(self, message: str) -> None:
        self._refused = True
        body = json.dumps({"errors": {"file": [message]}}).encode()
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


def install(max_body: int, header_deadline_s: float = 0.0) -> None:
    """Every request daphne builds from now on is a BoundedWebRequest with this limit; with
    `header_deadline_s`, every connection that has not sent its first request's headers that long
    after it opened is dropped."""
    global _header_deadline_s
    BoundedWebRequest.max_body = int(max_body)
    http_protocol.WebRequest = BoundedWebRequest
    _header_deadline_s = float(header_deadline_s)
    http_protocol.HTTPFactory.buildProtocol = _build_with_header_deadline
