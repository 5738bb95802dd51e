"""Shared fixtures. `RedisServer` starts a real redis-server on a free loopback port."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The abuse limits (issue 15) at values no functional test reaches, for this process and every web,
# relay or worker process a test starts with a copy of this environment; the tests about the limits
# set their own (tests/jobs/core/test_abuse_limits.py). An explicit environment still wins.
GENEROUS_LIMITS = {
    "TRAINYARD_THROTTLE_ANON": "1000000/min", "TRAINYARD_THROTTLE_USER": "1000000/min",
    "TRAINYARD_THROTTLE_SUBMIT": "1000000/min", "TRAINYARD_LOGIN_FAILURE_LIMIT": "1000",
    "TRAINYARD_MAX_QUEUED_JOBS_PER_USER": "0", "TRAINYARD_MAX_SOCKETS_PER_USER": "0",
}
for _name, _value in GENEROUS_LIMITS.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="session", autouse=True)
def _generous_limits_in_process():
    """The same for this process: pytest-django reads Django's settings before this file sets the
    environment, so they are set here too (a test's `settings` fixture still overrides them)."""
    from django.conf import settings

    settings.TRAINYARD_THROTTLE_ANON = settings.TRAINYARD_THROTTLE_USER = None
    settings.TRAINYARD_THROTTLE_SUBMIT = None
    settings.AXES_FAILURE_LIMIT = 1000
    settings.TRAINYARD_MAX_QUEUED_JOBS_PER_USER = settings.TRAINYARD_MAX_SOCKETS_PER_USER = 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


PROTO_MAX_BULK_LEN = "8mb"
"""Redis's largest accepted bulk string (issue 21): as `make run` (Procfile) and docs/deploy.md set it,
so an oversized XADD is refused by the server before any reader sees it (default 512 MB)."""


class RedisServer:
    """A real redis-server (AOF on) in its own directory; stop()/start() keep port and data."""

    def __init__(self, workdir: Path, port: int | None = None, acl_nodes: list[str] | None = None,
                 host: str = "127.0.0.1", prefix: list[str] | None = None, tls: bool = False):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        # tls: no plaintext port; TLS on `port` with a certificate for `host` from a CA made here
        # (make_test_ca), and rediss:// URLs that verify it, as docs/deploy.md configures Redis.
        self.ca = make_test_ca(self.dir / "tls", host) if tls else None
        # host: the address it listens on (and clients use); prefix: argv it runs under, e.g.
        # `ip netns exec NS` for a server on a test host of its own (tests/integration/hosts.py).
        self.host = host
        self.prefix = list(prefix or [])
        self.proc: subprocess.Popen | None = None
        # With acl_nodes: make run's ACL users (trainyard/redis_acl.py), the default user off; `url`
        # is then the control plane's and `user_url(node)` a node's.
        self.acl = None
        if acl_nodes is not None:
            from trainyard import redis_acl

            self.acl = redis_acl.write(self.dir, acl_nodes)

    def user_url(self, user: str) -> str:
        from trainyard import redis_acl

        password = redis_acl.password_path(self.dir, user).read_text().strip()
        return redis_acl.url_for(self.base_url, user, password)

    @property
    def base_url(self) -> str:
        if self.ca is None:
            return f"redis://{self.host}:{self.port}/0"
        return f"rediss://{self.host}:{self.port}/0?ssl_cert_reqs=required&ssl_ca_certs={self.ca['ca']}"

    @property
    def url(self) -> str:
        if self.acl is not None:
            from trainyard import redis_acl

            return self.user_url(redis_acl.CONTROL_USER)
        return self.base_url

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: run `make deps` (installs Debian's redis-server)")
        self.proc = subprocess.Popen(
            [*self.prefix, exe, *self._listen(), "--bind", self.host, "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
             "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning",
             "--proto-max-bulk-len", PROTO_MAX_BULK_LEN,
             *(["--aclfile", str(self.acl)] if self.acl is not None else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with self._probe() as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):  # NOAUTH: up, with ACL users
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def _listen(self) -> list[str]:
        if self.ca is None:
            return ["--port", str(self.port)]
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.ca["cert"],
                "--tls-key-file", self.ca["key"], "--tls-ca-cert-file", self.ca["ca"], "--tls-auth-clients", "no"]

    def _probe(self):
        sock = socket.create_connection((self.host, self.port), timeout=0.2)
        if self.ca is None:
            return sock
        import ssl

        return ssl.create_default_context(cafile=self.ca["ca"]).wrap_socket(sock, server_hostname=self.host)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def make_test_ca(directory: Path, host: str) -> dict[str, str]:
    """A throwaway CA and a server certificate for `host` (an IP address) signed by it, made with
    the openssl command (argument lists, no shell); returns the paths of ca, cert and key."""
    directory.mkdir(parents=True, exist_ok=True)
    p = {k: str(directory / f"{k}.pem") for k in ("ca", "ca_key", "cert", "key", "csr")}
    ext = directory / "ext.cnf"
    ext.write_text(f"subjectAltName=IP:{host}\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", p["ca_key"], "-out", p["ca"], "-days", "2",
            "-subj", "/CN=trainyard-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", p["key"], "-out", p["csr"], "-subj", f"/CN={host}")
    openssl("x509", "-req", "-in", p["csr"], "-CA", p["ca"], "-CAkey", p["ca_key"], "-CAcreateserial",
            "-out", p["cert"], "-days", "2", "-extfile", str(ext))
    for k in ("ca_key", "key"):
        os.chmod(p[k], 0o600)
    return p


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def repo_env():
    """Environment for subprocesses that import the project."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
