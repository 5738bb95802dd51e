"""A staff calibration request end to end: POST /api/v1/calibrations/ -> the control plane sends
NODE_CALIBRATE_TASK to node-a's queue -> its agent runs the harness (torchrun, 2 gloo ranks) ->
CALIBRATION_REPORT_TASK on the control queue -> the control worker fits and stores the row ->
GET /api/v1/calibrations/ lists it. Real redis, daphne, Celery workers and agents."""
from __future__ import annotations

import pytest


pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]


def test_a_staff_request_calibrates_the_node_and_stores_the_fit(cluster):
    assert cluster.get("/api/v1/calibrations/")["count"] == 0
    status, body = cluster.request("POST", "/api/v1/calibrations/", {"node": "node-z"})
    assert status == 404 and "node" in body["errors"]
    status, body = cluster.request("POST", "/api/v1/calibrations/", {"node": "node-a", "quick": True})
    assert status == 202, body
    done = cluster.wait_for(lambda: cluster.get("/api/v1/calibrations/")["results"], 400, "the calibration row")
    row = done[0]
    assert row["node"] == "node-a" and row["device_name"] == "cpu" and row["created_by"] == "admin"
    assert row["runs"] == 10 and row["held_out"] == [1, 4, 7]
    assert row["after"]["runs"] == 3 and row["after"]["activation_error_max"] is not None
    assert row["constants"]["source"].startswith("calibrated ")
    assert row["constants"]["intra_gbs"] > 0 and row["peak_tflops"] > 0
