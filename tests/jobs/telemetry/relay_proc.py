"""A real relay process (`manage.py relay`) on the test's database (SQLite or PostgreSQL) and Redis, for the abuse tests.

`python -m tests.jobs.telemetry.relay_proc` runs the same management command after installing a fault
at the database boundary, from TRAINYARD_TEST_DB_FAULT="<SQL prefix>|<times>|<error>": the
first <times> statements starting with <SQL prefix> raise django.db.OperationalError(<error>)
(as SQLite's busy timeout does) before reaching the database.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests import postgres
from tests.conftest import REPO

FAULT_ENV = "TRAINYARD_TEST_DB_FAULT"


class RelayProcess:
    def __init__(self, workdir: Path, redis_url: str, *, checkpoint_root: Path,
                 artifact_root: Path, fault: str | None = None):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "relay.log"
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
                    "DJANGO_SETTINGS_MODULE": "controlplane.settings", "REDIS_URL": redis_url,
                    **postgres.current_database_env(), "TRAINYARD_VAR_DIR": str(self.dir / "var"),
                    "TRAINYARD_CHECKPOINT_ROOT": str(checkpoint_root),
                    "TRAINYARD_ARTIFACT_ROOT": str(artifact_root), "DJANGO_SECRET_KEY": "relay-tests-only"}
        self.cmd = [sys.executable, "manage.py", "relay"]
        if fault:
            self.env[FAULT_ENV] = fault
            self.cmd = [sys.executable, "-m", "tests.jobs.telemetry.relay_proc"]
        self.proc: subprocess.Popen | None = None

    def start(self) -> RelayProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def wait_for(self, cond, what: str, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            if not self.alive():
                raise AssertionError(f"the relay exited (rc {self.proc.returncode}) waiting for {what}\n{self.log()}")
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.log()}")


def _install_fault(spec: str) -> None:
    from django.db import OperationalError
    from django.db.backends.signals import connection_created

    prefix, times, error = spec.split("|", 2)
    left = [int(times)]

    def fault(execute, sql, params, many, context):
        if left[0] > 0 and sql.startswith(prefix):
            left[0] -= 1
            print(f"injected fault: {error} ({sql[:60]})", flush=True)
            raise OperationalError(error)
        return execute(sql, params, many, context)

    def add(sender, connection, **kwargs):
        if fault not in connection.execute_wrappers:
            connection.execute_wrappers.append(fault)

    connection_created.connect(add, weak=False)


if __name__ == "__main__":
    import django

    django.setup()
    _install_fault(os.environ[FAULT_ENV])
    from django.core.management import call_command

    call_command("relay")
