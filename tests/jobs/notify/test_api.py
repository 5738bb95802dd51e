"""/api/v1/webhooks/, /api/v1/subscriptions/ and the /notifications/ page: create (the secret once),
list, read, change, delete, the delivery log; who sees what; 400s with field errors and nothing
half-created."""
import pytest
from django.contrib.auth.models import Permission
from rest_framework.test import APIClient

from jobs.models import Delivery, DeliveryAttempt, Subscription
from jobs.notify.services import hook_secret

pytestmark = pytest.mark.django_db

HOOK = "/api/v1/webhooks/"


@pytest.fixture(autouse=True)
def allow_loopback(settings):
    settings.TRAINYARD_WEBHOOK_ALLOW = ["127.0.0.1", "10.9.0.0/16"]


def test_create_answers_201_with_the_secret_once(user, client_for):
    c = client_for(user)
    r = c.post(HOOK, {"url": "http://127.0.0.1:9999/hook", "events": ["job.ended", "experiment.ended"]}, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    hook = Subscription.objects.get(pk=body["id"])
    assert body["secret"] == hook_secret(hook.secret_salt) and len(body["secret"]) == 64
    assert body["events"] == ["job.ended", "experiment.ended"] and body["format"] == "json" and body["active"]
    assert body["secret"] not in str(Subscription.objects.filter(pk=hook.pk).values().first())  # not stored
    listed = c.get(HOOK).json()
    assert listed["count"] == 1 and "secret" not in listed["results"][0]
    assert "secret" not in c.get(f"{HOOK}{hook.pk}/").json()


def test_the_secret_depends_on_the_server_key(user, client_for, settings):
    r = client_for(user).post(HOOK, {"url": "http://127.0.0.1:9/h", "events": ["job.ended"]}, format="json")
    hook = Subscription.objects.get(pk=r.json()["id"])
    settings.TRAINYARD_WEBHOOK_KEY = "another-key"
    assert hook_secret(hook.secret_salt) != r.json()["secret"]


@pytest.mark.parametrize("data, field, message", [
    ({"url": "ftp://127.0.0.1/h", "events": ["job.ended"]}, "url", "only http and https"),
    ({"url": "http://u:p@127.0.0.1/h", "events": ["job.ended"]}, "url", "no credentials"),
    ({"url": "http://127.0.0.2/h", "events": ["job.ended"]}, "url", "does not allow"),
    ({"url": "http://169.254.169.254/", "events": ["job.ended"]}, "url", "does not allow"),
    ({"url": "http://no-such-host.invalid/h", "events": ["job.ended"]}, "url", "does not resolve"),
    ({"events": ["job.ended"]}, "url", "give the URL"),
    ({"url": "http://127.0.0.1:9/h", "events": ["job.done"]}, "events", "unknown event"),
    ({"url": "http://127.0.0.1:9/h", "events": []}, "events", "non-empty list"),
    ({"url": "http://127.0.0.1:9/h", "events": ["node.lost"]}, "events", "staff only"),
    ({"url": "http://127.0.0.1:9/h", "events": ["job.ended"], "format": "xml"}, "format", "json, slack"),
    ({"url": "http://127.0.0.1:9/h", "events": ["job.ended"], "team": "vision"}, "team", "not a member"),
    ({"url": "http://127.0.0.1:9/h", "events": ["job.ended"], "secret": "mine"}, "secret", "unknown field"),
])
def test_bad_input_is_a_400_naming_the_field_and_creates_nothing(user, client_for, data, field, message):
    r = client_for(user).post(HOOK, data, format="json")
    assert r.status_code == 400, r.content
    assert message in " ".join(r.json()["errors"][field])
    assert not Subscription.objects.exists()


def test_an_empty_allow_list_allows_no_webhook(user, client_for, settings):
    settings.TRAINYARD_WEBHOOK_ALLOW = []
    r = client_for(user).post(HOOK, {"url": "http://127.0.0.1:9/h", "events": ["job.ended"]}, format="json")
    assert r.status_code == 400 and "TRAINYARD_WEBHOOK_ALLOW is empty" in r.json()["errors"]["url"][0]


def test_not_a_json_object_is_a_400(user, client_for):
    r = client_for(user).post(HOOK, ["x"], format="json")
    assert r.status_code == 400 and "JSON object" in r.json()["errors"]["detail"][0]


def test_staff_may_subscribe_to_node_events(staff, client_for):
    r = client_for(staff).post(HOOK, {"url": "http://127.0.0.1:9/h", "events": ["node.lost", "node.quarantined"]},
                               format="json")
    assert r.status_code == 201 and r.json()["events"] == ["node.lost", "node.quarantined"]


def test_a_team_subscription_needs_membership_and_the_permission(user, other, teams, client_for):
    data = {"url": "http://127.0.0.1:9/h", "events": ["job.ended"], "team": "vision"}
    r = client_for(user).post(HOOK, data, format="json")
    assert r.status_code == 400 and "jobs.subscribe_team" in r.json()["errors"]["team"][0]
    user.user_permissions.add(Permission.objects.get(codename="subscribe_team"))
    user = type(user).objects.get(pk=user.pk)  # a fresh permission cache
    r = client_for(user).post(HOOK, data, format="json")
    assert r.status_code == 201 and r.json()["team"] == "vision"
    other.user_permissions.add(Permission.objects.get(codename="subscribe_team"))
    other = type(other).objects.get(pk=other.pk)
    r = client_for(other).post(HOOK, data, format="json")  # bob is in nlp, not vision
    assert r.status_code == 400 and "not a member" in r.json()["errors"]["team"][0]


def test_others_cannot_see_change_delete_or_read_the_log_of_a_hook(user, other, staff, client_for):
    hook_id = client_for(user).post(HOOK, {"url": "http://127.0.0.1:9/h", "events": ["job.ended"]},
                                    format="json").json()["id"]
    for who in (other, staff):
        c = client_for(who)
        assert c.get(HOOK).json()["count"] == 0
        assert c.get(f"{HOOK}{hook_id}/").status_code == 404
        assert c.get(f"{HOOK}{hook_id}/deliveries/").status_code == 404
        assert c.patch(f"{HOOK}{hook_id}/", {"active": False}, format="json").status_code == 404
        assert c.delete(f"{HOOK}{hook_id}/").status_code == 404
    assert Subscription.objects.get(pk=hook_id).active
    assert APIClient().get(HOOK).status_code in (401, 403)
    assert APIClient().post(HOOK, {"url": "http://127.0.0.1:9/h", "events": ["job.ended"]},
                            format="json").status_code in (401, 403)


def test_patch_changes_events_active_and_format_only(user, client_for):
    c = client_for(user)
    hook_id = c.post(HOOK, {"url": "http://127.0.0.1:9/h", "events": ["job.ended"]}, format="json").json()["id"]
    r = c.patch(f"{HOOK}{hook_id}/", {"events": ["job.hung", "job.ended"], "active": False, "format": "slack"},
                format="json")
    assert r.status_code == 200 and r.json()["events"] == ["job.ended", "job.hung"]
    assert (r.json()["active"], r.json()["format"]) == (False, "slack")
    r = c.patch(f"{HOOK}{hook_id}/", {"url": "http://127.0.0.1:10/h", "active": "yes"}, format="json")
    assert r.status_code == 400 and set(r.json()["errors"]) == {"url", "active"}
    assert Subscription.objects.get(pk=hook_id).url == "http://127.0.0.1:9/h"
    assert c.delete(f"{HOOK}{hook_id}/").status_code == 204 and not Subscription.objects.exists()


def test_the_delivery_log_shows_each_try(user, client_for):
    from django.utils import timezone

    c = client_for(user)
    hook_id = c.post(HOOK, {"url": "http://127.0.0.1:9/h", "events": ["job.ended"]}, format="json").json()["id"]
    d = Delivery.objects.create(subscription_id=hook_id, event="job.ended", text="job 1 failed", tries=2,
                                status="failed", last_status_code=503, last_error="HTTP 503")
    for n, code in ((1, None), (2, 503)):
        DeliveryAttempt.objects.create(delivery=d, number=n, started_at=timezone.now(), duration_s=0.5,
                                       status_code=code, error="timed out" if code is None else "HTTP 503")
    log = c.get(f"{HOOK}{hook_id}/deliveries/").json()
    assert log["count"] == 1
    row = log["results"][0]
    assert (row["status"], row["tries"], row["last_status_code"]) == ("failed", 2, 503)
    assert [(a["number"], a["status_code"], a["error"]) for a in row["attempts"]] == [
        (1, None, "timed out"), (2, 503, "HTTP 503")]


def test_email_subscriptions(user, client_for):
    c = client_for(user)
    r = c.post("/api/v1/subscriptions/", {"events": ["job.ended"]}, format="json")
    assert r.status_code == 400 and "no email address" in r.json()["errors"]["email"][0]
    user.email = "alice@example.com"
    user.save()
    r = c.post("/api/v1/subscriptions/", {"events": ["job.ended", "job.hung"]}, format="json")
    assert r.status_code == 201 and r.json()["channel"] == "email" and "url" not in r.json()
    assert c.get("/api/v1/subscriptions/").json()["count"] == 1 and c.get(HOOK).json()["count"] == 0
    sub_id = r.json()["id"]
    assert c.get(f"{HOOK}{sub_id}/").status_code == 404  # an email subscription is not a webhook
    r = c.patch(f"/api/v1/subscriptions/{sub_id}/", {"format": "slack"}, format="json")
    assert r.status_code == 400 and "format" in r.json()["errors"]
    assert c.delete(f"/api/v1/subscriptions/{sub_id}/").status_code == 204


def test_the_page_creates_shows_the_secret_once_and_deletes(user, other, client):
    client.force_login(user)
    r = client.get("/notifications/")
    assert r.status_code == 200 and b"No subscriptions" in r.content and b"node.lost" not in r.content
    r = client.post("/notifications/", {"action": "create", "channel": "webhook", "url": "http://127.0.0.1:9/h",
                                        "events": ["job.ended"], "format": "json"})
    hook = Subscription.objects.get()
    assert r.status_code == 201 and hook_secret(hook.secret_salt).encode() in r.content
    assert hook_secret(hook.secret_salt).encode() not in client.get("/notifications/").content
    r = client.post("/notifications/", {"action": "create", "channel": "webhook", "url": "http://10.10.0.1/h",
                                        "events": ["job.ended"]})
    assert r.status_code == 400 and b"does not allow" in r.content and Subscription.objects.count() == 1
    client.force_login(other)
    assert client.post("/notifications/", {"action": "delete", "id": str(hook.pk)}).status_code == 404
    client.force_login(user)
    assert client.post("/notifications/", {"action": "pause", "id": str(hook.pk)}).status_code == 302
    assert not Subscription.objects.get().active
    assert client.post("/notifications/", {"action": "delete", "id": str(hook.pk)}).status_code == 302
    assert not Subscription.objects.exists()


def test_the_page_needs_a_login(client):
    r = client.get("/notifications/")
    assert r.status_code == 302 and "/accounts/login/" in r["Location"]
