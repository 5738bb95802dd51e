"""The experiments API and pages: 201, 400 with field errors and nothing created, visibility, best,
stop and continue, the job's `experiment`."""
import pytest
from rest_framework.test import APIClient

from jobs.experiments.services import experiment_advance
from jobs.models import Experiment, Job, Trial
from tests.jobs.attempts.test_fault import ok_exit, report_ckpt
from tests.jobs.experiments.conftest import SEARCH, TEMPLATE
from tests.jobs.experiments.test_services import losses, preempted_exit
from tests.jobs.runs.test_services import start

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("ckpt_root", "relay_alive")]


def post(client, body):
    return client.post("/api/v1/experiments/", body, format="json")


def test_anonymous_is_refused(nodes):
    c = APIClient()
    assert c.get("/api/v1/experiments/").status_code in (401, 403)
    assert post(c, {"spec": TEMPLATE, "search": SEARCH}).status_code in (401, 403)
    assert c.get("/experiments/").status_code == 302
    assert Experiment.objects.count() == 0


def test_submit_201_then_detail_list_and_the_jobs_experiment(user, nodes, client_for):
    c = client_for(user)
    r = post(c, {"name": "lr", "spec": TEMPLATE, "search": SEARCH})
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["status"] == "running" and len(body["trials"]) == 2
    e = Experiment.objects.get(pk=body["id"])
    d = c.get(f"/api/v1/experiments/{e.pk}/").json()
    assert d["name"] == "lr" and d["best"] is None and d["search"]["max_trials"] == 4 and d["spec"] == TEMPLATE
    assert [(t["job"], t["status"], t["metric"], t["rung"], t["steps"]) for t in d["trials"]] == [
        (t.job_id, "running", None, None, 0) for t in e.trials.order_by("number")]
    assert {t["values"]["train.lr"] for t in d["trials"]} <= {0.003, 1e-7}
    listing = c.get("/api/v1/experiments/").json()
    assert listing["count"] == 1 and listing["results"][0]["trials"] == {"running": 2}
    job = e.trials.get(number=0).job
    assert c.get(f"/api/v1/jobs/{job.pk}/").json()["experiment"] == e.pk
    other_job = c.post("/api/v1/jobs/", {"name": "plain"}, format="json").json()
    assert c.get(f"/api/v1/jobs/{other_job['id']}/").json()["experiment"] is None


@pytest.mark.parametrize("body,field", [
    ({"spec": TEMPLATE, "search": {**SEARCH, "space": {"train.nope": {"choice": [1]}}}}, "search.space.train.nope"),
    ({"spec": TEMPLATE, "search": {**SEARCH, "algorithm": "grid", "space": {"train.lr": {"uniform": [0.1, 0.2]}}}},
     "search.space.train.lr"),
    ({"spec": TEMPLATE, "search": {**SEARCH, "space": {"train.lr": {"loguniform": [0, 1]}}}}, "search.space.train.lr"),
    ({"spec": TEMPLATE, "search": {**SEARCH, "space": {"train.lr": {"choice": [0.1, -1]}}}}, "search.space.train.lr"),
    ({"spec": TEMPLATE}, "search"),
    ({"search": SEARCH}, "spec"),
    ({"spec": {**TEMPLATE, "train": {"steps": 0}}, "search": SEARCH}, "spec.train.steps"),
    ({"spec": TEMPLATE, "search": SEARCH, "extra": 1}, "extra"),
    ({"spec": TEMPLATE, "search": {**SEARCH, "max_trials": "many"}}, "search.max_trials"),
])
def test_bad_input_is_400_with_field_errors_and_nothing_created(user, nodes, client_for, body, field):
    r = post(client_for(user), body)
    assert r.status_code == 400, r.content
    assert field in r.json()["errors"], r.json()
    assert (Experiment.objects.count(), Job.objects.count(), Trial.objects.count()) == (0, 0, 0)


def test_a_list_body_is_400(user, nodes, client_for):
    assert post(client_for(user), [1, 2]).status_code == 400


def test_visibility_own_and_team_only_404_otherwise(user, other, staff, teams, nodes, client_for, django_user_model):
    e = Experiment.objects.get(pk=post(client_for(user), {"spec": TEMPLATE, "search": SEARCH}).json()["id"])
    mate = django_user_model.objects.create_user("carol", password="pw-carol-123")
    mate.groups.add(teams[0])
    assert client_for(mate).get(f"/api/v1/experiments/{e.pk}/").status_code == 200  # same team: sees it
    assert client_for(staff).get(f"/api/v1/experiments/{e.pk}/").status_code == 200
    c = client_for(other)
    assert c.get(f"/api/v1/experiments/{e.pk}/").status_code == 404
    assert c.get("/api/v1/experiments/").json()["count"] == 0
    assert c.post(f"/api/v1/experiments/{e.pk}/stop/").status_code == 404
    assert c.post(f"/api/v1/experiments/{e.pk}/trials/{e.trials.first().job_id}/continue/").status_code == 404
    assert client_for(mate).post(f"/api/v1/experiments/{e.pk}/stop/").status_code == 403  # sees, may not stop
    c.force_login(other)
    assert c.get(f"/experiments/{e.pk}/").status_code == 404
    e.refresh_from_db()
    assert e.status == "running"


def test_best_stop_continue_and_the_pages(user, nodes, client_for, ckpt_root, monkeypatch):
    from jobs.core import dispatch
    monkeypatch.setattr(dispatch, "request_preempt", lambda *a: None)
    c = client_for(user)
    e = Experiment.objects.get(pk=post(c, {"name": "lrs", "spec": TEMPLATE, "search": SEARCH}).json()["id"])
    t0, t1 = e.trials.order_by("number")
    a0, a1 = start(t0.job), start(t1.job)
    losses(a0, {10: 1.5, 11: 1.25})
    experiment_advance(e.pk)
    losses(a1, {10: 4.0})
    experiment_advance(e.pk)
    report_ckpt(ckpt_root, t1.job, a1, 10)
    preempted_exit(a1)
    d = c.get(f"/api/v1/experiments/{e.pk}/").json()
    assert d["best"] == {"job": t0.job_id, "number": 0, "values": t0.values, "metric": 1.25, "status": "running"}
    assert d["best_spec"]["train"]["lr"] == t0.values["train.lr"] and d["best_spec"]["name"] == "lrs-best"
    row = next(t for t in d["trials"] if t["job"] == t1.job_id)
    assert (row["status"], row["rung"], row["metric"], row["steps"]) == ("early_stopped", 0, 4.0, 10)
    page = c.get(f"/experiments/{e.pk}/")
    c.force_login(user)
    page = c.get(f"/experiments/{e.pk}/")
    html = page.content.decode()
    assert page.status_code == 200 and 'id="experiment-app"' in html and f'data-experiment="{e.pk}"' in html
    assert 'id="submit-best-form"' in html and 'action="/jobs/new/"' in html and "early_stopped" in html
    assert f'action="/experiments/{e.pk}/trials/{t1.job_id}/continue/"' in html
    assert "Experiments</a>" in html  # the nav
    assert c.get("/experiments/").status_code == 200 and "lrs" in c.get("/experiments/").content.decode()
    job_page = c.get(f"/jobs/{t0.job_id}/").content.decode()
    assert f'href="/experiments/{e.pk}/"' in job_page
    # the best spec submits as a plain job through the job form
    r = c.post("/jobs/new/", {"spec": page.context["best_spec"]})
    assert r.status_code == 302 and Job.objects.filter(name="lrs-best", trial=None).exists()
    # continue the early-stopped trial, through the API
    r = c.post(f"/api/v1/experiments/{e.pk}/trials/{t1.job_id}/continue/")
    assert r.status_code == 202, r.content
    assert Job.objects.get(pk=t1.job_id).status == "QUEUED"
    assert c.post(f"/api/v1/experiments/{e.pk}/trials/{t1.job_id}/continue/").status_code == 409
    assert c.post(f"/api/v1/experiments/{e.pk}/trials/{t0.job_id}/continue/").status_code == 409
    assert c.post(f"/api/v1/experiments/{e.pk}/trials/99999/continue/").status_code == 404
    # stop from the page
    r = c.post(f"/experiments/{e.pk}/stop/")
    assert r.status_code == 302
    e.refresh_from_db()
    assert e.status == "stopped"
    assert c.post(f"/api/v1/experiments/{e.pk}/stop/").status_code == 409
    ok_exit(a0)


def test_openapi_lists_the_experiment_endpoints(user, client_for):
    schema = client_for(user).get("/api/schema/?format=json").json()
    paths = schema["paths"]
    assert "/api/v1/experiments/" in paths and "post" in paths["/api/v1/experiments/"]
    assert "/api/v1/experiments/{id}/stop/" in paths
    assert "/api/v1/experiments/{id}/trials/{job_id}/continue/" in paths


def test_the_job_list_filters_by_experiment(user, nodes, client_for, client):
    c = client_for(user)
    first = post(c, {"name": "a", "spec": TEMPLATE, "search": SEARCH}).json()["id"]
    second = post(c, {"name": "b", "spec": TEMPLATE, "search": SEARCH}).json()["id"]
    c.post("/api/v1/jobs/", {"name": "plain"}, format="json")
    trials = {e: sorted(Trial.objects.filter(experiment_id=e).values_list("job_id", flat=True)) for e in (first, second)}
    for e, jobs in trials.items():
        r = c.get(f"/api/v1/jobs/?experiment={e}")
        assert r.status_code == 200 and sorted(j["id"] for j in r.json()["results"]) == jobs
        assert {j["experiment"] for j in r.json()["results"]} == {e}
    both = c.get(f"/api/v1/jobs/?experiment={first},{second}").json()["results"]
    assert sorted(j["id"] for j in both) == sorted(trials[first] + trials[second])
    bad = c.get("/api/v1/jobs/?experiment=abc")
    assert bad.status_code == 400 and "experiment" in bad.json()["errors"]
    client.force_login(user)
    page = client.get(f"/jobs/?experiment={first}")
    assert page.status_code == 200
    assert sorted(j.pk for j in page.context["jobs"]) == trials[first]
