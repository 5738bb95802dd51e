"""Calibrations in the control plane: the service that fits and stores, `manage.py calibrate`
on a stored document, the node-report task, and /api/v1/calibrations/."""
from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command

from jobs.core.errors import InvalidInput
from jobs.core import dispatch
from jobs.planning import constants as planning
from jobs import services, tasks
from jobs.models import Allocation, Attempt, Calibration, Job, Node
from trainyard.plan.constants import DeviceConstants
from tests.trainyard.plan.test_calibration import TRUE, synthetic
from tests.nodes import signed
from trainyard.launch import CALIBRATION_REPORT_TASK

pytestmark = pytest.mark.django_db
URL = "/api/v1/calibrations/"


@pytest.fixture
def requests_sent(monkeypatch):
    calls = []
    monkeypatch.setattr(dispatch, "send_calibrate", lambda node, **kw: calls.append((node, kw)))
    return calls


def test_store_fits_on_two_thirds_and_evaluates_the_rest_before_and_after(staff):
    doc = synthetic()
    row = services.calibration_store(doc, node="node-a", user=staff)
    assert (row.device_name, row.kind, row.node, row.created_by) == ("cpu", "cpu", "node-a", staff)
    ev = row.evaluation
    assert ev["held_out"] == list(range(1, 30, 3)) and len(ev["fit_runs"]) == 20
    assert ev["after"]["step_error_max"] < 1e-6 and ev["after"]["spearman"] == pytest.approx(1.0)
    assert ev["before"]["step_error_median"] > 0.2
    assert len(ev["after"]["per_run"]) == 10
    k = planning.constants_for("cpu")
    assert k.layer_overhead_s == pytest.approx(TRUE.layer_overhead_s, rel=1e-6)
    assert planning.latest_calibration("NVIDIA H200") is None
    newer = services.calibration_store(doc, node="node-b")
    assert planning.constants_for("cpu") == DeviceConstants.from_dict(newer.constants)
    assert planning.peak_for("cpu") == newer.peak_tflops > 0  # what the efficiencies are relative to


def test_an_invalid_document_is_refused_naming_the_field_and_stores_nothing():
    doc = synthetic()
    doc["runs"][0]["step_time_s"] = -1
    with pytest.raises(InvalidInput) as e:
        services.calibration_store(doc, node="n")
    assert "measurements.runs.0.step_time_s" in e.value.errors
    assert not Calibration.objects.exists()


def test_command_fits_a_stored_document_and_prints_before_and_after(tmp_path, capsys):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(synthetic()))
    call_command("calibrate", "--measurements", str(path), "--node", "here")
    out = json.loads(capsys.readouterr().out)
    assert out["node"] == "here" and out["runs"] == 30 and out["held_out"] == list(range(1, 30, 3))
    assert out["after"]["step_error_max"] < 1e-6 and out["before"]["step_error_max"] > 0.2
    assert "per_run" not in out["after"]
    assert Calibration.objects.get().node == "here"


@pytest.mark.parametrize("content, message", [("{", "--measurements"), ('{"version": 1}', "invalid measurements")])
def test_command_refuses_bad_documents(tmp_path, content, message):
    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(CommandError, match=message):
        call_command("calibrate", "--measurements", str(path))
    with pytest.raises(CommandError, match="--timeout"):
        call_command("calibrate", "--timeout", "0")
    assert not Calibration.objects.exists()


def test_the_report_task_stores_a_nodes_measurements_and_logs_a_failure(staff, caplog):
    def report(body: dict):  # as node-a's agent sends it: signed (issue 16)
        return tasks.calibration_report(signed(CALIBRATION_REPORT_TASK, body))

    assert report({"node": "node-a", "requested_by": staff.pk, "measurements": synthetic(),
                   "error": None, "wall_s": 12.0}) is not None
    row = Calibration.objects.get()
    assert row.node == "node-a" and row.created_by == staff
    assert report({"node": "node-a", "error": "the harness exited 1: boom"}) is None
    assert "boom" in caplog.text
    assert report({"node": "node-a", "surprise": 1}) is None
    bad = synthetic()
    bad["matmul"] = []
    assert report({"node": "node-a", "measurements": bad}) is None
    assert tasks.calibration_report({"node": "node-a", "measurements": synthetic()}) is None  # unsigned
    assert Calibration.objects.count() == 1


def test_list_needs_a_login_and_filters_by_device(user, client_for, client):
    services.calibration_store(synthetic(), node="node-a")
    assert client.get(URL).status_code in (401, 403)
    body = client_for(user).get(URL).json()
    assert body["count"] == 1
    row = body["results"][0]
    assert row["device_name"] == "cpu" and row["runs"] == 30 and "measurements" not in row
    assert row["after"]["spearman"] == pytest.approx(1.0) and row["before"]["runs"] == 10
    assert len(row["per_run"]) == 10
    assert client_for(user).get(URL, {"device": "NVIDIA H200"}).json()["count"] == 0
    full = client_for(user).get(URL, {"measurements": "1"}).json()["results"][0]
    assert full["measurements"]["version"] == 1


def test_post_is_staff_only_and_sends_the_request_to_the_idle_node(user, staff, nodes, client_for, requests_sent,
                                                                   django_capture_on_commit_callbacks):
    assert client_for(user).post(URL, {"node": "node-a"}, format="json").status_code == 403
    with django_capture_on_commit_callbacks(execute=True):
        r = client_for(staff).post(URL, {"node": "node-a", "quick": True}, format="json")
    assert r.status_code == 202 and r.json() == {"node": "node-a", "quick": True, "status": "requested"}
    assert requests_sent == [("node-a", {"quick": True, "requested_by": staff.pk})]


@pytest.mark.parametrize("body, status, field", [
    ({}, 400, "node"), ({"node": 3}, 400, "node"), ({"node": "node-a", "quick": "yes"}, 400, "quick"),
    ({"node": "node-a", "steps": 3}, 400, "steps"), ({"node": "nowhere"}, 404, "node")])
def test_post_bad_input_is_a_4xx_naming_the_field(staff, nodes, client_for, requests_sent, body, status, field):
    r = client_for(staff).post(URL, body, format="json")
    assert r.status_code == status and field in r.json()["errors"]
    assert requests_sent == []


def test_post_refuses_a_busy_or_cordoned_node(staff, user, nodes, client_for, requests_sent):
    Node.objects.filter(name="node-b").update(status=Node.Status.CORDONED)
    r = client_for(staff).post(URL, {"node": "node-b"}, format="json")
    assert r.status_code == 409 and "CORDONED" in r.json()["errors"]["node"][0]
    job = Job.objects.create(name="j", owner=user, spec={}, slots=1)
    attempt = Attempt.objects.create(job=job, number=1)
    Allocation.objects.create(attempt=attempt, node=nodes[0], node_rank=0, slot_ids=[0])
    r = client_for(staff).post(URL, {"node": "node-a"}, format="json")
    assert r.status_code == 409 and "running jobs" in r.json()["errors"]["node"][0]
    assert requests_sent == []
