"""GPU faults from the agent's NVML heartbeat (Xid, uncorrected ECC): they count toward the node's
quarantine, and show in /metrics and on the node cards."""
from __future__ import annotations

import time

import pytest
from django.test import Client

from jobs import services
from jobs.models import Node

from tests.jobs.attempts.test_fault import kill
from tests.jobs.telemetry.test_prometheus import parse, value
from tests.jobs.runs.test_services import start, submit
from tests.nodes import node_up

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("ckpt_root", "relay_alive")]


def gpu(index, *, xids=(), ecc=0, util=37, temp=41):
    return {"kind": "cuda", "index": index, "name": "NVIDIA H200", "memory_bytes": 141 * 2**30,
            "memory_used_bytes": 12 * 2**30, "utilization": util, "nvml_index": index, "uuid": f"GPU-{index}",
            "temperature_c": temp, "ecc_uncorrected": ecc, "xid_supported": True, "xid_errors": len(xids),
            "xid_events": [{"xid": x, "at": time.time()} for x in xids]}


def beat(devices, name="node-b"):
    return node_up({"name": name, "address": "127.0.0.2", "slots": 2, "devices": devices})


def test_xid_errors_in_heartbeats_quarantine_the_node(nodes):
    beat([gpu(0, xids=[79]), gpu(1)])
    assert Node.objects.get(name="node-b").status == "READY"  # one fault: below the threshold of 2
    node, _ = beat([gpu(0, xids=[79]), gpu(1, xids=[48])])
    assert node.status == "QUARANTINED" and node.quarantined_at
    assert "2 failures" in node.quarantine_reason and "GPU 0 (GPU-0): Xid 79" in node.quarantine_reason
    assert "GPU 1 (GPU-1): Xid 48" in node.quarantine_reason


def test_an_xid_and_a_failed_attempt_add_up_and_a_cleared_node_is_not_requarantined_by_old_news(
        user, staff, nodes):
    devices = [gpu(0, xids=[79]), gpu(1)]
    beat(devices)
    job = submit(user, max_restarts=5)
    kill(start(job), node="node-b", rank=1)  # a signal on node-b: a node fault
    node = Node.objects.get(name="node-b")
    assert node.status == "QUARANTINED" and "attempts" in node.quarantine_reason and "Xid 79" in node.quarantine_reason
    services.node_clear(node, user=staff)
    beat(devices)  # the same events again (the agent repeats its last Xids every heartbeat): nothing new
    assert Node.objects.get(name="node-b").status == "READY"


def test_uncorrected_ecc_counts_and_user_xids_do_not(nodes):
    beat([gpu(0, xids=[13, 31, 43, 45, 45]), gpu(1)])  # a bad kernel and killed ranks: not the node's fault
    assert Node.objects.get(name="node-b").status == "READY"
    beat([gpu(0, ecc=1), gpu(1, ecc=2)])
    node = Node.objects.get(name="node-b")
    assert node.status == "QUARANTINED" and "2 uncorrected ECC errors" in node.quarantine_reason


def test_gpu_figures_in_metrics_and_on_the_node_cards(staff, nodes):
    beat([gpu(0, xids=[79], ecc=0), gpu(1, util=None, temp=None)])
    c = Client()
    c.force_login(staff)
    fams = parse(c.get("/metrics").content.decode())
    g0 = {"node": "node-b", "gpu": 0, "uuid": "GPU-0", "model": "NVIDIA H200"}
    assert value(fams, "trainyard_node_gpu_utilization_percent", **g0) == 37
    assert value(fams, "trainyard_node_gpu_memory_used_bytes", **g0) == 12 * 2**30
    assert value(fams, "trainyard_node_gpu_memory_total_bytes", **g0) == 141 * 2**30
    assert value(fams, "trainyard_node_gpu_temperature_celsius", **g0) == 41
    assert value(fams, "trainyard_node_gpu_ecc_uncorrected_errors", **g0) == 0
    assert value(fams, "trainyard_node_gpu_xid_errors_total", **g0) == 1
    assert fams["trainyard_node_gpu_xid_errors_total"]["type"] == "counter"
    # a figure NVML does not offer on GPU 1 has no sample rather than a made-up 0
    assert [lab["gpu"] for lab, _ in fams["trainyard_node_gpu_temperature_celsius"]["samples"]] == ["0"]
    page = c.get("/").content.decode()
    assert "12.0/141.0 GiB · 41 °C · Xid 79" in page and 'class="gpu-detail bad" title="GPU-0"' in page
    assert '<div class="gpu-detail" title="GPU-1">12.0/141.0 GiB</div>' in page
