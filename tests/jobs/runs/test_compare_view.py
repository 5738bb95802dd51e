"""/compare/?jobs=...: login required, only visible jobs (others left out and named), the spec diff by
dotted path rendered by the server, 400 for a malformed list, 404 when nothing is visible."""
from __future__ import annotations

import json
import re

import pytest
from django.test import Client

from jobs import services
from jobs.runs.views_compare import MAX_COMPARE_JOBS

pytestmark = pytest.mark.django_db


def submit(user, spec):
    return services.job_submit(user=user, spec=services.submitted_spec(spec))


def page(user, query):
    c = Client()
    c.force_login(user)
    return c.get(f"/compare/{query}")


def rows(html: str, table_id: str) -> dict[str, list[str]]:
    """{path: [cell texts]} of a table's body rows (data-path), parsed from the page."""
    body = html.split(f'id="{table_id}"', 1)[1].split("</table>", 1)[0]
    out = {}
    for path, cells in re.findall(r'<tr data-path="([^"]+)">(.*?)</tr>', body, re.S):
        out[path] = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td>(.*?)</td>", cells, re.S)][1:]
    return out


def test_login_required():
    r = Client().get("/compare/?jobs=1,2")
    assert r.status_code == 302 and "/accounts/login/" in r["Location"]


def test_diff_of_visible_jobs_and_the_others_left_out(user, other, nodes):
    a = submit(user, {"name": "lr-small", "train": {"lr": 1e-4, "steps": 20}})
    b = submit(user, {"name": "lr-big", "train": {"lr": 1e-2, "steps": 20}, "model": {"layers": 2}})
    theirs = submit(other, {"name": "bobs", "train": {"lr": 5e-3}})
    r = page(user, f"?jobs={a.pk},{theirs.pk},{b.pk},424242")
    assert r.status_code == 200
    html = r.content.decode()
    differ = rows(html, "spec-diff")
    assert differ == {"model.layers": ["4", "2"], "name": ["lr-small", "lr-big"], "train.lr": ["0.0001", "0.01"]}
    same = rows(html, "spec-same")
    assert same["train.steps"] == ["20"] and "resources.nodes" in same and "train.lr" not in same
    assert f'data-missing="{theirs.pk},424242"' in html and "bobs" not in html
    config = json.loads(re.search(r'<script id="compare-config" type="application/json">(.*?)</script>', html, re.S)[1])
    assert [j["id"] for j in config["jobs"]] == [a.pk, b.pk] and config["jobs"][1]["name"] == "lr-big"
    assert "js/compare.js" in html


def test_staff_and_team_mates_see_the_jobs(user, other, staff, teams, django_user_model, nodes):
    a = submit(user, {"name": "mine"})
    mate = django_user_model.objects.create_user("carol", password="pw-carol-123")
    mate.groups.add(teams[0])
    for who in (staff, mate):
        assert page(who, f"?jobs={a.pk}").status_code == 200
    r = page(other, f"?jobs={a.pk}")
    assert r.status_code == 404 and b"mine" not in r.content and b"compare.js" not in r.content


def test_identical_specs_say_so(user, nodes):
    a, b = submit(user, {"name": "same"}), submit(user, {"name": "same"})
    html = page(user, f"?jobs={a.pk},{b.pk}").content.decode()
    assert 'id="spec-no-diff"' in html and 'id="spec-diff"' not in html


@pytest.mark.parametrize("query, message", [
    ("", "required"), ("?jobs=", "required"), ("?jobs=1,abc", "not a job id"),
    ("?jobs=" + ",".join(str(i) for i in range(1, MAX_COMPARE_JOBS + 2)), f"at most {MAX_COMPARE_JOBS}"),
])
def test_bad_lists_are_400s(user, query, message):
    r = page(user, query)
    assert r.status_code == 400 and message in r.content.decode()
