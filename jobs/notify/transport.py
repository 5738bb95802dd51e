"""The notifications' I/O with the outside: resolving a webhook's host, and one POST to the checked
address (the policy's `pick_address`), never to the name again (no DNS rebinding between check and
connect). Bounded: connect and every read within `timeout_s`, at most `max_bytes` of the answer
read, the whole try within `deadline_s`; redirects are answered, never followed (http.client
follows none), so a 3xx counts as a failed try."""
from __future__ import annotations

import http.client
import socket
import ssl
import time

from jobs.notify.policy.targets import Target, TargetError, literal_address

MAX_ANSWER_BYTES = 64 * 1024


def resolve(target: Target) -> list[str]:
    """The host's addresses (an address literal is its own); TargetError when it does not resolve."""
    if literal_address(target.host) is not None:
        return [target.host]
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise TargetError(f"{target.host!r} does not resolve ({exc})") from None
    seen: list[str] = []
    for info in infos:
        address = info[4][0].split("%")[0]
        if address not in seen:
            seen.append(address)
    return seen


class _PinnedHTTP(http.client.HTTPConnection):
    def __init__(self, target: Target, address: str, timeout_s: float):
        super().__init__(target.host, target.port, timeout=timeout_s)
        self._address = address

    def connect(self):
        self.sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """TLS to the checked address, the certificate verified against the URL's host name (SNI too)."""

    def __init__(self, target: Target, address: str, timeout_s: float):
        super().__init__(target.host, target.port, timeout=timeout_s, context=ssl.create_default_context())
        self._address = address

    def connect(self):
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def post(target: Target, address: str, body: bytes, headers: dict[str, str], *, timeout_s: float,
         deadline_s: float) -> tuple[int | None, str]:
    """POST `body`; (HTTP status, "") or (status or None, what went wrong), never raising."""
    cls = _PinnedHTTPS if target.scheme == "https" else _PinnedHTTP
    conn = cls(target, address, timeout_s)
    started = time.monotonic()
    try:
        conn.putrequest("POST", target.path, skip_host=True, skip_accept_encoding=True)
        for name, value in {"Host": target.host_header, "Content-Length": str(len(body)), **headers}.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        answer = conn.getresponse()
        read = 0
        while read < MAX_ANSWER_BYTES and time.monotonic() - started < deadline_s:
            chunk = answer.read1(MAX_ANSWER_BYTES - read) if hasattr(answer, "read1") else answer.read(4096)
            if not chunk:
                break
            read += len(chunk)
        status = answer.status
        if 300 <= status < 400:
            return status, f"redirect to {answer.getheader('Location', '')[:200]!r} not followed"
        return status, "" if 200 <= status < 300 else f"HTTP {status} {answer.reason[:100]}"
    except (OSError, http.client.HTTPException, ssl.SSLError, ValueError) as exc:
        kind = "timed out" if isinstance(exc, (socket.timeout, TimeoutError)) else type(exc).__name__
        return None, f"{kind}: {exc}"[:500] if str(exc) else kind
    finally:
        conn.close()
