"""Issue 16, section 2: DATABASE_URL as the real settings module reads it (controlplane/database.py).
Each environment in a process of its own, as a deployment starts one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.database import DatabaseURLError, database_config

REPO = Path(__file__).resolve().parent.parent
SHOW = "import json; from django.conf import settings; print(json.dumps(settings.DATABASES['default'], default=str))"


def settings_db(tmp_path, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "TRAINYARD_", "DATABASE_URL"))}
    base |= {"DJANGO_SETTINGS_MODULE": "controlplane.settings", "TRAINYARD_VAR_DIR": str(tmp_path / "var"), **env}
    return subprocess.run([sys.executable, "-c", SHOW], cwd=REPO, env=base, timeout=60, capture_output=True, text=True)


def test_settings_honour_sslmode_and_decode_the_url(tmp_path):
    r = settings_db(tmp_path, DATABASE_URL="postgresql://ty%40app:p%2Fw%3Ad@db.example.org:6543/trainyard"
                                           "?sslmode=verify-full&sslrootcert=/etc/ty/ca.pem&connect_timeout=5")
    assert r.returncode == 0, r.stderr
    db = json.loads(r.stdout.splitlines()[-1])
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["NAME"], db["USER"], db["PASSWORD"], db["HOST"], db["PORT"]) == (
        "trainyard", "ty@app", "p/w:d", "db.example.org", "6543")
    assert db["OPTIONS"] == {"sslmode": "verify-full", "sslrootcert": "/etc/ty/ca.pem", "connect_timeout": "5"}
    assert db["CONN_MAX_AGE"] == 60 and db["CONN_HEALTH_CHECKS"] is True


def test_the_web_process_holds_no_persistent_connection(tmp_path):
    """Under ASGI (daphne imports controlplane.asgi) Django advises CONN_MAX_AGE 0; workers keep 60."""
    show = ("import json, controlplane.asgi; from django.conf import settings; "
            "print(json.dumps(settings.DATABASES['default']['CONN_MAX_AGE']))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "TRAINYARD_", "DATABASE_URL"))}
    env |= {"TRAINYARD_VAR_DIR": str(tmp_path / "var"), "DATABASE_URL": "postgres://u@db/trainyard"}
    r = subprocess.run([sys.executable, "-c", show], cwd=REPO, env=env, timeout=60, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "0"


def test_settings_refuse_a_misspelled_sslmode_instead_of_connecting_in_clear(tmp_path):
    r = settings_db(tmp_path, DATABASE_URL="postgres://u:pw@db/trainyard?sslmode=requir")
    assert r.returncode != 0
    assert "sslmode must be one of disable, allow, prefer, require, verify-ca, verify-full, not 'requir'" in r.stderr
    assert "pw" not in r.stderr.replace("pw@", "")  # the password is never echoed


def test_settings_refuse_an_unknown_scheme_instead_of_falling_back_to_sqlite(tmp_path):
    r = settings_db(tmp_path, DATABASE_URL="postgress://u@db/trainyard")
    assert r.returncode != 0 and "unsupported scheme 'postgress'" in r.stderr


def test_sqlite_stays_the_default(tmp_path):
    r = settings_db(tmp_path)
    assert r.returncode == 0, r.stderr
    db = json.loads(r.stdout.splitlines()[-1])
    assert db["ENGINE"] == "django.db.backends.sqlite3" and db["NAME"] == str(tmp_path / "var" / "db.sqlite3")
    assert db["OPTIONS"]["transaction_mode"] == "IMMEDIATE"


def test_socket_directory_host_keeps_its_case_and_query_host_wins():
    db = database_config({"DATABASE_URL": "postgresql://ty@%2Fvar%2Frun%2FPostgreSQL/trainyard"}, Path("/v"))
    assert db["HOST"] == "/var/run/PostgreSQL" and db["PORT"] == ""
    db = database_config({"DATABASE_URL": "postgres:///trainyard?host=/run/postgresql&port=5433"}, Path("/v"))
    assert (db["HOST"], db["PORT"]) == ("/run/postgresql", "5433")
    db = database_config({"DATABASE_URL": "postgres://u@[::1]:5432/t"}, Path("/v"))
    assert db["HOST"] == "::1"


@pytest.mark.parametrize("url, message", [
    ("postgres://u@db/trainyard?sslmod=require", "unknown connection parameter 'sslmod'"),
    ("postgres://u@db:99999/trainyard", "port must be a number"),
    ("postgres://u@db/", "name one database"),
    ("postgres://u@db/trainyard?port=x", "port must be a number"),
    ("sqlite://", "needs a file path"),
    ("mysql://u@db/t", "unsupported scheme 'mysql'"),
])
def test_bad_urls_say_what_is_wrong(url, message):
    with pytest.raises(DatabaseURLError, match=message):
        database_config({"DATABASE_URL": url}, Path("/v"))


def test_conn_max_age_from_the_environment():
    url = "postgres://u@db/t"
    assert database_config({"DATABASE_URL": url, "TRAINYARD_DB_CONN_MAX_AGE": "0"}, Path("/v"))["CONN_MAX_AGE"] == 0
    assert database_config({"DATABASE_URL": url, "TRAINYARD_DB_CONN_MAX_AGE": "none"}, Path("/v"))["CONN_MAX_AGE"] is None
    with pytest.raises(DatabaseURLError, match="TRAINYARD_DB_CONN_MAX_AGE"):
        database_config({"DATABASE_URL": url, "TRAINYARD_DB_CONN_MAX_AGE": "-1"}, Path("/v"))


def test_sqlite_url_and_test_name():
    assert database_config({"DATABASE_URL": "sqlite:////srv/ty/db.sqlite3"}, Path("/v"))["NAME"] == "/srv/ty/db.sqlite3"
    db = database_config({"DATABASE_URL": "postgres://u@db/t?test_name=ty_test"}, Path("/v"))
    assert db["TEST"] == {"NAME": "ty_test"} and "test_name" not in db["OPTIONS"]
