"""Every route x {anonymous, owner, teammate, other user, staff}: the status each gets.

The routes come from the URL configuration itself (and the websocket routing), so a route added
without a row in MATRIX fails `test_every_route_has_a_row`. A row gives the method and, per role,
the expected status; requests go through Django's test client with a logged-in session (CSRF
enforced for the unsafe methods, with the token the session's page would carry). The admin is
one rule: every registered model's changelist is staff-only (anonymous and non-staff users are
sent to the admin login). Websockets: a job's stream opens for its owner, teammate and staff
only; the cluster stream for any logged-in user.
"""
from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib import admin
from django.contrib.auth.models import Group
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse

from jobs.runs.routing import websocket_urlpatterns

pytestmark = pytest.mark.django_db

ROLES = ("anon", "owner", "teammate", "other", "staff")
LOGIN = 302  # a page redirects an anonymous user to the login form; the API answers 401


def row(method: str, anon: int, owner: int, teammate: int, other: int, staff: int, *, url=None, data=None):
    return {"method": method, "url": url, "data": data,
            "expect": dict(zip(ROLES, (anon, owner, teammate, other, staff), strict=True))}


# url: a callable (fixtures) -> path; default: reverse(name) with the job / node in kwargs.
MATRIX = {
    "login": row("GET", 200, 200, 200, 200, 200),
    "logout": row("GET", 405, 405, 405, 405, 405),  # Django 5: logout is POST only
    "schema": row("GET", 401, 200, 200, 200, 200),
    "metrics": row("GET", 401, 403, 403, 403, 200),
    "overview": row("GET", LOGIN, 200, 200, 200, 200),
    "job-list": row("GET", LOGIN, 200, 200, 200, 200),
    "job-new": row("GET", LOGIN, 200, 200, 200, 200),
    "job-detail": row("GET", LOGIN, 200, 200, 404, 200),
    "job-cancel": row("POST", LOGIN, 302, 302, 404, 302),
    "job-annotate": row("POST", LOGIN, 302, 302, 404, 302),  # tags and note: the owner, the team, staff
    "node-list": row("GET", LOGIN, 200, 200, 200, 200),
    "control-plane": row("GET", LOGIN, 200, 200, 200, 200),
    "quota-list": row("GET", LOGIN, 403, 403, 403, 200),
    "knowledge": row("GET", LOGIN, 200, 200, 200, 200),
    "relay-dead-letters": row("GET", LOGIN, 403, 403, 403, 200),
    "api-auth-token": row("GET", 405, 405, 405, 405, 405),
    "api-quotas": row("GET", 401, 200, 200, 200, 200),
    "api-knowledge": row("GET", 401, 200, 200, 200, 200),
    "api-code": row("GET", 401, 405, 405, 405, 405),
    "api-code-detail": row("GET", 401, 404, 404, 404, 404),
    "api-plan": row("GET", 401, 405, 405, 405, 405),
    "api-calibrations": row("GET", 401, 200, 200, 200, 200),
    "api-root": row("GET", 401, 200, 200, 200, 200),
    "api-job-list": row("GET", 401, 200, 200, 200, 200),
    "api-job-detail": row("GET", 401, 200, 200, 404, 200),
    "api-job-apply-recommendation": row("POST", 401, 409, 409, 404, 409),
    "api-job-cancel": row("POST", 401, 202, 403, 404, 202),
    "api-job-checkpoints": row("GET", 401, 200, 200, 404, 200),
    "api-job-events": row("GET", 401, 200, 200, 404, 200),
    "api-job-logs": row("GET", 401, 200, 200, 404, 200),
    "api-job-metrics": row("GET", 401, 200, 200, 404, 200),
    "api-job-pin": row("POST", 401, 403, 403, 404, 404),
    "api-job-rollback": row("POST", 401, 403, 403, 404, 400),
    "api-node-list": row("GET", 401, 200, 200, 200, 200),
    "api-node-detail": row("GET", 401, 200, 200, 200, 200),
    "api-node-clear": row("POST", 401, 403, 403, 403, 200),
    "api-node-cordon": row("POST", 401, 403, 403, 403, 200),
    "api-node-drain": row("POST", 401, 403, 403, 403, 400),
    "api-node-uncordon": row("POST", 401, 403, 403, 403, 200),
    # issue 25: compare page and bucketed series (a list leaves invisible jobs out: `missing`)
    "compare": row("GET", LOGIN, 200, 200, 404, 200),
    "api-job-series": row("GET", 401, 200, 200, 404, 200),
    "api-job-ranks": row("GET", 401, 200, 200, 404, 200),
    # everyone signed in reads the site's retention (and their own teams'); writes (PUT) are staff-only:
    # tests/jobs/telemetry/test_retention.py
    "api-retention": row("GET", 401, 200, 200, 200, 200),
    "api-series": row("GET", 401, 200, 200, 200, 200),
    "api-series-metrics": row("GET", 401, 200, 200, 200, 200),
    # experiments (issue 25): the owner stops first, so staff then finds it stopped (409)
    "experiment-list": row("GET", LOGIN, 200, 200, 200, 200),
    "experiment-new": row("GET", LOGIN, 200, 200, 200, 200),
    "experiment-detail": row("GET", LOGIN, 200, 200, 404, 200),
    "experiment-stop": row("POST", LOGIN, 302, 302, 404, 302),
    "experiment-trial-continue": row("POST", LOGIN, 302, 302, 404, 302),
    "api-experiment-list": row("GET", 401, 200, 200, 200, 200),
    "api-experiment-detail": row("GET", 401, 200, 200, 404, 200),
    "api-experiment-stop": row("POST", 401, 202, 403, 404, 409),
    "api-experiment-continue-trial": row("POST", 401, 409, 403, 404, 409),
    # notifications (issue 25): everyone lists their own; a subscription is its maker's alone
    "notifications": row("GET", LOGIN, 200, 200, 200, 200),
    "api-webhooks": row("GET", 401, 200, 200, 200, 200),
    "api-webhook": row("GET", 401, 200, 404, 404, 404),
    "api-webhook-deliveries": row("GET", 401, 200, 404, 404, 404),
    "api-subscriptions": row("GET", 401, 200, 200, 200, 200),
    "api-subscription": row("GET", 401, 200, 404, 404, 404),
    "api-subscription-deliveries": row("GET", 401, 200, 404, 404, 404),
}

KWARGS = {"job": ("pk",), "node": ("name",), "pin": ("pk", "checkpoint_id"), "digest": ("digest",)}


def route_names() -> set[str]:
    """Every named route outside the admin; an unnamed one is reported by its pattern."""
    names = set()

    def walk(resolver, prefix: str) -> None:
        for p in resolver.url_patterns:
            if isinstance(p, URLResolver):
                walk(p, prefix + str(p.pattern))
            elif isinstance(p, URLPattern) and not (prefix + str(p.pattern)).startswith("admin/"):
                names.add(p.name or f"<unnamed {prefix}{p.pattern}>")
    walk(get_resolver(), "")
    return names


def test_every_route_has_a_row():
    missing = sorted(route_names() - set(MATRIX))
    assert not missing, f"routes without a row in the permission matrix: {missing}"
    assert not sorted(set(MATRIX) - route_names()), "rows for routes that no longer exist"


@pytest.fixture
def world(django_user_model, nodes, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    from jobs.models import Job
    users = {
        "owner": django_user_model.objects.create_user("owner", password="pw-owner-1"),
        "teammate": django_user_model.objects.create_user("mate", password="pw-mate-1"),
        "other": django_user_model.objects.create_user("other", password="pw-other-1"),
        "staff": django_user_model.objects.create_superuser("boss", "boss@localhost", "pw-boss-1"),
    }
    team = Group.objects.create(name="vision")
    users["owner"].groups.add(team)
    users["teammate"].groups.add(team)
    users["other"].groups.add(Group.objects.create(name="nlp"))
    job = Job.objects.create(name="j", owner=users["owner"], team=team, spec={"name": "j"}, slots=1,
                             status=Job.Status.RUNNING)
    from jobs.models import Experiment, Trial
    experiment = Experiment.objects.create(name="e", owner=users["owner"], team=team, spec={"name": "e"},
                                           search={"space": {"train.lr": {"choice": [0.1]}}})
    Trial.objects.create(experiment=experiment, number=0, job=job, values={"train.lr": 0.1})
    return {"users": users, "job": job, "node": nodes[0], "experiment": experiment}


def client_as(world, role: str) -> Client:
    c = Client(enforce_csrf_checks=False)
    if role != "anon":
        c.force_login(world["users"][role])
    return c


def url_for(name: str, world) -> str:
    job, node = world["job"], world["node"]
    if name in ("api-webhook", "api-webhook-deliveries", "api-subscription", "api-subscription-deliveries"):
        from jobs.models import Subscription
        sub, _ = Subscription.objects.get_or_create(user=world["users"]["owner"], events=["job.ended"],
                                                    channel="webhook" if "webhook" in name else "email")
        return reverse(name, kwargs={"pk": sub.pk})
    if name in ("job-detail", "job-cancel", "job-annotate", "api-job-detail", "api-job-apply-recommendation", "api-job-cancel",
                "api-job-checkpoints", "api-job-events", "api-job-logs", "api-job-metrics", "api-job-rollback"):
        return reverse(name, kwargs={"pk": job.pk})
    if name == "api-job-pin":
        return reverse(name, kwargs={"pk": job.pk, "checkpoint_id": 999999})
    if name.startswith("api-node-") and name != "api-node-list":
        return reverse(name, kwargs={"name": node.name})
    if name == "compare":
        return f"{reverse(name)}?jobs={job.pk}"
    if name == "api-job-series":
        return f"{reverse(name, kwargs={'pk': job.pk})}?metric=loss"
    if name == "api-job-ranks":
        return f"{reverse(name, kwargs={'pk': job.pk})}?metric=step_s"
    if name in ("api-series", "api-series-metrics"):
        return f"{reverse(name)}?jobs={job.pk}&metric=loss"
    if name == "api-code-detail":
        return reverse(name, kwargs={"digest": "0" * 64})
    if name in ("experiment-detail", "experiment-stop", "api-experiment-detail", "api-experiment-stop"):
        return reverse(name, kwargs={"pk": world["experiment"].pk})
    if name in ("experiment-trial-continue", "api-experiment-continue-trial"):
        return reverse(name, kwargs={"pk": world["experiment"].pk, "job_id": job.pk})
    return reverse(name)


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_route_status_per_role(name, world, sent):
    spec = MATRIX[name]
    got = {}
    job = world["job"]
    for role in ROLES:
        type(job).objects.filter(pk=job.pk).update(status=job.Status.RUNNING)  # each role starts alike
        c = client_as(world, role)
        url = url_for(name, world)
        resp = c.get(url) if spec["method"] == "GET" else c.post(url, data=spec["data"] or {},
                                                                  content_type="application/json")
        got[role] = resp.status_code
        job.refresh_from_db()
        if name in ("job-cancel", "api-job-cancel"):  # a page answers a refusal with a redirect too
            allowed = role in ("owner", "staff")
            assert (job.status != job.Status.RUNNING) == allowed, (name, role, job.status)
    assert got == spec["expect"], f"{spec['method']} {name}: got {got}"


def test_anonymous_and_non_staff_are_kept_out_of_every_admin_changelist(world):
    urls = [reverse("admin:index")] + [reverse(f"admin:{m._meta.app_label}_{m._meta.model_name}_changelist")
                                       for m in admin.site._registry]
    assert len(urls) > 3
    for role in ROLES:
        c = client_as(world, role)
        for url in urls:
            status = c.get(url).status_code
            assert status == (200 if role == "staff" else 302), (role, url, status)


WS_MATRIX = {  # route pattern -> (path builder, expected close code per role; None: opened)
    "ws/jobs/<int:job_id>/": (lambda w: f"/ws/jobs/{w['job'].pk}/",
                              {"anon": 4401, "owner": None, "teammate": None, "other": 4404, "staff": None}),
    "ws/cluster/": (lambda w: "/ws/cluster/",
                    {"anon": 4401, "owner": None, "teammate": None, "other": None, "staff": None}),
}


def test_every_websocket_route_has_a_row():
    assert sorted(str(p.pattern) for p in websocket_urlpatterns) == sorted(WS_MATRIX)


def _ws_close_code(user, path: str):
    """None when the socket opened (its first message is not a close), else the close code."""
    from controlplane.asgi import application
    headers = [(b"host", b"testserver"), (b"origin", b"http://testserver")]
    if user is not None:
        c = Client()
        c.force_login(user)
        headers.append((b"cookie", f"sessionid={c.cookies['sessionid'].value}".encode()))

    async def go():
        comm = WebsocketCommunicator(application, path, headers=headers)
        await comm.connect(timeout=5)
        msg = await comm.receive_output(timeout=5)
        await comm.disconnect()
        return msg.get("code") if msg["type"] == "websocket.close" else None
    return async_to_sync(go)()


@pytest.mark.django_db(transaction=True)  # the consumers' database_sync_to_async closes connections
@pytest.mark.parametrize("route", sorted(WS_MATRIX))
def test_websocket_status_per_role(route, world, settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    path, expect = WS_MATRIX[route]
    got = {role: _ws_close_code(None if role == "anon" else world["users"][role], path(world)) for role in ROLES}
    assert got == expect, route
