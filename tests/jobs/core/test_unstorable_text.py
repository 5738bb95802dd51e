"""Text no database can hold (a NUL; a lone surrogate), and digits int() refuses ("²"), refused at
the edge of every request (jobs/core/middleware.py, jobs/core/parsers.py) with a 4xx naming the
field, never a 500. PostgreSQL's text and jsonb refuse U+0000 where SQLite stores it, so a NUL
that reached a query was a 500 on PostgreSQL only: the API fuzz of `make test-postgres` found
`GET /api/v1/jobs/?node=%00` (stop 38's CI), after a login, a node and a calibration (each fixed
where it was found). Runs on SQLite in `make test` and on PostgreSQL in `make test-postgres`."""
from __future__ import annotations

import pytest
import yaml
from django.test import Client
from rest_framework.test import APIClient

from jobs.core.dbtext import text_problems
from jobs.models import Experiment, Job, Subscription
from tests.jobs.experiments.conftest import SEARCH, TEMPLATE

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("ckpt_root", "relay_alive")]

NUL = "a\x00b"


def api(user) -> APIClient:
    c = APIClient()
    c.force_authenticate(user)
    return c


def test_text_problems_names_each_path_keys_included_and_stops_at_the_limit():
    found = text_problems({"a": "x\x00", "b": ["ok", "\ud800"], "c\x00": 1, "d": {"e": {"f": "\x00"}}})
    assert found == {"a": ["must not contain NUL (\\u0000) characters"],
                     "b.1": ["must be valid Unicode (no lone surrogates)"],
                     "c\\u0000": ["this key must not contain NUL (\\u0000) characters"],
                     "d.e.f": ["must not contain NUL (\\u0000) characters"]}
    assert text_problems("\x00") == {"detail": ["must not contain NUL (\\u0000) characters"]}
    assert len(text_problems(["\x00"] * 1000)) == 10
    assert text_problems({"fine": ["text", 1, None, {"ü": "✓"}]}) == {}


@pytest.mark.parametrize("query, field", [
    ({"node": NUL}, "node"), ({"owner": NUL}, "owner"), ({"team": NUL}, "team"), ({"q": NUL}, "q"),
    ({"tag": NUL}, "tag"), ({"status": NUL}, "status"), ({"node\x00": "x"}, "node\\u0000"),
    ({"experiment": "²"}, "experiment"),
])
def test_the_job_list_refuses_such_a_filter_with_a_400_naming_it(user, nodes, query, field):
    """The CI failure: `?node=<NUL>` was a 500 on PostgreSQL (`?experiment=²` everywhere)."""
    r = api(user).get("/api/v1/jobs/", query)
    assert r.status_code == 400, r.content
    assert list(r.json()["errors"]) == [field]
    page = Client()
    page.force_login(user)
    r = page.get("/jobs/", query)
    assert r.status_code == 400 and field.encode() in r.content


@pytest.mark.parametrize("url, body, field", [
    ("/api/v1/webhooks/", {"url": "http://127.0.0.1:9/h", "events": ["job.ended"], "team": NUL}, "team"),
    ("/api/v1/subscriptions/", {"events": ["job.ended"], "team": NUL}, "team"),
    ("/api/v1/experiments/", {"name": NUL, "spec": TEMPLATE, "search": SEARCH}, "name"),
    ("/api/v1/experiments/", {"name": "lr", "spec": {**TEMPLATE, "name": NUL}, "search": SEARCH}, "spec.name"),
    ("/api/v1/jobs/", {"name": "plain", "config": {"k\x00": 1}}, "config.k\\u0000"),
])
def test_a_body_with_such_text_is_a_400_naming_the_field_and_creates_nothing(staff, nodes, url, body, field):
    r = api(staff).post(url, body, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json()["errors"], r.json()
    assert (Experiment.objects.count(), Job.objects.count(), Subscription.objects.count()) == (0, 0, 0)


def test_a_form_field_with_a_nul_is_a_400_on_pages_and_the_api(user, nodes):
    page = Client()
    page.force_login(user)
    r = page.post("/notifications/", {"action": "create", "channel": "webhook", "url": "http://127.0.0.1:9/h",
                                      "events": "job.ended", "team": NUL})
    assert r.status_code == 400 and b"team" in r.content
    r = api(user).post("/api/v1/subscriptions/", {"events": "job.ended", "team": NUL})  # form-encoded
    assert r.status_code == 400 and "team" in r.json()["errors"]
    assert Subscription.objects.count() == 0


def test_an_experiment_documents_yaml_escape_is_refused_by_the_service(user, nodes):
    """YAML spells a NUL "\\0": the form's text has none, the parsed document does."""
    page = Client()
    page.force_login(user)
    doc = yaml.safe_dump({"name": "lr", "spec": TEMPLATE, "search": SEARCH}).replace("name: lr", 'name: "l\\0r"')
    r = page.post("/experiments/new/", {"document": doc})
    assert r.status_code == 400 and b"NUL" in r.content
    assert Experiment.objects.count() == 0


@pytest.mark.parametrize("method, url, body", [
    ("get", "/api/v1/knowledge/?layers=²", None),
    ("get", "/jobs/?page_size=²", None),
    ("post", "/notifications/", {"action": "delete", "id": "²"}),
])
def test_digits_int_refuses_are_4xx(user, nodes, method, url, body):
    page = Client()
    page.force_login(user)
    r = page.get(url) if body is None else page.post(url, body)
    assert 400 <= r.status_code < 500, r.content


def test_a_rollback_to_a_checkpoint_id_int_refuses_is_a_400(staff, nodes):
    job = api(staff).post("/api/v1/jobs/", {"name": "plain"}, format="json").json()
    for bad in ("²", "9" * 30):
        r = api(staff).post(f"/api/v1/jobs/{job['id']}/rollback/", {"checkpoint": bad}, format="json")
        assert r.status_code == 400 and "checkpoint" in r.json()["errors"], r.content


def _operations(doc):
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method in ("get", "post", "put", "patch", "delete"):
                yield path, method, op


def test_no_operation_of_the_schema_answers_a_nul_with_a_5xx(staff, nodes):
    """Every operation the OpenAPI document lists, a NUL in each of its query parameters (400 naming
    it), in its string path parameters (404) and in each top-level field of its JSON body (never a
    5xx): what the fuzz finds one at a time, all at once, on each database the suite runs on."""
    c = api(staff)
    c.post("/api/v1/jobs/", {"name": "plain"}, format="json")
    doc = yaml.safe_load(c.get("/api/schema/").content)
    seen, failures = 0, []
    for path, method, op in _operations(doc):
        params = op.get("parameters", [])
        url, nul_in_path = path, False
        for p in params:
            if p["in"] == "path":
                text = p["schema"].get("type") != "integer"
                nul_in_path |= text
                url = url.replace("{" + p["name"] + "}", NUL if text else "1")
        schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
        if "$ref" in schema:
            schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        cases = [({p["name"]: NUL}, None, 400) for p in params if p["in"] == "query"]
        cases += [({}, {name: NUL}, None) for name in schema.get("properties") or {}]
        if nul_in_path:
            cases = [({}, None, 404)]
        for query, body, expected in cases:
            send = getattr(c, method)
            r = send(url, query) if method == "get" else send(
                url + ("?" + "&".join(f"{k}=a%00b" for k in query) if query else ""), body or {}, format="json")
            seen += 1
            if r.status_code >= 500 or (expected and r.status_code != expected):
                failures.append((method.upper(), url.replace("\x00", "%00"), query, body, r.status_code))
    assert seen > 80 and not failures, failures  # 91 cases when written
