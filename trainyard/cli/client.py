"""HTTP to the control plane's REST API (stdlib urllib) with every failure turned into one CliError line.

API errors arrive as {"errors": {"field.path": ["message"]}} (docs/architecture.md, section 7);
they are shown as "field.path: message; ...", prefixed by what the command was doing.
"""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
import uuid

from .errors import CliError

TIMEOUT_S = 60.0


def error_text(status: int, body) -> str:
    """One line from an API error body: the field paths and their messages."""
    errors = body.get("errors") if isinstance(body, dict) else None
    if not isinstance(errors, dict) or not errors:
        return f"HTTP {status}"
    parts = []
    for field, messages in errors.items():
        for message in messages if isinstance(messages, list) else [messages]:
            text = " ".join(str(message).split())
            parts.append(text if field == "detail" else f"{field}: {text}")
    return "; ".join(parts)


class Api:
    def __init__(self, url: str, token: str | None = None, *, timeout: float = TIMEOUT_S):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def ws_url(self, path: str) -> str:
        scheme, rest = self.url.split("://", 1)
        return f"{'wss' if scheme == 'https' else 'ws'}://{rest}{path}"

    def headers(self) -> dict[str, str]:
        h = {"Accept": "application/json", "User-Agent": "trainyard-cli"}
        if self.token:
            h["Authorization"] = f"Token {self.token}"
        return h

    def request(self, method: str, path: str, *, body=None, params: dict | None = None,
                data: bytes | None = None, content_type: str | None = None, doing: str = ""):
        """The decoded JSON answer of a 2xx; CliError("<doing>: <problem>") otherwise."""
        query = {k: v for k, v in (params or {}).items() if v is not None}
        url = self.url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        headers = self.headers()
        if body is not None:
            data, content_type = json.dumps(body).encode(), "application/json"
        if content_type:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        prefix = f"{doing}: " if doing else ""
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except urllib.error.URLError as exc:
            raise CliError(f"{prefix}cannot reach {self.url}: {getattr(exc.reason, 'strerror', None) or exc.reason}") \
                from None
        except (TimeoutError, socket.timeout):
            raise CliError(f"{prefix}{self.url} did not answer within {self.timeout:.0f} s") from None
        except OSError as exc:
            raise CliError(f"{prefix}cannot reach {self.url}: {exc.strerror or exc}") from None
        try:
            decoded = json.loads(raw) if raw else None
        except ValueError:
            raise CliError(f"{prefix}HTTP {status} from {method} {path} is not a Trainyard API answer "
                           f"(is {self.url} a Trainyard server?)") from None
        if 200 <= status < 300:
            return decoded
        if status == 401 and self.token:
            raise CliError(f"{prefix}the server refused the token (HTTP 401): run `trainyard login URL` again")
        raise CliError(f"{prefix}{error_text(status, decoded)} (HTTP {status})")

    def get(self, path: str, *, params: dict | None = None, doing: str = ""):
        return self.request("GET", path, params=params, doing=doing)

    def post(self, path: str, body=None, *, doing: str = ""):
        return self.request("POST", path, body=body if body is not None else {}, doing=doing)

    def patch(self, path: str, body: dict, *, doing: str = ""):
        return self.request("PATCH", path, body=body, doing=doing)

    def upload(self, path: str, field: str, filename: str, payload: bytes, *, doing: str = ""):
        """POST one file as multipart/form-data."""
        boundary = f"trainyard-{uuid.uuid4().hex}"
        head = (f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{filename}"\r\n'
                f"Content-Type: application/gzip\r\n\r\n").encode()
        data = head + payload + f"\r\n--{boundary}--\r\n".encode()
        return self.request("POST", path, data=data, content_type=f"multipart/form-data; boundary={boundary}",
                            doing=doing)
