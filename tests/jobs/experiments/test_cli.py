"""`trainyard experiment ...` against the real API (Django's live server, the real database)."""
import json

import pytest
import yaml
from click.testing import CliRunner
from django.core.management import call_command

from jobs.experiments.services import experiment_advance
from jobs.models import Experiment, Job, Trial
from tests.jobs.experiments.conftest import SEARCH, TEMPLATE
from tests.jobs.experiments.test_services import losses
from tests.jobs.runs.test_services import start
from trainyard.cli.app import cli

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("ckpt_root", "relay_alive")]


@pytest.fixture
def login(live_server, user, nodes, monkeypatch, capsys, tmp_path):
    call_command("api_token", "alice")
    monkeypatch.setenv("TRAINYARD_URL", live_server.url)
    monkeypatch.setenv("TRAINYARD_TOKEN", capsys.readouterr().out.strip())
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False, standalone_mode=False)


def test_submit_ls_show_best_stop(login, tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text(yaml.safe_dump({**TEMPLATE, "search": SEARCH}))  # a JobSpec with a search block
    r = run("experiment", "submit", str(f))
    assert r.return_value == 0, r.output
    eid = int(r.stdout.splitlines()[0])
    e = Experiment.objects.get(pk=eid)
    assert e.name == "exp" and e.trials.count() == 2
    r = run("experiment", "ls")
    assert r.return_value == 0 and "2 running" in r.output and "exp" in r.output
    r = run("experiment", "best", str(eid))
    assert r.return_value == 2 and "no best trial yet" in r.output
    t0 = e.trials.get(number=0)
    losses(start(t0.job), {5: 2.0, 6: 1.75})
    experiment_advance(eid)
    r = run("experiment", "show", str(eid))
    assert r.return_value == 0, r.output
    assert "best: trial 0" in r.output and "1.75" in r.output and "train.lr" in r.output
    r = run("experiment", "best", str(eid))
    assert r.return_value == 0
    spec = json.loads(r.stdout)
    assert spec["train"]["lr"] == t0.values["train.lr"] and spec["name"] == "exp-best"
    # ready to `trainyard submit`: a plain job, not a trial
    spec_file = tmp_path / "best.json"
    spec_file.write_text(r.stdout)
    r = run("submit", str(spec_file))
    assert r.return_value == 0, r.output
    job = Job.objects.get(pk=int(r.stdout.strip()))
    assert job.spec["train"]["lr"] == t0.values["train.lr"] and not Trial.objects.filter(job=job).exists()
    r = run("experiment", "show", str(eid), "--json")
    assert json.loads(r.stdout)["best"]["job"] == t0.job_id
    r = run("experiment", "stop", str(eid))
    assert r.return_value == 0 and "stopped" in r.output
    r = run("experiment", "stop", str(eid))
    assert r.return_value == 2 and "already stopped" in r.output


def test_bad_files_are_one_line_errors_and_create_nothing(login, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"spec": TEMPLATE, "search": {**SEARCH, "space": {"train.nope": {"choice": [1]}}}}))
    r = run("experiment", "submit", str(bad))
    assert r.return_value == 2 and "search.space.train.nope" in r.output and len(r.output.strip().splitlines()) == 1
    nosearch = tmp_path / "nosearch.yaml"
    nosearch.write_text(yaml.safe_dump(TEMPLATE))
    r = run("experiment", "submit", str(nosearch))
    assert r.return_value == 2 and "no search block" in r.output
    r = run("experiment", "submit", str(tmp_path / "missing.yaml"))
    assert r.return_value == 2 and "cannot read" in r.output
    r = run("experiment", "show", "999")
    assert r.return_value == 2
    assert Experiment.objects.count() == 0 and Job.objects.count() == 0
