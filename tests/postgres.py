"""A real PostgreSQL server for the tests (issue 16, section 2), like `RedisServer` for Redis.

`PostgresServer` runs Debian's initdb/postgres (/usr/lib/postgresql/*/bin, the newest) in a
temporary directory, on a free loopback port, fsync off. initdb refuses to run as root, so under
root (here and in CI) the cluster belongs to `nobody` and the server runs as `nobody` (setpriv);
the test process connects over TCP as the cluster's superuser `postgres` (trust on loopback only).

As a pytest plugin (`pytest -p tests.postgres --postgres`, or TRAINYARD_TEST_POSTGRES=1 with
`-p tests.postgres`; `make test-postgres` does this), it starts one server before Django's settings
are read, sets DATABASE_URL so pytest-django creates its test database there and every process a
test starts (tests/integration/cluster.py, which makes each cluster a database of its own) uses
it too, and stops the server when the session ends (or the interpreter exits).
"""
from __future__ import annotations

import atexit
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

ADMIN_URL_ENV = "TRAINYARD_TEST_POSTGRES_ADMIN_URL"  # the server's maintenance database, for CREATE DATABASE


def postgres_bin_dir() -> Path:
    """Debian's server binaries (not on PATH): the newest /usr/lib/postgresql/<v>/bin with initdb,
    else TRAINYARD_PG_BIN, else the directory of an initdb on PATH."""
    if os.environ.get("TRAINYARD_PG_BIN"):
        return Path(os.environ["TRAINYARD_PG_BIN"])
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: [int(x) if x.isdigit() else 0 for x in Path(p).parent.parent.name.split(".")])
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).resolve().parent
    raise RuntimeError("PostgreSQL's server is not installed: run `make test-postgres` "
                       "(installs Debian's postgresql) or apt-get install postgresql")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """initdb + postgres in `workdir` (made if missing); start() waits until it accepts connections."""

    def __init__(self, workdir: Path | None = None, port: int | None = None):
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="trainyard-pg-"))
        self.port = port or _free_port()
        self.proc: subprocess.Popen | None = None
        self.bin = postgres_bin_dir()
        self._owned_dir = workdir is None

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}?sslmode=disable"

    def _as_owner(self) -> list[str]:
        if os.geteuid() != 0:
            return []
        return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]

    def start(self, timeout_s: float = 30.0) -> "PostgresServer":
        data = self.dir / "data"
        self.dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(self.dir, nobody.pw_uid, nobody.pw_gid)
        if not (data / "PG_VERSION").exists():
            subprocess.run(self._as_owner() + [
                str(self.bin / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                "-E", "UTF8", "--locale=C", "--no-sync"], check=True, capture_output=True, timeout=120)
        log = open(self.dir / "postgres.log", "ab")
        self.proc = subprocess.Popen(self._as_owner() + [
            str(self.bin / "postgres"), "-D", str(data), "-k", str(self.dir), "-h", "127.0.0.1",
            "-p", str(self.port), "-c", "fsync=off", "-c", "synchronous_commit=off",
            "-c", "full_page_writes=off", "-c", "max_connections=300", "-c", "shared_buffers=64MB",
            "-c", "timezone=UTC"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}:\n"
                                   + (self.dir / "postgres.log").read_text(errors="replace")[-3000:])
            if self._ready():
                return self
            time.sleep(0.1)
        raise RuntimeError(f"postgres did not accept connections on port {self.port}")

    def _ready(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.url(), connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def stop(self, *, keep_data: bool = False) -> None:
        """Fast shutdown; the data directory is removed (when this object made it) unless keep_data
        (then start() brings the same cluster back on the same port)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # "fast" shutdown (SIGTERM's "smart" one waits for clients)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._owned_dir and not keep_data:
            shutil.rmtree(self.dir, ignore_errors=True)


def create_database(name: str) -> str | None:
    """With the plugin's server running: a new database on it (its URL); else None."""
    admin = os.environ.get(ADMIN_URL_ENV)
    if not admin:
        return None
    import psycopg
    from psycopg import sql

    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return admin.rsplit("/", 1)[0] + "/" + name + "?sslmode=disable"


def fresh_database_env(sqlite_path) -> dict[str, str]:
    """The environment for processes that migrate a database of their own: a new database on the
    session's server under --postgres, else the SQLite file at sqlite_path."""
    url = create_database(f"t_{uuid.uuid4().hex[:16]}")
    return {"DATABASE_URL": url} if url else {"DATABASE_URL": "", "TRAINYARD_DB": str(sqlite_path)}


def current_database_env() -> dict[str, str]:
    """The environment for a process that shares this test's database (Django's default connection)."""
    from django.db import connection

    s = connection.settings_dict
    if connection.vendor == "postgresql":
        return {"DATABASE_URL": f"postgresql://{s['USER']}@{s['HOST']}:{s['PORT']}/{s['NAME']}?sslmode=disable"}
    return {"DATABASE_URL": "", "TRAINYARD_DB": str(s["NAME"])}


# ------------------------------------------------------------------ the pytest plugin
_server: PostgresServer | None = None


def session_server_pids() -> set[int]:
    """The session server's processes (postmaster and backends): what a test that kills every child
    of the test process (Cluster.stop) must leave alone."""
    if _server is None or _server.proc is None:
        return set()
    import psutil

    try:
        server = psutil.Process(_server.proc.pid)
        return {server.pid} | {c.pid for c in server.children(recursive=True)}
    except psutil.Error:
        return set()


def pytest_addoption(parser):
    parser.addoption("--postgres", action="store_true",
                     help="run against a real PostgreSQL server started for the session (tests/postgres.py)")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """Before pytest-django reads the settings: start the server and point DATABASE_URL at it."""
    global _server
    wanted = "--postgres" in args or os.environ.get("TRAINYARD_TEST_POSTGRES") == "1"
    if not wanted or _server is not None:
        return
    _server = PostgresServer().start()
    atexit.register(_server.stop)
    os.environ[ADMIN_URL_ENV] = _server.url()
    # pytest-django creates test_trainyard on it; processes the tests start get their own databases.
    os.environ["DATABASE_URL"] = _server.url("trainyard")


def pytest_report_header(config):
    if _server is not None:
        return [f"postgres: {_server.bin} on 127.0.0.1:{_server.port} ({_server.dir})"]
    return None


def pytest_unconfigure(config):
    global _server
    if _server is not None:
        _server.stop()
        _server = None
