"""One list of job statuses (trainyard/status.py): the model, the CLI and the pages' JavaScript take
theirs from it, and none of them writes its own copy."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jobs.models import Job
from trainyard import status
from trainyard.cli import logs as cli_logs
from trainyard.cli import watch as cli_watch

ROOT = Path(__file__).resolve().parent.parent


def test_the_model_takes_its_statuses_from_trainyard():
    assert Job.Status.values == list(status.STATUSES)
    # The labels the migrations record (a change here would need a migration).
    assert Job.Status.choices == [(s, s.title()) for s in status.STATUSES]
    assert Job.TERMINAL == status.TERMINAL and Job.ACTIVE == status.ACTIVE
    assert all(isinstance(s, Job.Status) for s in (*Job.TERMINAL, *Job.ACTIVE))


def test_the_cli_takes_its_terminal_set_from_trainyard():
    assert cli_watch.TERMINAL is status.TERMINAL and cli_logs.TERMINAL is status.TERMINAL


def test_no_status_list_is_written_in_the_javascript():
    for path in sorted((ROOT / "static" / "js").glob("*.js")):
        text = path.read_text()
        for name in status.TERMINAL:
            assert f"'{name}'" not in text and f'"{name}"' not in text, f"{path.name} spells out {name}"


@pytest.mark.django_db
def test_every_page_carries_the_terminal_set(client):
    html = client.get("/accounts/login/").content.decode()
    found = re.search(r'<script id="job-statuses" type="application/json">(.*?)</script>', html)
    assert found and json.loads(found.group(1)) == {"terminal": list(status.TERMINAL)}
