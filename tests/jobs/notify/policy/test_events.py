"""Who hears what (pure, table-driven), the events a subscription may name, the texts, the backoff."""
import pytest

from jobs.notify.policy import events as p
from jobs.notify.policy import retry

ALICE, BOB, ROOT = 1, 2, 3
VISION, NLP = 10, 20


def sub(user, *, staff=False, teams=(), team=None, events=p.EVENTS):
    return p.Subscriber(user, staff, frozenset(teams), team, frozenset(events))


def ev(name, owner=None, team=None):
    return p.Event(name, "text", owner, team, {})


@pytest.mark.parametrize("who, event, heard", [
    (sub(ALICE), ev("job.ended", ALICE), True),                               # own job
    (sub(ALICE), ev("job.ended", BOB), False),                                # someone else's
    (sub(ALICE, teams=[VISION]), ev("job.ended", BOB, VISION), False),        # a teammate's job: the team's subscription
    (sub(ALICE, teams=[VISION], team=VISION), ev("job.ended", BOB, VISION), True),
    (sub(ALICE, teams=[], team=VISION), ev("job.ended", BOB, VISION), False),  # maker left the team
    (sub(ALICE, teams=[VISION], team=VISION), ev("job.ended", BOB, NLP), False),
    (sub(ALICE, teams=[VISION], team=VISION), ev("job.ended", ALICE), False),  # own job outside the team
    (sub(ALICE, teams=[VISION]), ev("quota.changed", None, VISION), True),   # a team-wide event
    (sub(ALICE, teams=[VISION]), ev("quota.changed", None, NLP), False),
    (sub(ALICE), ev("quota.changed", ALICE), True),                           # own user quota
    (sub(ALICE), ev("node.lost"), False),                                     # staff only
    (sub(ROOT, staff=True), ev("node.lost"), True),
    (sub(ROOT, staff=True, teams=[VISION], team=VISION), ev("node.quarantined"), False),
    (sub(ROOT, staff=True), ev("job.ended", ALICE), False),                   # staff hear their own jobs only
    (sub(ALICE, events=["job.hung"]), ev("job.ended", ALICE), False),         # not subscribed to it
    (sub(ALICE), ev("experiment.ended", ALICE, VISION), True),
    (sub(ALICE), ev("experiment.ended"), False),                              # belongs to no one
])
def test_who_hears_an_event(who, event, heard):
    assert p.hears(who, event) is heard


@pytest.mark.parametrize("events, staff, team, result", [
    (["job.ended"], False, False, ["job.ended"]),
    (["experiment.ended", "job.ended", "job.ended"], False, False, ["job.ended", "experiment.ended"]),
    (["node.lost"], True, False, ["node.lost"]),
    (["node.lost"], False, False, "staff only"),
    (["node.quarantined"], True, True, "staff only"),
    ([], False, False, "non-empty list"),
    ("job.ended", False, False, "non-empty list"),
    (["job.finished"], False, False, "unknown event 'job.finished'"),
    ([7], False, False, "unknown event '7'"),
])
def test_the_events_a_subscription_may_name(events, staff, team, result):
    if isinstance(result, list):
        assert p.check_events(events, staff=staff, team=team) == result
    else:
        with pytest.raises(ValueError, match=result):
            p.check_events(events, staff=staff, team=team)


@pytest.mark.parametrize("kind, message, data, text", [
    ("failed", "ValueError: bad", {"failure_class": "user_error"}, 'job 7 "gpt" failed (user_error): ValueError: bad'),
    ("succeeded", "200 steps", {}, 'job 7 "gpt" succeeded: 200 steps'),
    ("cancelled", "", {}, 'job 7 "gpt" cancelled'),
    ("hang_detected", "no step for 60 s", {}, 'job 7 "gpt" is hung: no step for 60 s'),
    ("restart", "restart 1 of 3", {}, 'job 7 "gpt" restarted: restart 1 of 3'),
])
def test_job_event_texts(kind, message, data, text):
    assert p.job_event_text({"id": 7, "name": "gpt"}, kind, message, data) == text


def test_payloads_json_and_slack_and_the_email():
    e = p.Event("job.ended", 'job 7 "gpt" failed', 1, None, {"job": {"id": 7}})
    assert p.payload(e, fmt="json", delivery=5, created_at="t") == {
        "event": "job.ended", "delivery": 5, "created_at": "t", "text": 'job 7 "gpt" failed', "job": {"id": 7}}
    assert p.payload(e, fmt="slack", delivery=5, created_at="t") == {"text": 'Trainyard: job 7 "gpt" failed'}
    subject, body = p.email_message(e, link="https://ty.example.com/jobs/7/")
    assert subject == '[Trainyard] job 7 "gpt" failed' and "https://ty.example.com/jobs/7/" in body
    assert p.other_text("experiment.ended", {"experiment": 3, "name": "lr", "status": "SUCCEEDED",
                                             "best": {"job": 9, "metric": 1.5}}) == \
        'experiment 3 "lr" ended: SUCCEEDED, best 1.5 (job 9)'
    assert p.other_text("experiment.ended", {"text": "custom"}) == "custom"


@pytest.mark.parametrize("tries, delay", [(1, 10.0), (2, 20.0), (3, 40.0), (4, None), (9, None)])
def test_backoff_doubles_until_the_tries_are_spent(tries, delay):
    assert retry.next_delay(tries, max_tries=4, base_s=10.0) == delay


@pytest.mark.parametrize("status, ok, again", [
    (200, True, False), (204, True, False), (None, False, True), (500, False, True), (503, False, True),
    (429, False, True), (408, False, True), (404, False, False), (400, False, False), (301, False, False),
])
def test_which_answers_are_retried(status, ok, again):
    assert retry.succeeded(status) is ok
    assert retry.retryable(status) is again
