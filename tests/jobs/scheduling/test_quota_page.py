"""Scheduling pages (issue 5), server side: the staff-only quota page with its audit log, staff node
controls on the nodes page, queue position / predicted start on the job list and job page, and the
borrowing badge."""
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from jobs import services
from jobs.runs import views
from jobs.models import Job, Node

from tests.jobs.runs.test_services import start, submit

pytestmark = pytest.mark.django_db


def logged_in(user) -> Client:
    c = Client()
    c.force_login(user)
    return c


def row(html: str, kind: str, name: str) -> str:
    m = re.search(rf'<tr data-kind="{kind}" data-name="{name}">.*?</tr>', html, re.S)
    assert m, f"no row for {kind} {name}"
    return m.group(0)


def test_quota_page_is_staff_only(user, staff):
    r = Client().get("/quotas/")
    assert r.status_code == 302 and "/accounts/login/" in r["Location"]
    assert logged_in(user).get("/quotas/").status_code == 403
    assert logged_in(user).get("/quotas/?part=audit").status_code == 403
    assert logged_in(staff).get("/quotas/").status_code == 200


def test_nav_links_quotas_for_staff_only(user, staff, nodes):
    assert 'href="/quotas/"' not in logged_in(user).get("/").content.decode()
    html = logged_in(staff).get("/quotas/").content.decode()
    assert '<a href="/quotas/" class="active" aria-current="page">Quotas</a>' in html


def test_quota_page_lists_every_team_with_quota_usage_and_inputs(user, other, staff, teams, nodes, django_user_model):
    start(submit(user))  # vision: 2 slots in use
    submit(user)         # and 2 queued behind it
    services.quotas_update(actor=staff, entries=[{"team": "vision", "max_slots": 4, "device_hours": 12.5},
                                                 {"user": "bob", "max_slots": 2}])
    html = logged_in(staff).get("/quotas/").content.decode()
    vision = row(html, "team", "vision")
    assert 'name="max_slots"' in vision and 'value="4"' in vision and 'value="12.5"' in vision
    assert re.search(r'data-col="in_use">2<', vision) and re.search(r'data-col="queued">2<', vision)
    assert re.search(r'data-col="borrowed">0<', vision)
    assert re.search(r'data-col="device_hours_used">[\d.]+ / 12.5<', vision)
    nlp = row(html, "team", "nlp")  # no quota yet: listed with empty inputs
    assert re.search(r'name="max_slots"[^>]*value=""', nlp) and re.search(r'data-col="in_use">0<', nlp)
    bob = row(html, "user", "bob")
    assert '<span class="badge">user</span>' in bob and 'value="2"' in bob
    assert html.index('data-name="nlp"') < html.index('data-name="vision"') < html.index('data-name="bob"')


def test_quota_page_shows_the_audit_log_newest_first_and_as_a_fragment(user, staff, teams):
    services.quotas_update(actor=staff, entries={"team": "vision", "max_slots": 4})
    services.quotas_update(actor=staff, entries={"team": "vision", "max_slots": 6, "device_hours": 100})
    html = logged_in(staff).get("/quotas/").content.decode()
    audit = re.search(r'<tbody id="quota-audit">.*?</tbody>', html, re.S).group(0)
    rows = re.findall(r"<tr data-change=\"\d+\">.*?</tr>", audit, re.S)
    assert len(rows) == 2
    assert "team:vision" in rows[0] and "<td>root</td>" in rows[0]
    assert ('<span class="old">4 slots, no device-hour limit</span> → '
            '<span class="new">6 slots, 100 device-h</span>') in rows[0]
    assert '<span class="old">none</span> → <span class="new">4 slots, no device-hour limit</span>' in rows[1]

    part = logged_in(staff).get("/quotas/?part=audit")
    assert part.status_code == 200
    body = part.content.decode().strip()
    assert body.startswith('<tbody id="quota-audit">') and body.endswith("</tbody>") and "<html" not in body
    assert body.count("<tr data-change=") == 2


def test_quota_page_without_teams_or_changes_says_so(staff):
    html = logged_in(staff).get("/quotas/").content.decode()
    assert "No teams yet" in html and "No quota changes yet." in html


@pytest.mark.parametrize("drain_mode,expected", [
    ("", [("cordon", None), ("drain", "finish"), ("drain", "preempt")]),
    ("cordon", [("drain", "finish"), ("drain", "preempt"), ("uncordon", None)]),
    ("finish", [("drain", "preempt"), ("uncordon", None)]),
    ("preempt", [("uncordon", None)]),
])
def test_nodes_page_offers_staff_the_controls_that_fit(user, staff, nodes, drain_mode, expected):
    Node.objects.filter(name="node-a").update(drain_mode=drain_mode)
    html = logged_in(staff).get("/nodes/").content.decode()
    card = re.search(r'<article class="node" data-node="node-a">.*?</article>', html, re.S).group(0)
    buttons = re.findall(r'<button type="button" class="small \w+" data-action="(\w+)"(?: data-mode="(\w+)")? '
                         r'data-node="node-a">', card)
    assert [(a, m or None) for a, m in buttons] == expected
    assert 'id="node-confirm"' in html and 'data-can-control="1"' in html
    assert ('class="drain"' in card) is bool(drain_mode)

    for client, path in ((logged_in(user), "/nodes/"), (logged_in(staff), "/")):
        other = client.get(path).content.decode()
        assert "node-actions" not in other and 'id="node-confirm"' not in other, path
        assert 'data-can-control=""' in other


def test_nodes_page_shows_drain_state_after_a_drain(staff, nodes):
    services.node_set_schedulable(nodes[1], user=staff, action="drain", mode="finish")
    html = logged_in(staff).get("/nodes/").content.decode()
    card = re.search(r'<article class="node" data-node="node-b">.*?</article>', html, re.S).group(0)
    assert '<span class="status s-draining">DRAINING</span>' in card
    assert "<b>Draining (finish)</b>: no new work; running jobs finish" in card
    assert re.search(r'<td><span class="status s-draining">DRAINING</span>\s*<small class="muted">finish</small></td>',
                     html)


def test_job_list_and_page_show_queue_position_and_predicted_start(user, nodes):
    start(submit(user, resources={"nodes": 2, "procs_per_node": 2}))  # takes all four slots
    waiting = submit(user, name="waiting")
    c = logged_in(user)
    html = c.get("/jobs/").content.decode()
    tr = re.search(rf'<tr data-job="{waiting.pk}">.*?</tr>', html, re.S).group(0)
    assert "#1" in tr and '<span class="eta-text" title="no prediction yet">unknown</span>' in tr
    page = c.get(f"/jobs/{waiting.pk}/").content.decode()
    assert re.search(r'<div class="stat" id="queue-stat"><div class="k">Queue</div><div class="v">'
                     r'<span id="job-queue-pos">#1</span>', page)
    assert '<span id="job-eta" title="no prediction yet">unknown</span>' in page

    when = timezone.now() + timedelta(minutes=4, seconds=10)
    Job.objects.filter(pk=waiting.pk).update(predicted_start_at=when)
    tr = re.search(rf'<tr data-job="{waiting.pk}">.*?</tr>', c.get("/jobs/").content.decode(), re.S).group(0)
    assert re.search(r'<span class="eta-text" title="\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \w+">in ~4 min</span>', tr)
    page = c.get(f"/jobs/{waiting.pk}/").content.decode()
    assert re.search(r'<span id="job-eta" title="[^"]+" data-at="[^"]+">in ~4 min</span>', page)


def test_job_page_hides_queue_stat_when_running_and_shows_borrowing(user, nodes):
    job = submit(user)
    start(job)
    c = logged_in(user)
    page = c.get(f"/jobs/{job.pk}/").content.decode()
    assert '<div class="stat" id="queue-stat" hidden>' in page
    assert re.search(r'<span class="badge b-borrowing" id="job-borrowing" title="[^"]+" hidden>borrowing</span>', page)
    Job.objects.filter(pk=job.pk).update(borrowing=True, status_reason="preempting: team vision needs its quota")
    page = c.get(f"/jobs/{job.pk}/").content.decode()
    assert re.search(r'<span class="badge b-borrowing" id="job-borrowing" title="[^"]+">borrowing</span>', page)
    assert '<p class="reason preempt" id="job-reason">preempting: team vision needs its quota</p>' in page
    row_html = re.search(rf'<tr data-job="{job.pk}">.*?</tr>', c.get("/jobs/").content.decode(), re.S).group(0)
    assert ">borrowing</span>" in row_html and "eta-text" not in row_html  # running: no predicted start


@pytest.mark.parametrize("seconds,text", [
    (-5, "any moment"), (10, "any moment"), (60, "in ~1 min"), (250, "in ~4 min"), (3 * 3600, "in ~3.0 h"),
    (3 * 86400, "in ~3 days")])
def test_eta_text(seconds, text):
    now = timezone.now()
    assert views._eta_text(now + timedelta(seconds=seconds), now) == text
    assert views._eta_text(None, now) == "unknown"
