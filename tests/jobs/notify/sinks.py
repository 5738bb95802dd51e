"""Real receivers for notifications, in the test's process: a webhook endpoint on 127.0.0.1 (an
http.server in a thread) that verifies nothing itself but records every request, and an SMTP sink
(aiosmtpd) that records every message. Used by the unit tests and by the integration test, whose
notify worker (another process) connects to them over the loopback."""
from __future__ import annotations

import hashlib
import hmac
import threading
import time
from email import message_from_bytes
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.conftest import free_port


def signature_ok(secret: str, body: bytes, header: str | None) -> bool:
    """What a receiver does: HMAC-SHA256 of the raw body with the hook's secret, compared in constant time."""
    expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return header is not None and hmac.compare_digest(expected, header)


class Receiver:
    """Answers each POST with the next of `statuses` (the last one repeats) after `delay_s`; a
    `location` makes it a redirect. `requests`: (headers, body, monotonic time) of each POST."""

    def __init__(self, *, statuses=(200,), delay_s: float = 0.0, location: str | None = None):
        self.statuses, self.delay_s, self.location = list(statuses), delay_s, location
        self.requests: list[tuple[dict, bytes, float]] = []
        self.arrived = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body, time.monotonic()))
                receiver.arrived.set()
                status = receiver.statuses.pop(0) if len(receiver.statuses) > 1 else receiver.statuses[0]
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                try:
                    self.send_response(status)
                    if receiver.location:
                        self.send_header("Location", receiver.location)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:  # the client gave up (timed out) first
                    pass

            def log_message(self, *args):
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class SmtpSink:
    """A real SMTP server (aiosmtpd) on a free loopback port; `messages`: (from, to, email.message)."""

    def __init__(self):
        from aiosmtpd.controller import Controller

        self.messages: list[tuple[str, list[str], object]] = []
        self.arrived = threading.Event()
        sink = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's name
                sink.messages.append((envelope.mail_from, list(envelope.rcpt_tos), message_from_bytes(envelope.content)))
                sink.arrived.set()
                return "250 OK"

        self.port = free_port()
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)

    def __enter__(self) -> "SmtpSink":
        self.controller.start()
        return self

    def __exit__(self, *exc) -> None:
        self.controller.stop()
