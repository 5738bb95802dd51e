"""`trainyard ls` filters and `trainyard tag` / `trainyard note` against the real API: the click app
(CliRunner) over HTTP to Django's live server (pytest-django's live_server, this test's database),
with a real API token, so the query parameters the CLI sends are the ones the API parses."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from jobs.access.services import token_issue
from jobs.models import JobEvent
from trainyard.cli.app import cli

pytestmark = pytest.mark.django_db(transaction=True)  # the live server reads the test's rows from its thread


@pytest.fixture
def run(live_server, user, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_URL", live_server.url)
    monkeypatch.setenv("TRAINYARD_TOKEN", token_issue(user))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # never the developer's own login

    def invoke(*args: str):
        result = CliRunner().invoke(cli, list(args))
        return result.exit_code, result.output
    return invoke


@pytest.fixture
def jobs(user, other, teams, nodes):
    from jobs.runs import services

    made = {}
    for name, owner, tags in (("sweep-lr-1", user, ["lr-sweep"]), ("sweep-lr-2", user, ["lr-sweep", "best"]),
                              ("plain", user, []), ("bobs", other, ["lr-sweep"])):
        made[name] = services.job_submit(user=owner, spec=services.submitted_spec({"name": name, "tags": tags}))
    return made


def names(output: str) -> list[str]:
    return [j["name"] for j in json.loads(output)]


def test_ls_filters_by_tag_status_owner_search_and_pages(run, jobs):
    code, out = run("ls", "--json")
    assert code == 0 and names(out) == ["plain", "sweep-lr-2", "sweep-lr-1"]  # alice's, newest first
    assert names(run("ls", "--tag", "lr-sweep", "--json")[1]) == ["sweep-lr-2", "sweep-lr-1"]
    assert names(run("ls", "--tag", "lr-sweep", "--tag", "best", "--json")[1]) == ["sweep-lr-2"]
    assert names(run("ls", "--status", "queued", "--owner", "alice", "--search", "LR-1", "--json")[1]) == ["sweep-lr-1"]
    assert names(run("ls", "--status", "running", "--json")[1]) == []
    assert names(run("ls", "--sort", "name", "--page-size", "2", "--page", "2", "--json")[1]) == ["sweep-lr-2"]
    code, out = run("ls", "--sort", "name", "--page-size", "2")
    assert code == 0 and "plain" in out and "page 1 of 2, 3 jobs" in out and "lr-sweep" in out
    assert run("ls", "--tag", "nothing-has-it") == (0, "no jobs match\n")


def test_ls_bad_filters_are_one_line_naming_the_parameter(run, jobs):
    code, out = run("ls", "--status", "done")
    assert code == 2 and out.count("\n") == 1 and "status: 'DONE' is not a job status" in out
    code, out = run("ls", "--tag", "Not A Tag")
    assert code == 2 and "tag: " in out and "is not a tag" in out
    code, out = run("ls", "--sort", "spec")
    assert code == 2 and "ordering: " in out


def test_tag_and_note_edit_the_job_with_an_event(run, jobs, user):
    job = jobs["plain"]
    code, out = run("tag", str(job.pk), "--add", "baseline", "--add", "v2")
    assert code == 0 and out == f"job {job.pk}: baseline, v2\n"
    code, out = run("tag", str(job.pk), "--remove", "v2", "--add", "paper")
    assert code == 0 and out == f"job {job.pk}: baseline, paper\n"
    assert run("tag", str(job.pk)) == (0, f"job {job.pk}: baseline, paper\n")
    assert run("tag", str(job.pk), "--set", "") == (0, f"job {job.pk}: no tags\n")
    code, out = run("note", str(job.pk), "lr too high\ndiverged at 2k")
    assert code == 0 and out == f"job {job.pk}: note saved\n"
    assert run("note", str(job.pk)) == (0, "lr too high\ndiverged at 2k\n")
    assert run("note", str(job.pk), "--clear") == (0, f"job {job.pk}: note cleared\n")
    assert run("note", str(job.pk)) == (0, f"job {job.pk} has no note\n")
    kinds = list(JobEvent.objects.filter(job=job, kind="annotated").values_list("actor__username", flat=True))
    assert kinds == ["alice"] * 5


def test_tag_refusals_are_one_line(run, jobs):
    job = jobs["plain"]
    code, out = run("tag", str(job.pk), "--add", "Bad Tag")
    assert code == 2 and "tags_add: " in out and "is not a tag" in out
    code, out = run("tag", str(jobs["bobs"].pk), "--add", "mine")  # bob's job: alice cannot see it
    assert code == 2 and "HTTP 404" in out
    code, out = run("tag", str(job.pk), "--set", "a", "--add", "b")
    assert code == 2 and "--set replaces every tag" in out
    code, out = run("note", str(job.pk), "x" * 2001)
    assert code == 2 and "note: at most 2000 characters" in out
    assert not JobEvent.objects.filter(job=job, kind="annotated").exists()
