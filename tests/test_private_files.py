"""Issue 15, section 3: what holds secrets under var/ is its owner's only, whatever the umask, and what
an older version left readable is tightened at start. Each startup path runs for real: `manage.py
migrate` and `ensure_admin` (secret key, database, admin password), a node agent's run root, and a
launch's run directory with config.json (the Redis URL and its password) up to a failed exec.
Before: 0755 directories and 0644 files under the default umask 022."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_launcher import Recorder, exited, request
from trainyard.private import private_dir, redacted_url, tighten, write_private
from workers import agent
from workers.launcher import Supervisor

REPO = Path(__file__).resolve().parent.parent


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


STARTUP = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", "auth", "--noinput", verbosity=0)
call_command("ensure_admin")
"""


def assert_private(var: Path) -> None:
    assert mode(var) == 0o700
    for name in ("secret_key", "db.sqlite3", "admin_password"):
        assert mode(var / name) == 0o600, name
    for name in ("db.sqlite3-wal", "db.sqlite3-shm"):
        if (var / name).exists():
            assert mode(var / name) == 0o600, name


def test_startup_creates_the_secret_key_database_and_admin_password_private(tmp_path, umask_022):
    """One process that starts as `make run`'s first steps do: settings, migrate, ensure_admin."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "DJANGO_SECRET_KEY", "TRAINYARD_DB", "DATABASE_URL", "TRAINYARD_ADMIN_PASSWORD")}
    var = tmp_path / "var"
    env |= {"TRAINYARD_VAR_DIR": str(var), "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    out = subprocess.run([sys.executable, "-c", STARTUP], cwd=REPO, env=env, check=True, timeout=120,
                         capture_output=True, text=True).stdout
    assert "password:" in out
    assert_private(var)


@pytest.mark.django_db
def test_an_older_versions_loose_modes_are_tightened_at_start(tmp_path, umask_022, settings):
    from django.core.management import call_command
    from django.db import connections

    from controlplane import security

    var = tmp_path / "var"
    var.mkdir()
    (var / "secret_key").write_text("an-old-key")
    os.chmod(var, 0o755)
    os.chmod(var / "secret_key", 0o644)
    assert security.secret_key({"DJANGO_SECRET_KEY": "from-env"}, var) == "from-env"  # what settings.py runs
    assert mode(var) == 0o700  # the directory holds the database and the admin password too
    os.chmod(var, 0o755)
    assert security.secret_key({}, var) == "an-old-key"
    assert mode(var) == 0o700 and mode(var / "secret_key") == 0o600
    # the database: any process's first connection tightens it (jobs.signals.private_sqlite)
    db = var / "db.sqlite3"
    db.touch(mode=0o644)
    wrapper = connections.create_connection("default")
    wrapper.settings_dict = {**wrapper.settings_dict, "NAME": str(db)}
    wrapper.ensure_connection()
    wrapper.close()
    assert mode(db) == 0o600
    # the admin password file
    settings.VAR_DIR = var
    call_command("ensure_admin")
    assert mode(var / "admin_password") == 0o600
    os.chmod(var / "admin_password", 0o644)
    call_command("ensure_admin")
    assert mode(var / "admin_password") == 0o600


def test_agent_run_root_and_launch_run_dir_are_private(tmp_path, umask_022, monkeypatch):
    root = tmp_path / "agents"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    agent.Agent("n", "127.0.0.1", 1, {}, "cpu", root / "n")
    assert mode(root) == 0o700 and mode(root / "n") == 0o700
    # a launch that cannot exec (its code directory is missing) still wrote its run directory
    rec = Recorder()
    req = request(tmp_path, "n", config={"redis_url": "redis://:s3cret@127.0.0.1:6390/0"}, user_code=True,
                  code_dir=str(tmp_path / "missing"))
    sup = Supervisor(req, **rec.callbacks())
    assert sup.start()
    rec.wait(exited, timeout=30)
    run_dir = Path(req.run_dir)
    assert mode(run_dir) == 0o700
    assert json.loads((run_dir / "config.json").read_text())["redis_url"].endswith("@127.0.0.1:6390/0")
    for name in ("config.json", "launched", "supervisor.json", "exit.json"):
        assert mode(run_dir / name) == 0o600, name


def test_private_helpers(tmp_path, umask_022):
    d = private_dir(tmp_path / "a" / "b")
    assert mode(d) == 0o700
    f = d / "f"
    f.write_text("x")
    os.chmod(f, 0o754)
    assert tighten(f) and mode(f) == 0o700 and not tighten(f)
    assert not tighten(tmp_path / "missing")
    write_private(d / "secret", "s")
    assert mode(d / "secret") == 0o600 and (d / "secret").read_text() == "s"
    assert sorted(os.listdir(d)) == ["f", "secret"]  # no temporary left behind


@pytest.mark.parametrize("url,shown", [
    ("redis://:s3cret@127.0.0.1:6390/0", "redis://:***@127.0.0.1:6390/0"),
    ("redis://default:s3cret@redis.example:6379/1", "redis://default:***@redis.example:6379/1"),
    ("redis://127.0.0.1:6390/0", "redis://127.0.0.1:6390/0"),
    ("redis://:p@ss@host:1/0", "redis://:***@host:1/0"),
])
def test_redis_url_is_shown_without_its_password(url, shown):
    assert redacted_url(url) == shown
