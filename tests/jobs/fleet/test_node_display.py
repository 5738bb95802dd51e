"""What the pages show of a node (a GPU's one-line detail, the device summary, the drain actions
on offer) is computed once, in jobs/fleet/serializers.py: the server-rendered cards use it and the
API and the cluster socket send it with every node, so static/js/cluster.js has no copy of the rules."""
from __future__ import annotations

from tests.conftest import REPO

import pytest

from jobs.fleet.serializers import device_summary, gpu_detail, node_controls
from jobs.fleet.views import nodes_for_page
from jobs.runs import payloads

from .test_gpu_faults import beat, gpu

pytestmark = pytest.mark.django_db
CLUSTER_JS = REPO / "static" / "js" / "cluster.js"


def test_the_socket_and_the_first_paint_show_the_same_figures(staff, nodes):
    beat([{"kind": "cpu", "index": 0}, gpu(0, xids=[79]), gpu(1, util=None, temp=None)])
    sent = {n["name"]: n for n in payloads.cluster_state(staff, 0.0)["nodes"]}
    for n in nodes_for_page():
        row = sent[n.name]
        assert row["device_summary"] == n.device_summary
        assert row["gpu_details"] == [g["detail"] for g in n.gpus]
        assert row["controls"] == n.controls
    b = sent["node-b"]
    assert b["device_summary"] == "1 × cpu, 2 × cuda NVIDIA H200"
    assert b["gpu_details"] == ["12.0/141.0 GiB · 41 °C · Xid 79", "12.0/141.0 GiB"]
    assert [(c["action"], c["mode"]) for c in b["controls"]] == [("cordon", ""), ("drain", "finish"),
                                                                  ("drain", "preempt")]


def test_a_node_action_answers_with_the_controls_of_its_new_mode(staff, nodes, client_for):
    r = client_for(staff).post("/api/v1/nodes/node-a/cordon/", {}, format="json")
    assert r.status_code == 200, r.content
    assert r.json()["drain_mode"] == "cordon" and r.json()["controls"] == node_controls("cordon")
    assert [c["label"] for c in r.json()["controls"]] == ["Drain (finish)", "Drain (preempt)", "Uncordon"]


def test_the_rules_are_not_copied_into_the_javascript():
    js = CLUSTER_JS.read_text()
    for copy in ("uncorrected ECC", "GiB", "'Drain (finish)'", "'Drain (preempt)'", " × "):
        assert copy not in js, copy
    assert gpu_detail({"kind": "cuda"}) == "" and device_summary(None) == ""
