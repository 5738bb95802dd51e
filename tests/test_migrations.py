"""The migration history stays linear and runnable from scratch (issue 22 s5).

A migration that imports application code breaks `migrate` the day that code moves: CI's fresh
databases caught one (0011's backfill imported the device summary from its old module), so
each migration now carries what it needs, and these tests keep it that way."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db.migrations.loader import MigrationLoader

ROOT = Path(__file__).resolve().parents[1]
MIGRATIONS = ROOT / "jobs" / "migrations"
LOCKFILE = ROOT / "migrations_lockfile.txt"


def test_the_jobs_app_has_exactly_one_migration_head_the_one_the_lockfile_names():
    loader = MigrationLoader(None, ignore_no_migrations=True)
    heads = sorted(name for app, name in loader.graph.leaf_nodes() if app == "jobs")
    assert len(heads) == 1, f"jobs has {len(heads)} migration heads {heads}: rebase your migration onto the other"
    locked = dict(line.split(": ", 1) for line in LOCKFILE.read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
    assert locked == {"jobs": heads[0]}, f"migrations_lockfile.txt says {locked}, the head is jobs: {heads[0]}"


@pytest.mark.django_db
def test_the_models_and_the_migrations_agree():
    # --check exits non-zero (SystemExit) when a model change has no migration.
    call_command("makemigrations", "jobs", "--check", "--dry-run", verbosity=0)


def _imported_modules(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


@pytest.mark.parametrize("path", sorted(MIGRATIONS.glob("0*.py")), ids=lambda p: p.stem)
def test_a_migration_imports_no_application_code(path):
    """Django, the standard library, and field defaults from trainyard/ (a stable, Django-free
    module, which a model's default has to name) only: never jobs/ or workers/."""
    bad = [m for m in _imported_modules(ast.parse(path.read_text()))
           if m.split(".")[0] in {"jobs", "workers", "controlplane"}]
    assert not bad, f"{path.name} imports {bad}: copy what it needs into the migration"


@pytest.mark.procs
def test_migrate_runs_from_an_empty_database(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "DJANGO_"))}
    env.update(DATABASE_URL=f"sqlite:///{tmp_path / 'fresh.sqlite3'}", TRAINYARD_VAR_DIR=str(tmp_path / "var"))
    out = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
