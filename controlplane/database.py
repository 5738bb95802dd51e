"""DATABASES["default"] from the environment (issue 16, section 2). No Django import: settings.py
calls `database_config(os.environ, var_dir)`, and a bad DATABASE_URL stops the process at start
with a message naming what is wrong, never a silent fall back to SQLite.

- unset or empty DATABASE_URL: SQLite at TRAINYARD_DB (default var/db.sqlite3);
- `postgres://` / `postgresql://USER:PASSWORD@HOST:PORT/NAME?sslmode=verify-full&...`: PostgreSQL
  through psycopg 3. Percent-escapes are decoded (a password may hold `@` or `/` as %40, %2F), a
  host starting with `/` (or `?host=/run/postgresql`) is a Unix socket directory, and libpq's own
  connection parameters in the query (sslmode, sslrootcert, sslcert, sslkey, sslcrl,
  connect_timeout, application_name, target_session_attrs, options, ...) reach libpq as given.
  An unknown query parameter or an sslmode libpq does not know is an error: a misspelled
  `sslmode=require` would otherwise connect without TLS.
- `sqlite:////absolute/path.sqlite3`: SQLite at that path.

Connections: TRAINYARD_DB_CONN_MAX_AGE seconds (default 60) of reuse, with Django's health check
before each reuse, so a restarted server or a connection dropped by a proxy costs one reconnect,
not a failed request or task.
"""
from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
# libpq connection parameters a URL's query may carry (https://www.postgresql.org/docs/current/
# libpq-connect.html#LIBPQ-PARAMKEYWORDS), less those the URL itself spells (host, port, dbname,
# user, password) and those that would read files or services outside this configuration.
LIBPQ_PARAMS = frozenset({
    "sslmode", "sslrootcert", "sslcert", "sslkey", "sslcrl", "sslcrldir", "sslsni", "sslpassword",
    "sslcompression", "ssl_min_protocol_version", "ssl_max_protocol_version", "requiressl",
    "gssencmode", "krbsrvname", "gsslib", "channel_binding", "require_auth",
    "connect_timeout", "application_name", "fallback_application_name", "options",
    "keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count", "tcp_user_timeout",
    "target_session_attrs", "load_balance_hosts", "client_encoding", "hostaddr",
})
# Trainyard's own query parameter: the test database's name (pytest-django's default is test_NAME).
OWN_PARAMS = frozenset({"test_name"})


class DatabaseURLError(ValueError):
    """DATABASE_URL cannot be used; the message says which part and why (never the password)."""


def database_config(env, var_dir: Path) -> dict:
    """The "default" entry of DATABASES for this environment."""
    url = (env.get("DATABASE_URL") or "").strip()
    max_age = _conn_max_age(env.get("TRAINYARD_DB_CONN_MAX_AGE", "60"))
    if not url:
        return sqlite_config(env.get("TRAINYARD_DB") or str(Path(var_dir) / "db.sqlite3"), env, var_dir)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("postgres", "postgresql"):
        return postgres_config(url, max_age)
    if scheme == "sqlite":
        path = unquote(urlsplit(url).path)[1:]  # sqlite:///relative, sqlite:////absolute
        if not path:
            raise DatabaseURLError("DATABASE_URL sqlite:// needs a file path: sqlite:////absolute/path.sqlite3")
        return sqlite_config(path, env, var_dir)
    raise DatabaseURLError(f"DATABASE_URL: unsupported scheme {scheme or '(none)'!r}; "
                           "use postgres://USER:PASSWORD@HOST:PORT/NAME or sqlite:////path")


def _conn_max_age(raw: str) -> int | None:
    raw = raw.strip().lower()
    if raw in ("none", "forever"):
        return None  # Django's "persistent, never closed for age"
    try:
        value = int(raw)
    except ValueError:
        raise DatabaseURLError(f"TRAINYARD_DB_CONN_MAX_AGE must be a whole number of seconds or 'none', "
                               f"not {raw!r}") from None
    if value < 0:
        raise DatabaseURLError("TRAINYARD_DB_CONN_MAX_AGE must not be negative")
    return value


def postgres_config(url: str, max_age: int | None) -> dict:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise DatabaseURLError("DATABASE_URL: the port must be a number from 1 to 65535") from None
    name = unquote(parts.path.lstrip("/"))
    if not name or "/" in name:
        raise DatabaseURLError("DATABASE_URL: name one database after the host: postgres://HOST:PORT/NAME")
    host = _host(parts.netloc)
    options: dict[str, str] = {}
    test_name = None
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key == "host":
            host = value
        elif key == "port":
            if not value.isdigit() or not 0 < int(value) < 65536:
                raise DatabaseURLError("DATABASE_URL: the port must be a number from 1 to 65535")
            port = int(value)
        elif key == "test_name":
            test_name = value
        elif key in LIBPQ_PARAMS:
            options[key] = value
        else:
            raise DatabaseURLError(f"DATABASE_URL: unknown connection parameter {key!r} "
                                   f"(libpq's are: {', '.join(sorted(LIBPQ_PARAMS))})")
    if "sslmode" in options and options["sslmode"] not in SSLMODES:
        raise DatabaseURLError(f"DATABASE_URL: sslmode must be one of {', '.join(SSLMODES)}, "
                               f"not {options['sslmode']!r}")
    config = {
        "ENGINE": "django.db.backends.postgresql", "NAME": name,
        "USER": unquote(parts.username or ""), "PASSWORD": unquote(parts.password or ""),
        "HOST": host, "PORT": str(port or ""), "OPTIONS": options,
        "CONN_MAX_AGE": max_age, "CONN_HEALTH_CHECKS": True,
    }
    if test_name:
        config["TEST"] = {"NAME": test_name}
    return config


def _host(netloc: str) -> str:
    """The host as written (urlsplit's .hostname lowercases, which breaks a socket directory)."""
    hostport = netloc.rsplit("@", 1)[-1]
    if hostport.startswith("["):  # [IPv6]:port
        return hostport[1:hostport.find("]")]
    return unquote(hostport.split(":", 1)[0])


def sqlite_config(path: str, env, var_dir: Path) -> dict:
    # WAL lets the relay write while web and control worker read; BEGIN IMMEDIATE takes the write
    # lock up front so two writers queue on busy_timeout instead of failing mid-transaction with
    # "database is locked" when a read lock tries to upgrade.
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": path,
        "OPTIONS": {
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=20000;",
        },
        # A file, not :memory:, so tests with threads see the same locking as production.
        "TEST": {"NAME": env.get("TRAINYARD_TEST_DB") or str(Path(var_dir) / "test_db.sqlite3")},
    }
