"""HTML pages: login required, the submit form creates a job or shows field errors."""
import pytest
from django.test import Client

from jobs.models import Job

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("url", ["/", "/jobs/", "/jobs/new/", "/nodes/", "/jobs/1/", "/quotas/"])
def test_pages_require_login(url):
    r = Client().get(url)
    assert r.status_code == 302 and "/accounts/login/" in r["Location"]


def test_submit_form_creates_job_and_shows_detail(user, nodes):
    c = Client(enforce_csrf_checks=False)
    c.force_login(user)
    assert c.get("/jobs/new/").status_code == 200
    r = c.post("/jobs/new/", {"spec": "name: from-yaml\ntrain: {steps: 20}\n"})
    job = Job.objects.get()
    assert r.status_code == 302 and r["Location"] == f"/jobs/{job.pk}/"
    assert job.spec["train"]["steps"] == 20
    page = c.get(f"/jobs/{job.pk}/")
    assert page.status_code == 200 and b"from-yaml" in page.content
    for url in ("/", "/jobs/", "/nodes/"):
        assert c.get(url).status_code == 200


def test_submit_form_shows_field_errors(user, nodes):
    c = Client()
    c.force_login(user)
    r = c.post("/jobs/new/", {"spec": '{"name": "x", "model": {"layers": 0}}'})
    assert r.status_code == 400 and b"model.layers" in r.content
    r = c.post("/jobs/new/", {"spec": "{not json: ["})
    assert r.status_code == 400
    assert Job.objects.count() == 0


def test_form_posts_need_csrf(user, nodes):
    c = Client(enforce_csrf_checks=True)
    c.force_login(user)
    assert c.post("/jobs/new/", {"spec": '{"name": "x"}'}).status_code == 403
    assert Job.objects.count() == 0


def test_other_users_job_page_is_404(user, other, nodes):
    from jobs import services

    job = services.job_submit(user=other, spec=services.submitted_spec({"name": "secret"}))
    c = Client()
    c.force_login(user)
    assert c.get(f"/jobs/{job.pk}/").status_code == 404
    assert c.post(f"/jobs/{job.pk}/cancel/").status_code == 404
