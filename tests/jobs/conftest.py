import pytest

from jobs.attempts import selectors
from jobs.core import dispatch
from tests.nodes import node_up


@pytest.fixture(autouse=True)
def sent(monkeypatch):
    """Record what services would send over Celery instead of needing a broker (unit tests only;
    the integration tests send through a real Redis)."""
    calls = []
    monkeypatch.setattr(dispatch, "send_launch", lambda node, payload: calls.append(("launch", node, payload)))
    monkeypatch.setattr(dispatch, "send_stop", lambda node, job_id, attempt_id, reason: calls.append(
        ("stop", node, attempt_id, reason)))
    monkeypatch.setattr(dispatch, "request_tick", lambda: calls.append(("tick",)))
    monkeypatch.setattr(dispatch, "fence", lambda attempt_id, reason: calls.append(("fence", attempt_id, reason)))
    monkeypatch.setattr(dispatch, "publish", lambda group, message: calls.append(("publish", group, message)))
    monkeypatch.setattr(dispatch, "bus_user_grant", lambda attempt_id, job_id, password, fenced=False: calls.append(
        ("bus_user", attempt_id, "fenced" if fenced else "granted")))
    monkeypatch.setattr(dispatch, "bus_user_revoke", lambda ids: calls.extend(("bus_user", a, "revoked") for a in ids))
    monkeypatch.setattr(dispatch, "send_notify", lambda event, **fields: calls.append(("notify", event, fields)))
    monkeypatch.setattr(dispatch, "send_delivery", lambda delivery_id, countdown=0.0: calls.append(
        ("delivery", delivery_id, countdown)))
    # the schedule tick's timings go to Redis (tests/jobs/scheduling/test_tick_stats.py uses a real one)
    monkeypatch.setattr(dispatch, "scheduler_tick_record", lambda seconds, ok: None)
    return calls


@pytest.fixture
def preempts(monkeypatch):
    """The (attempt, reason) of each preemption request a service would send (dispatch.request_preempt)."""
    asked = []
    monkeypatch.setattr(dispatch, "request_preempt", lambda a, reason, grace: asked.append((a, reason)))
    return asked


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user("alice", password="pw-alice-123")


@pytest.fixture
def other(django_user_model):
    return django_user_model.objects.create_user("bob", password="pw-bob-123")


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user("root", password="pw-root-123", is_staff=True)


@pytest.fixture
def nodes(db):

    out = []
    for name, addr in (("node-a", "127.0.0.1"), ("node-b", "127.0.0.2")):
        node, _ = node_up({"name": name, "address": addr, "slots": 2, "labels": {"rack": "r1"},
                                           "cpu_percent": 1.0, "mem_percent": 2.0})
        out.append(node)
    return out


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    # PBKDF2's 1M iterations cost ~0.3 s per user; these tests are not about hashing.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def teams(user, other):
    """Teams "vision" (alice) and "nlp" (bob)."""
    from django.contrib.auth.models import Group

    vision, nlp = Group.objects.create(name="vision"), Group.objects.create(name="nlp")
    user.groups.add(vision)
    other.groups.add(nlp)
    return vision, nlp


@pytest.fixture
def client_for():
    """An API client authenticated as the given user: client_for(user).get(...)."""
    from rest_framework.test import APIClient

    def make(user):
        c = APIClient()
        c.force_authenticate(user)
        return c
    return make


@pytest.fixture
def ckpt_root(settings, tmp_path):
    """A checkpoint root of the test's own (modules that register checkpoints use it)."""
    settings.TRAINYARD_CHECKPOINT_ROOT = tmp_path / "ckpt"
    return tmp_path / "ckpt"


@pytest.fixture
def relay_alive(monkeypatch):
    """The relay counts as alive, so the hang detector judges attempts (no relay runs here)."""

    monkeypatch.setattr(selectors, "relay_alive", lambda: True)


@pytest.fixture
def healthy_control_plane(db):
    """The control plane's clock (jobs/fleet/services/nodes.py, control_plane_clock) as after a day of node
    checks on schedule: silence is judged over the whole TRAINYARD_NODE_LOST_S. Without it the first
    check of a test starts a healthy stretch and judges no node."""
    from datetime import timedelta

    from django.utils import timezone

    from jobs.models import ControlPlaneClock

    now = timezone.now()
    ControlPlaneClock.objects.update_or_create(pk=1, defaults={"last_check_at": now,
                                                               "healthy_since": now - timedelta(days=1)})
