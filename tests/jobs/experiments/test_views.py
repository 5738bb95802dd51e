"""The experiment form (/experiments/new/): the document the CLI reads (a JobSpec with a search
block, or {name, spec, search}) submitted from the page; errors listed by field, nothing created."""
import json

import pytest
import yaml

from jobs.models import Experiment, Job, Trial
from tests.jobs.experiments.conftest import SEARCH, TEMPLATE

pytestmark = pytest.mark.django_db


@pytest.fixture
def c(client, user):
    client.force_login(user)
    return client


def test_the_form_starts_from_the_example_search(c):
    r = c.get("/experiments/new/")
    assert r.status_code == 200
    doc = yaml.safe_load(r.context["document"])
    assert doc["search"]["algorithm"] == "tpe" and "train.lr" in doc["search"]["space"]
    assert b'id="experiment-form"' in r.content


@pytest.mark.parametrize("document", [
    yaml.safe_dump({**TEMPLATE, "search": SEARCH}),                      # a JobSpec with a search block
    json.dumps({"name": "from the form", "spec": TEMPLATE, "search": SEARCH}),  # as the API takes it
])
def test_a_valid_document_submits_the_experiment_and_its_first_trials(c, nodes, document):
    r = c.post("/experiments/new/", {"document": document})
    e = Experiment.objects.get()
    assert r.status_code == 302 and r["Location"] == f"/experiments/{e.pk}/"
    assert Trial.objects.filter(experiment=e).count() == SEARCH["max_concurrent"]
    assert Job.objects.count() == SEARCH["max_concurrent"]


@pytest.mark.parametrize("document,path", [
    ("name: [unclosed", "spec"),
    (yaml.safe_dump(TEMPLATE), "search"),
    (yaml.safe_dump({**TEMPLATE, "search": {**SEARCH, "space": {"train.nope": {"choice": [1, 2]}}}}),
     "search.space.train.nope"),
    (yaml.safe_dump({**TEMPLATE, "search": {**SEARCH, "algorithm": "grid", "space": {"train.lr": {"uniform": [0, 1]}}}}),
     "search.space.train.lr"),
    (json.dumps({"spec": TEMPLATE, "search": SEARCH, "extra": 1}), "extra"),
])
def test_bad_input_is_400_naming_the_field_and_creates_nothing(c, nodes, document, path):
    r = c.post("/experiments/new/", {"document": document})
    assert r.status_code == 400
    paths = [p for p, _ in r.context["errors"]]
    assert any(p == path or p.startswith(path + ".") or p.startswith(path) for p in paths), paths
    assert f'data-path="{paths[0]}"'.encode() in r.content
    assert not Experiment.objects.exists() and not Job.objects.exists()
    assert r.context["document"] == document  # the text is kept to fix


def test_an_oversized_document_is_refused_before_parsing(c, nodes):
    r = c.post("/experiments/new/", {"document": "#" * (300 * 1024)})
    assert r.status_code == 400 and [p for p, _ in r.context["errors"]] == ["document"]


def test_the_form_needs_login(client):
    r = client.get("/experiments/new/")
    assert r.status_code == 302 and "/accounts/login/" in r["Location"]
