"""The job list (issue 25 section 3): tags and note on a job (submit, PATCH, the job page's form, one
event per edit), the one selector behind the page and the API (filters, search, ordering, paging,
visibility), the API's 400s, and the page's links that keep the query."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.db import connection
from django.http import QueryDict
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs.core.errors import InvalidInput
from jobs.models import Allocation, Attempt, Job, JobEvent, JobTag
from jobs.runs import selectors, services
from trainyard.spec import parse_job_spec

pytestmark = pytest.mark.django_db
SPEC = parse_job_spec({"name": "x", "train": {"steps": 100}, "resources": {"nodes": 1}}).to_json()


@pytest.fixture
def mate(django_user_model, teams):
    """carol, alice's teammate in "vision"."""
    carol = django_user_model.objects.create_user("carol", password="pw-carol-123")
    carol.groups.add(teams[0])
    return carol


def make(owner, name, *, status=Job.Status.SUCCEEDED, tags=(), days_ago=0.0, step=0, started=None, finished=None,
         team="auto"):
    job = Job.objects.create(name=name, owner=owner, team=owner.groups.first() if team == "auto" else team,
                             spec={**SPEC, "name": name}, slots=1, status=status, step=step,
                             started_at=started, finished_at=finished)
    Job.objects.filter(pk=job.pk).update(created_at=timezone.now() - timedelta(days=days_ago))
    JobTag.objects.bulk_create([JobTag(job=job, name=t) for t in tags])
    job.refresh_from_db()
    return job


def listed(user, **params) -> list[str]:
    q = QueryDict(mutable=True)
    for k, v in params.items():
        q.setlist(k, v if isinstance(v, list) else [v])
    return [j.name for j in selectors.jobs_listed(user, selectors.job_query(q))]


@pytest.fixture
def world(user, other, staff, mate, teams, nodes):
    now = timezone.now()
    jobs = {
        "a1": make(user, "gpt-lr-sweep-1", tags=["lr-sweep", "baseline"], days_ago=10, step=100,
                   started=now - timedelta(days=9), finished=now - timedelta(days=8)),
        "a2": make(user, "gpt-lr-sweep-2", status=Job.Status.RUNNING, tags=["lr-sweep"], days_ago=5, step=40,
                   started=now - timedelta(days=4)),
        "c1": make(mate, "Carol GPT big", status=Job.Status.FAILED, tags=["baseline"], days_ago=3, step=7,
                   started=now - timedelta(days=3), finished=now - timedelta(days=2)),
        "b1": make(other, "bob-secret-gpt", tags=["lr-sweep"], days_ago=2, step=100,
                   started=now - timedelta(days=2), finished=now - timedelta(days=1)),
        "a3": make(user, "mlp-tiny", status=Job.Status.QUEUED, days_ago=1),
    }  # created in submit order: id order is submit order
    # a1 ran on node-a, a2 on node-b, c1 on both (its second attempt)
    for job, runs in ((jobs["a1"], [["node-a"]]), (jobs["a2"], [["node-b"]]), (jobs["c1"], [["node-a"], ["node-b"]])):
        for number, names in enumerate(runs, 1):
            attempt = Attempt.objects.create(job=job, number=number, status=Attempt.Status.ENDED)
            for k, n in enumerate(names):
                Allocation.objects.create(attempt=attempt, node=next(x for x in nodes if x.name == n), node_rank=k,
                                          slot_ids=[0], active=False)
    return jobs


# ---------------------------------------------------------------- the selector

def test_users_see_their_own_and_their_teams_jobs_staff_all(world, user, other, staff, mate):
    mine = {"gpt-lr-sweep-1", "gpt-lr-sweep-2", "mlp-tiny", "Carol GPT big"}
    assert set(listed(user)) == mine and set(listed(mate)) == mine
    assert set(listed(other)) == {"bob-secret-gpt"}
    assert set(listed(staff)) == mine | {"bob-secret-gpt"}
    # a filter never widens what one sees: bob's tag, owner or node
    assert listed(user, owner="bob") == [] and "bob-secret-gpt" not in listed(user, tag="lr-sweep")


@pytest.mark.parametrize("params, expected", [
    ({}, ["mlp-tiny", "Carol GPT big", "gpt-lr-sweep-2", "gpt-lr-sweep-1"]),  # newest first, as always
    ({"status": "queued"}, ["mlp-tiny"]),
    ({"status": "QUEUED,RUNNING"}, ["mlp-tiny", "gpt-lr-sweep-2"]),
    ({"status": ["FAILED", "RUNNING"]}, ["Carol GPT big", "gpt-lr-sweep-2"]),
    ({"owner": "carol"}, ["Carol GPT big"]),
    ({"owner": "alice,carol", "status": "FAILED"}, ["Carol GPT big"]),
    ({"team": "vision"}, ["mlp-tiny", "Carol GPT big", "gpt-lr-sweep-2", "gpt-lr-sweep-1"]),
    ({"team": "nlp"}, []),
    ({"node": "node-a"}, ["Carol GPT big", "gpt-lr-sweep-1"]),  # c1 ran there once: one row
    ({"node": "node-b"}, ["Carol GPT big", "gpt-lr-sweep-2"]),
    ({"tag": "lr-sweep"}, ["gpt-lr-sweep-2", "gpt-lr-sweep-1"]),
    ({"tag": "lr-sweep,baseline"}, ["gpt-lr-sweep-1"]),  # every tag
    ({"tag": ["baseline", "lr-sweep"]}, ["gpt-lr-sweep-1"]),
    ({"tag": "BASELINE"}, ["Carol GPT big", "gpt-lr-sweep-1"]),  # tags are lowercase
    ({"tag": "nope"}, []),
    ({"q": "gpt"}, ["Carol GPT big", "gpt-lr-sweep-2", "gpt-lr-sweep-1"]),  # case-insensitive
    ({"q": "SWEEP-2"}, ["gpt-lr-sweep-2"]),
    ({"q": "gpt", "tag": "baseline", "node": "node-b"}, ["Carol GPT big"]),
    ({"status": "", "owner": "", "tag": ""}, ["mlp-tiny", "Carol GPT big", "gpt-lr-sweep-2", "gpt-lr-sweep-1"]),
])
def test_filters_and_search(world, user, params, expected):
    assert listed(user, **params) == expected


def test_date_range_days_are_inclusive_and_times_exact(world, user):
    today = timezone.now().date()
    day = lambda n: (today - timedelta(days=n)).isoformat()  # noqa: E731
    assert set(listed(user, since=day(5))) == {"gpt-lr-sweep-2", "Carol GPT big", "mlp-tiny"}
    assert set(listed(user, until=day(5))) == {"gpt-lr-sweep-1", "gpt-lr-sweep-2"}  # to the end of that day
    assert listed(user, since=day(5), until=day(3)) == ["Carol GPT big", "gpt-lr-sweep-2"]
    moment = (timezone.now() - timedelta(days=4)).isoformat()
    assert set(listed(user, since=moment)) == {"Carol GPT big", "mlp-tiny"}


@pytest.mark.parametrize("ordering, expected", [
    ("id", ["gpt-lr-sweep-1", "gpt-lr-sweep-2", "Carol GPT big", "mlp-tiny"]),
    ("name", ["Carol GPT big", "gpt-lr-sweep-1", "gpt-lr-sweep-2", "mlp-tiny"]),
    ("-name", ["mlp-tiny", "gpt-lr-sweep-2", "gpt-lr-sweep-1", "Carol GPT big"]),
    ("status", ["Carol GPT big", "mlp-tiny", "gpt-lr-sweep-2", "gpt-lr-sweep-1"]),  # FAILED QUEUED RUNNING SUCCEEDED
    ("owner", ["gpt-lr-sweep-1", "gpt-lr-sweep-2", "mlp-tiny", "Carol GPT big"]),  # alice (by id), carol
    ("-owner", ["Carol GPT big", "mlp-tiny", "gpt-lr-sweep-2", "gpt-lr-sweep-1"]),
    ("submitted", ["gpt-lr-sweep-1", "gpt-lr-sweep-2", "Carol GPT big", "mlp-tiny"]),
    ("-submitted", ["mlp-tiny", "Carol GPT big", "gpt-lr-sweep-2", "gpt-lr-sweep-1"]),
    ("steps", ["mlp-tiny", "Carol GPT big", "gpt-lr-sweep-2", "gpt-lr-sweep-1"]),
    ("-steps", ["gpt-lr-sweep-1", "gpt-lr-sweep-2", "Carol GPT big", "mlp-tiny"]),
    # never started / not finished: last either way
    ("started", ["gpt-lr-sweep-1", "gpt-lr-sweep-2", "Carol GPT big", "mlp-tiny"]),
    ("-started", ["Carol GPT big", "gpt-lr-sweep-2", "gpt-lr-sweep-1", "mlp-tiny"]),
    ("finished", ["gpt-lr-sweep-1", "Carol GPT big", "gpt-lr-sweep-2", "mlp-tiny"]),
    ("-finished", ["Carol GPT big", "gpt-lr-sweep-1", "mlp-tiny", "gpt-lr-sweep-2"]),
])
def test_every_column_sorts_both_ways(world, user, ordering, expected):
    assert listed(user, ordering=ordering) == expected


def test_pages_of_every_ordering_cover_each_job_once(user, teams):
    from django.core.paginator import Paginator

    for i in range(23):  # ties on purpose: 3 names, 2 statuses, steps in 4 values
        make(user, f"job-{i % 3}", status=[Job.Status.SUCCEEDED, Job.Status.FAILED][i % 2], step=i % 4,
             days_ago=i % 5)
    ids = set(Job.objects.values_list("pk", flat=True))
    for key in selectors.ORDERINGS:
        for ordering in (key, f"-{key}"):
            pages = Paginator(selectors.jobs_listed(user, selectors.job_query({"ordering": ordering})), 5)
            seen = [j.pk for n in pages.page_range for j in pages.page(n).object_list]
            assert len(seen) == len(ids) and set(seen) == ids, ordering


@pytest.mark.parametrize("params, field, message", [
    ({"status": "DONE"}, "status", "'DONE' is not a job status"),
    ({"tag": "Bad Tag"}, "tag", "is not a tag"),
    ({"tag": ",".join(f"t{i}" for i in range(17))}, "tag", "at most 16 tags"),
    ({"owner": ",".join(f"u{i}" for i in range(51))}, "owner", "at most 50 values"),
    ({"owner": "x" * 151}, "owner", "at most 150 characters"),
    ({"since": "yesterday"}, "since", "is not a date or time"),
    ({"until": "2026-02-30"}, "until", "is not a date or time"),
    ({"since": "2026-12-06", "until": "2026-12-01"}, "until", "later than since"),
    ({"since": "2026-12-06,2026-12-07"}, "since", "one date or time"),
    ({"ordering": "spec"}, "ordering", "not a column to sort by"),
    ({"ordering": "--id"}, "ordering", "not a column to sort by"),
    ({"q": "x" * 201}, "q", "at most 200 characters"),
])
def test_bad_parameters_are_named(params, field, message):
    with pytest.raises(InvalidInput) as exc:
        selectors.job_query(params)
    assert message in exc.value.errors[field][0], exc.value.errors


# ---------------------------------------------------------------- tags and note: submit and edits

def test_submit_stores_the_specs_tags_and_note(user, nodes):
    job = services.job_submit(user=user, spec=services.submitted_spec(
        {"name": "tagged", "tags": ["lr-sweep", "v2"], "note": "try 2"}))
    assert sorted(job.tags.values_list("name", flat=True)) == ["lr-sweep", "v2"] and job.note == "try 2"
    assert listed(user, tag="v2") == ["tagged"]


def test_annotate_changes_tags_and_note_with_one_event(world, user, mate):
    job = world["a1"]
    services.job_annotate(job, user=mate, add=["v2", "lr-sweep"], remove=["baseline"])
    assert sorted(job.tags.values_list("name", flat=True)) == ["lr-sweep", "v2"]
    services.job_annotate(job, user=user, note="diverged at 2k\nlr too high")
    events = list(JobEvent.objects.filter(job=job, kind="annotated").order_by("id"))
    assert [(e.actor.username, e.data["added"], e.data["removed"]) for e in events] == [
        ("carol", ["v2"], ["baseline"]), ("alice", [], [])]
    assert events[0].message == "carol edited: +v2, -baseline" and events[1].data["note"] == "diverged at 2k\nlr too high"
    services.job_annotate(job, user=user, tags=["v2", "lr-sweep"], note="diverged at 2k\nlr too high")  # no change
    assert JobEvent.objects.filter(job=job, kind="annotated").count() == 2
    services.job_annotate(job, user=user, tags=[])
    assert not job.tags.exists() and JobEvent.objects.filter(job=job, kind="annotated").count() == 3


@pytest.mark.parametrize("kwargs, field", [
    ({"tags": ["OK"]}, "tags"),
    ({"tags": ["a"], "add": ["b"]}, "tags"),
    ({"add": ["fine", "Not fine"]}, "tags_add"),
    ({"remove": "baseline"}, "tags_remove"),
    ({"remove": ["x"] * 100_000}, "tags_remove"),
    ({"note": "x" * 2001}, "note"),
    ({"add": [f"n{i}" for i in range(15)]}, "tags_add"),  # 2 + 15 > 16
])
def test_bad_edits_change_nothing(world, user, kwargs, field):
    job = world["a1"]
    with pytest.raises(InvalidInput) as exc:
        services.job_annotate(job, user=user, **kwargs)
    assert field in exc.value.errors
    assert sorted(job.tags.values_list("name", flat=True)) == ["baseline", "lr-sweep"]
    assert not JobEvent.objects.filter(job=job, kind="annotated").exists()


# ---------------------------------------------------------------- the API

def test_api_list_filters_searches_orders_and_pages(world, user, client_for):
    c = client_for(user)
    r = c.get("/api/v1/jobs/")
    assert r.status_code == 200 and r.json()["count"] == 4 and r.json()["next"] is None  # the old shape, newest first
    assert [j["name"] for j in r.json()["results"]] == ["mlp-tiny", "Carol GPT big", "gpt-lr-sweep-2", "gpt-lr-sweep-1"]
    first = r.json()["results"][-1]
    assert first["tags"] == ["baseline", "lr-sweep"] and first["team"] == "vision" and first["note"] == ""
    r = c.get("/api/v1/jobs/", {"tag": "lr-sweep", "ordering": "name", "q": "GPT"})
    assert [j["name"] for j in r.json()["results"]] == ["gpt-lr-sweep-1", "gpt-lr-sweep-2"]
    r = c.get("/api/v1/jobs/?tag=lr-sweep&tag=baseline&node=node-a&status=SUCCEEDED")
    assert [j["name"] for j in r.json()["results"]] == ["gpt-lr-sweep-1"]
    r = c.get("/api/v1/jobs/", {"ordering": "submitted", "page_size": 3, "page": 2})
    body = r.json()
    assert body["count"] == 4 and [j["name"] for j in body["results"]] == ["mlp-tiny"]
    assert "ordering=submitted" in body["previous"] and "page_size=3" in body["previous"]


def test_api_list_refuses_bad_filters_with_400(world, user, client_for):
    r = client_for(user).get("/api/v1/jobs/", {"status": "DONE", "tag": "A B", "ordering": "nope"})
    assert r.status_code == 400
    assert set(r.json()["errors"]) == {"status", "tag", "ordering"}


def test_api_patch_by_owner_team_and_staff_not_others(world, user, mate, other, staff, client_for):
    job = world["a1"]
    url = f"/api/v1/jobs/{job.pk}/"
    r = client_for(user).patch(url, {"tags": ["a", "b"], "note": "mine"}, format="json")
    assert r.status_code == 200 and r.json()["tags"] == ["a", "b"] and r.json()["note"] == "mine"
    r = client_for(mate).patch(url, {"tags_add": ["c"], "tags_remove": ["a"]}, format="json")
    assert r.status_code == 200 and r.json()["tags"] == ["b", "c"]
    assert client_for(staff).patch(url, {"note": "staff too"}, format="json").status_code == 200
    assert client_for(other).patch(url, {"note": "bob"}, format="json").status_code == 404
    from rest_framework.test import APIClient
    assert APIClient().patch(url, {"note": "anon"}, format="json").status_code == 401
    job.refresh_from_db()
    assert job.note == "staff too" and sorted(job.tags.values_list("name", flat=True)) == ["b", "c"]
    assert [e.actor.username for e in job.events.filter(kind="annotated").order_by("id")] == ["alice", "carol", "root"]
    assert client_for(user).put(url, {"note": "x"}, format="json").status_code == 405


@pytest.mark.parametrize("body, field", [
    ({"tags": ["Bad"]}, "tags"),
    ({"tags": "a,b"}, "tags"),
    ({"note": 7}, "note"),
    ({"tags_add": ["ok"], "tags": ["x"]}, "tags"),
    ({"name": "renamed"}, "name"),
    ({}, "body"),
    (["a"], "body"),
])
def test_api_patch_refuses_bad_bodies_with_field_errors(world, user, client_for, body, field):
    job = world["a1"]
    r = client_for(user).patch(f"/api/v1/jobs/{job.pk}/", body, format="json")
    assert r.status_code == 400 and field in r.json()["errors"], r.json()
    job.refresh_from_db()
    assert job.name == "gpt-lr-sweep-1" and sorted(job.tags.values_list("name", flat=True)) == ["baseline", "lr-sweep"]


def test_api_submit_takes_tags_and_shows_them(user, nodes, client_for):
    r = client_for(user).post("/api/v1/jobs/", {"name": "x", "tags": ["sweep"], "note": "n"}, format="json")
    assert r.status_code == 201 and r.json()["tags"] == ["sweep"] and r.json()["note"] == "n"
    r = client_for(user).post("/api/v1/jobs/", {"name": "x", "tags": ["Sweep"]}, format="json")
    assert r.status_code == 400 and "tags" in r.json()["errors"]


# ---------------------------------------------------------------- the page

def _page(user, query: str = ""):
    c = Client()
    c.force_login(user)
    return c.get(f"/jobs/{query}")


def test_page_filters_and_every_link_keeps_the_query(world, user):
    r = _page(user, "?tag=lr-sweep&ordering=name&page_size=25")
    html = r.content.decode()
    assert r.status_code == 200
    rows = re.findall(r'<tr data-job="(\d+)">', html)
    assert rows == [str(world["a1"].pk), str(world["a2"].pk)]
    assert "bob-secret-gpt" not in html
    # a sort link keeps the filters and flips the direction of the current column
    sort = re.search(r'data-sort="name" href="([^"]+)"', html).group(1).replace("&amp;", "&")
    assert "tag=lr-sweep" in sort and "ordering=-name" in sort and "page_size=25" in sort
    # tag chips filter by their tag, keeping the rest
    chip = re.search(r'class="chip" href="([^"]+)"[^>]*>baseline<', html).group(1).replace("&amp;", "&")
    assert "tag=baseline" in chip and "tag=lr-sweep" not in chip and "ordering=name" in chip
    assert 'id="compare-selected"' in html and html.count('class="pick"') == 2
    assert 'value="lr-sweep"' in html  # the form shows the filter back


def test_page_pages_with_links_that_keep_filters(user, teams):
    for i in range(30):
        make(user, f"p{i}", tags=["many"])
    html = _page(user, "?tag=many&page_size=25&page=2").content.decode()
    assert len(re.findall(r'<tr data-job="', html)) == 5 and "page 2 of 2" in html
    prev = re.search(r'href="([^"]+)" rel="prev"', html).group(1).replace("&amp;", "&")
    assert "tag=many" in prev and "page_size=25" in prev and "page=" not in prev  # page 1: no page parameter
    assert len(re.findall(r'<tr data-job="', _page(user, "?tag=many&page=99").content.decode())) == 30  # clamped


def test_page_shows_bad_filters_as_400_with_the_fields(world, user):
    r = _page(user, "?status=DONE&since=never&page_size=7")
    html = r.content.decode()
    assert r.status_code == 400 and 'id="filter-errors"' in html
    for field in ("status", "since", "page_size"):
        assert f"<b>{field}</b>" in html
    assert '<tr data-job="' not in html


def test_page_queries_do_not_grow_with_the_page(user, teams, nodes):
    for i in range(3):
        make(user, f"small{i}", tags=["t"], status=Job.Status.QUEUED)
    with CaptureQueriesContext(connection) as few:
        assert _page(user, "?page_size=25").status_code == 200
    for i in range(40):
        make(user, f"big{i}", tags=["t", f"u{i}"], status=Job.Status.QUEUED)
    with CaptureQueriesContext(connection) as many:
        html = _page(user, "?page_size=25").content.decode()
    assert len(re.findall(r'<tr data-job="', html)) == 25
    assert len(many.captured_queries) == len(few.captured_queries), [q["sql"][:120] for q in many.captured_queries]


def test_job_page_form_edits_tags_and_note(world, user, mate, other):
    job = world["a1"]
    c = Client()
    c.force_login(mate)
    page = c.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="tags-form"' in page and 'href="/jobs/?tag=baseline"' in page
    r = c.post(f"/jobs/{job.pk}/annotate/", {"tags": "lr-sweep, paper  v3", "note": "line 1\r\nline 2"})
    assert r.status_code == 302 and r["Location"] == f"/jobs/{job.pk}/"
    job.refresh_from_db()
    assert sorted(job.tags.values_list("name", flat=True)) == ["lr-sweep", "paper", "v3"]
    assert job.note == "line 1\nline 2"
    r = c.post(f"/jobs/{job.pk}/annotate/", {"tags": "Bad!", "note": ""}, follow=True)
    assert "is not a tag" in r.content.decode() and job.tags.count() == 3
    c.force_login(other)
    assert c.post(f"/jobs/{job.pk}/annotate/", {"tags": "x"}).status_code == 404
    assert job.tags.count() == 3


def test_groups_are_visible_filters_only(world, user, staff):
    Group.objects.create(name="secret-team")
    assert "secret-team" not in _page(user).content.decode()
    assert "secret-team" in _page(staff).content.decode()
