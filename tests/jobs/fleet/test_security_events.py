"""Security events (refused reports) are rows counted per (kind, source), and a source is the node
name a report claims, which anyone who can write the control queue makes up (issue 21, section 4).
Before, every made-up name added a row: a node could grow the table without limit."""
from __future__ import annotations

import time

import pytest

from jobs.fleet.services import identity
from jobs.telemetry import prometheus
from jobs import services
from jobs.models import NodeJoinRequest, SecurityEvent
from trainyard.launch import RANKS_TASK

pytestmark = pytest.mark.django_db


def test_ten_thousand_made_up_names_leave_a_bounded_table_and_every_count(settings, nodes, monkeypatch):
    """Refused reports from 10,000 distinct made-up node names (through report_open, as the control
    tasks open them): at most TRAINYARD_SECURITY_EVENT_SOURCES_MAX rows of their own plus one
    overflow row, `trainyard_security_events_total` counts all 10,000, and a registered node's own
    refusals still get their row after the flood."""
    settings.TRAINYARD_SECURITY_EVENT_SOURCES_MAX = 20
    monkeypatch.setattr(identity, "_full_seen_at", identity._full_seen_at)  # restored after
    for i in range(10_000):
        envelope = {"node": f"made-up-{i}", "task": RANKS_TASK, "ts": time.time(), "body": {}, "sig": "0" * 64}
        assert services.report_open(envelope, task=RANKS_TASK) is None
    assert SecurityEvent.objects.filter(kind="unknown_node").count() == 21
    other = SecurityEvent.objects.get(kind="unknown_node", node=identity.OTHER_SOURCES)
    assert other.count == 10_000 - 20 and "made-up-9999" in other.detail
    assert metric("trainyard_security_events_total", kind="unknown_node") == 10_000
    services.security_event("bad_signature", "node-a", "a registered node's own refusal")
    assert SecurityEvent.objects.get(kind="bad_signature", node="node-a").count == 1
    assert not NodeJoinRequest.objects.exists()


def metric(name: str, **labels) -> float:
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    for line in prometheus.render().splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{want} not in /metrics")
