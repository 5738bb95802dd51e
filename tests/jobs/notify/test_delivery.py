"""One try of a delivery against real receivers: a webhook endpoint on 127.0.0.1 that checks the
signature as a receiver would, and an SMTP sink (aiosmtpd). Retries with backoff, the log of every
try, timeouts, redirects not followed, the allow-list checked again at delivery time."""
import json
import time

import pytest

from jobs.models import Delivery, Subscription
from jobs.notify import services
from tests.jobs.notify.sinks import Receiver, SmtpSink, signature_ok

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def webhook_settings(settings):
    settings.TRAINYARD_WEBHOOK_ALLOW = ["127.0.0.1"]
    settings.TRAINYARD_WEBHOOK_TIMEOUT_S = 0.5
    settings.TRAINYARD_WEBHOOK_TRIES = 3
    settings.TRAINYARD_WEBHOOK_BACKOFF_S = 10.0


def hook(user, url, fmt="json", events=("job.ended",)):
    return services.webhook_create(user=user, url=url, events=list(events), fmt=fmt)


def delivery(sub, event="job.ended", text='job 7 "gpt" failed (user_error): boom'):
    return Delivery.objects.create(subscription=sub, event=event, text=text,
                                   body={"job": {"id": 7, "name": "gpt", "status": "FAILED", "failure_class": "user_error"}})


def try_once(d, capture):
    with capture(execute=True):
        return services.delivery_try(d.pk)


def test_a_delivery_is_a_signed_json_post(user, django_capture_on_commit_callbacks):
    with Receiver() as rx:
        sub, secret = hook(user, rx.url("/in?x=1"))
        d = delivery(sub)
        assert try_once(d, django_capture_on_commit_callbacks) == "delivered"
    (headers, body, _), = rx.requests
    assert signature_ok(secret, body, headers["x-trainyard-signature"])
    assert not signature_ok("another secret", body, headers["x-trainyard-signature"])
    assert headers["content-type"] == "application/json" and headers["x-trainyard-event"] == "job.ended"
    assert headers["x-trainyard-delivery"] == str(d.pk) and headers["host"] == f"127.0.0.1:{rx.port}"
    doc = json.loads(body)
    assert (doc["event"], doc["delivery"], doc["job"]["failure_class"]) == ("job.ended", d.pk, "user_error")
    assert body == services.delivery_body(Delivery.objects.get(pk=d.pk))  # the same bytes on every try
    d.refresh_from_db()
    assert (d.status, d.tries, d.last_status_code, d.finished_at is not None) == ("delivered", 1, 200, True)
    (a,) = d.attempts.all()
    assert (a.number, a.status_code, a.error, a.address) == (1, 200, "", "127.0.0.1") and a.duration_s < 5


def test_failed_tries_are_retried_with_backoff_and_logged(user, sent, django_capture_on_commit_callbacks):
    with Receiver(statuses=(503, 500, 200)) as rx:
        sub, secret = hook(user, rx.url())
        d = delivery(sub)
        assert try_once(d, django_capture_on_commit_callbacks) == "pending"
        assert try_once(d, django_capture_on_commit_callbacks) == "pending"
        assert try_once(d, django_capture_on_commit_callbacks) == "delivered"
    assert [c for c in sent if c[0] == "delivery"] == [("delivery", d.pk, 10.0), ("delivery", d.pk, 20.0)]
    assert len({body for _, body, _ in rx.requests}) == 1  # the same signed body each time
    d.refresh_from_db()
    assert [(a.number, a.status_code) for a in d.attempts.all()] == [(1, 503), (2, 500), (3, 200)]
    assert d.attempts.first().error.startswith("HTTP 503")


def test_a_delivery_fails_once_its_tries_are_spent(user, sent, django_capture_on_commit_callbacks):
    with Receiver(statuses=(500,)) as rx:
        d = delivery(hook(user, rx.url())[0])
        states = [try_once(d, django_capture_on_commit_callbacks) for _ in range(3)]
        assert try_once(d, django_capture_on_commit_callbacks) == "gone"  # a redelivered task does nothing
    assert states == ["pending", "pending", "failed"] and len(rx.requests) == 3
    assert Delivery.objects.get(pk=d.pk).tries == 3


def test_a_client_error_is_not_retried(user, sent, django_capture_on_commit_callbacks):
    with Receiver(statuses=(404,)) as rx:
        d = delivery(hook(user, rx.url())[0])
        assert try_once(d, django_capture_on_commit_callbacks) == "failed"
    assert not [c for c in sent if c[0] == "delivery"]


def test_a_hanging_receiver_times_out_within_the_bound_and_is_retried(user, sent, django_capture_on_commit_callbacks):
    with Receiver(delay_s=3.0) as rx:
        d = delivery(hook(user, rx.url())[0])
        t0 = time.monotonic()
        assert try_once(d, django_capture_on_commit_callbacks) == "pending"
        took = time.monotonic() - t0
    a = Delivery.objects.get(pk=d.pk).attempts.get()
    assert a.status_code is None and "timed out" in a.error
    assert 0.4 < a.duration_s < 2.0 and took < 2.5  # TRAINYARD_WEBHOOK_TIMEOUT_S = 0.5, not the receiver's 3 s
    assert ("delivery", d.pk, 10.0) in sent


def test_a_redirect_is_not_followed(user, django_capture_on_commit_callbacks):
    with Receiver() as elsewhere, Receiver(statuses=(302,), location=None) as rx:
        rx.location = elsewhere.url("/internal")
        d = delivery(hook(user, rx.url())[0])
        assert try_once(d, django_capture_on_commit_callbacks) == "failed"
    assert len(rx.requests) == 1 and elsewhere.requests == []
    a = Delivery.objects.get(pk=d.pk).attempts.get()
    assert a.status_code == 302 and "not followed" in a.error


def test_the_allow_list_is_checked_again_at_delivery(user, settings, sent, django_capture_on_commit_callbacks):
    with Receiver() as rx:
        d = delivery(hook(user, rx.url())[0])
        settings.TRAINYARD_WEBHOOK_ALLOW = ["10.0.0.0/8"]  # the operator narrowed it since
        assert try_once(d, django_capture_on_commit_callbacks) == "pending"
    assert rx.requests == []
    a = Delivery.objects.get(pk=d.pk).attempts.get()
    assert a.status_code is None and "refused" in a.error and "does not allow" in a.error and a.address == ""


def test_slack_payloads_and_paused_hooks(user, django_capture_on_commit_callbacks):
    with Receiver() as rx:
        sub, secret = hook(user, rx.url(), fmt="slack")
        assert try_once(delivery(sub), django_capture_on_commit_callbacks) == "delivered"
        Subscription.objects.filter(pk=sub.pk).update(active=False)
        paused = delivery(sub)
        assert try_once(paused, django_capture_on_commit_callbacks) == "failed"
    (headers, body, _), = rx.requests
    assert json.loads(body) == {"text": 'Trainyard: job 7 "gpt" failed (user_error): boom'}
    assert signature_ok(secret, body, headers["x-trainyard-signature"])
    assert Delivery.objects.get(pk=paused.pk).last_error == "subscription inactive"


@pytest.fixture
def smtp(settings):
    with SmtpSink() as sink:
        settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
        settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", sink.port
        settings.DEFAULT_FROM_EMAIL = "trainyard@test.example"
        yield sink


def test_email_reaches_the_smtp_sink(user, other, teams, smtp, settings, django_capture_on_commit_callbacks):
    user.email, other.email = "alice@example.com", "bob@example.com"
    user.save(), other.save()
    own = services.email_subscribe(user=user, events=["job.ended"])
    assert try_once(delivery(own), django_capture_on_commit_callbacks) == "delivered"
    (sender, to, msg), = smtp.messages
    assert (sender, to) == ("trainyard@test.example", ["alice@example.com"])
    assert msg["Subject"] == '[Trainyard] job 7 "gpt" failed (user_error): boom'
    assert "Event: job.ended" in msg.get_payload()
    other.groups.add(teams[0])  # bob joins vision: the team's subscription mails both
    settings.TRAINYARD_WEBHOOK_TRIES = 3
    team_sub = Subscription.objects.create(user=user, team=teams[0], channel="email", events=["job.ended"])
    assert try_once(delivery(team_sub), django_capture_on_commit_callbacks) == "delivered"
    assert sorted(to for _, (to,), _ in smtp.messages[1:]) == ["alice@example.com", "bob@example.com"]
    assert all(m["To"] in ("alice@example.com", "bob@example.com") for _, _, m in smtp.messages[1:])  # one each


def test_an_unreachable_mail_server_is_logged_and_retried(user, settings, sent, django_capture_on_commit_callbacks):
    from tests.conftest import free_port

    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", free_port(), 2
    user.email = "alice@example.com"
    user.save()
    d = delivery(services.email_subscribe(user=user, events=["job.ended"]))
    assert try_once(d, django_capture_on_commit_callbacks) == "pending"
    a = Delivery.objects.get(pk=d.pk).attempts.get()
    assert "ConnectionRefusedError" in a.error and ("delivery", d.pk, 10.0) in sent
