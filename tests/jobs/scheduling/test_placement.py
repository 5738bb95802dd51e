"""Device-aware placement through the services (issue 16, section 4): heartbeats advertising cuda
devices (as workers/gpus.py sends them through NVML), job_submit, schedule_tick, the submit's
warning in the API and on the form, the waiting reason in the API, on the job page and in the
queue's "why waiting"."""
import json

import pytest
from django.test import Client

from jobs import services
from tests.nodes import node_up
from jobs.models import Job, Node

pytestmark = pytest.mark.django_db

GIB = 1 << 30
CUDA_ONE = {"resources": {"nodes": 1, "procs_per_node": 1, "device": "cuda"}, "parallel": {"dp": 1}}


def gpu(index, mem_gib=80):
    return {"kind": "cuda", "index": index, "name": "NVIDIA A100-SXM4-80GB", "memory_bytes": mem_gib * GIB,
            "memory_used_bytes": 512 << 20, "utilization": 0, "nvml_index": index, "uuid": f"GPU-{index}",
            "temperature_c": 40, "ecc_uncorrected": 0, "xid_supported": True, "xid_errors": 0, "xid_events": []}


def beat(name, addr, slots, devices, labels=None):
    node, _ = node_up({"name": name, "address": addr, "slots": slots, "devices": devices,
                       "labels": labels or {}, "cpu_percent": 1.0, "mem_percent": 2.0})
    return node


@pytest.fixture
def cpu_nodes(db):
    return [beat(n, a, 2, [{"kind": "cpu", "index": i, "cores": 2} for i in range(2)], {"rack": "r1"})
            for n, a in (("node-a", "127.0.0.1"), ("node-b", "127.0.0.2"))]


def submit(user, **kw):
    return services.job_submit(user=user, spec=services.submitted_spec({"name": "t", **kw}))


def test_heartbeat_stores_what_the_node_advertises(db):
    node = beat("gpu-1", "10.0.0.1", 2, [gpu(0, 80), gpu(1, 40)])
    assert (node.device_kind, node.gpu_count, node.gpu_memory_bytes) == ("cuda", 2, 40 * GIB)
    node = beat("gpu-1", "10.0.0.1", 2, [])  # NVML failed this heartbeat: no GPUs to place on
    assert (node.device_kind, node.gpu_count) == ("", 0)


def test_cuda_job_on_cpu_only_cluster_waits_with_a_reason_then_lands_on_the_gpu_node(
        user, cpu_nodes, sent, django_capture_on_commit_callbacks):
    job = submit(user, **CUDA_ONE)
    assert job.warnings == ["no registered node has cuda devices: the job waits until such a node joins"]
    with django_capture_on_commit_callbacks(execute=True):
        services.schedule_tick()
    job.refresh_from_db()
    assert job.status == "QUEUED" and not job.attempts.exists()
    assert job.status_reason == "no READY node has cuda devices; waiting for nodes"
    assert not [c for c in sent if c[0] == "launch"]
    beat("gpu-1", "10.0.0.9", 2, [gpu(0), gpu(1)])
    with django_capture_on_commit_callbacks(execute=True):
        services.schedule_tick()
    job.refresh_from_db()
    assert job.status == "STARTING"
    (launch,) = [c for c in sent if c[0] == "launch"]
    assert launch[1] == "gpu-1" and launch[2]["device"] == "cuda" and launch[2]["slots"] == [0]


def test_cpu_job_keeps_todays_placement(user, cpu_nodes, sent):
    job = submit(user)
    assert job.warnings == []
    services.schedule_tick()
    job.refresh_from_db()
    assert job.status == "STARTING"


def test_one_slot_per_advertised_gpu(user, cpu_nodes, sent):
    # registered with 4 slots, but NVML sees 2 GPUs: a 4-rank cuda job can never run there
    beat("gpu-1", "10.0.0.9", 4, [gpu(0), gpu(1)])
    job = submit(user, resources={"nodes": 1, "procs_per_node": 4, "device": "cuda"}, parallel={"dp": 4})
    assert job.warnings == ["needs 1 registered node(s) with 4 cuda GPU(s) each; 1 such node(s), with at most 2: "
                            "the job waits until such a node joins"]
    two = submit(user, resources={"nodes": 1, "procs_per_node": 2, "device": "cuda"}, parallel={"dp": 2})
    services.schedule_tick()
    job.refresh_from_db()
    two.refresh_from_db()
    assert job.status == "QUEUED" and job.status_reason.startswith("needs 1 READY node(s) with 4 cuda GPU(s)")
    assert two.status == "STARTING"
    assert two.attempts.get().allocations.get().slot_ids == [0, 1]


def test_gpu_memory_and_labels_select_the_node(user, cpu_nodes, sent):
    beat("gpu-small", "10.0.0.8", 2, [gpu(0, 40), gpu(1, 40)], {"gpu": "a100", "rack": "r1"})
    beat("gpu-big", "10.0.0.9", 2, [gpu(0, 80), gpu(1, 80)], {"gpu": "a100", "rack": "r2"})
    big = submit(user, **{**CUDA_ONE, "resources": {**CUDA_ONE["resources"], "gpu_memory_gb": 80}})
    r2 = submit(user, resources={"nodes": 1, "procs_per_node": 1, "labels": {"gpu": "a100", "rack": "r2"}},
                parallel={"dp": 1})
    h100 = submit(user, **{**CUDA_ONE, "resources": {**CUDA_ONE["resources"], "labels": {"gpu": "h100"}}})
    assert h100.warnings == ["no registered node with cuda devices has labels gpu=h100: the job waits until such "
                             "a node joins"]
    assert big.warnings == [] and r2.warnings == []
    services.schedule_tick()
    for job in (big, r2, h100):
        job.refresh_from_db()
    assert big.attempts.get().allocations.get().node.name == "gpu-big"
    assert r2.attempts.get().allocations.get().node.name == "gpu-big"
    assert h100.status == "QUEUED" and h100.status_reason == ("no READY node with cuda devices has labels "
                                                              "gpu=h100; waiting for nodes")


def test_a_quarantined_gpu_node_leaves_cuda_jobs_waiting_for_a_ready_one(user, cpu_nodes, sent):
    beat("gpu-1", "10.0.0.9", 2, [gpu(0), gpu(1)])
    Node.objects.filter(name="gpu-1").update(status=Node.Status.CORDONED)
    job = submit(user, **CUDA_ONE)
    assert job.warnings == []  # registered: it may come back
    services.schedule_tick()
    job.refresh_from_db()
    assert job.status_reason == "no READY node has cuda devices; waiting for nodes"


def test_api_submit_warns_and_the_job_shows_why_it_waits(user, cpu_nodes, client_for):
    api = client_for(user)
    r = api.post("/api/v1/jobs/", {"name": "gpu-demo", **CUDA_ONE}, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["status"] == "QUEUED"
    assert body["warnings"] == ["no registered node has cuda devices: the job waits until such a node joins"]
    services.schedule_tick()
    got = api.get(f"/api/v1/jobs/{body['id']}/").json()
    assert got["status_reason"] == "no READY node has cuda devices; waiting for nodes"
    assert "warnings" not in got  # the submit's answer only
    page = Client()
    page.force_login(user)
    assert "no READY node has cuda devices" in page.get(f"/jobs/{body['id']}/").content.decode()
    assert "no READY node has cuda devices" in page.get("/").content.decode()  # the queue's "why waiting"


def test_form_submit_shows_the_warning(user, cpu_nodes):
    page = Client()
    page.force_login(user)
    r = page.post("/jobs/new/", {"spec": json.dumps({"name": "gpu-demo", **CUDA_ONE})}, follow=True)
    assert r.status_code == 200
    job = Job.objects.get(name="gpu-demo")
    assert (f"Job {job.pk}: no registered node has cuda devices: the job waits until such a node joins."
            in r.content.decode())


def test_plan_shows_device_and_labels(user, cpu_nodes):
    job = submit(user, resources={"nodes": 1, "procs_per_node": 1, "labels": {"gpu": "a100", "rack": "r2"}},
                 parallel={"dp": 1})
    assert job.plan["placement"] == {"device": "cpu", "gpu_memory_gb": None, "labels": {"gpu": "a100", "rack": "r2"},
                                     "text": "1 node(s) x 1 cpu slot(s), on nodes labelled gpu=a100, rack=r2"}
    page = Client()
    page.force_login(user)
    assert "on nodes labelled gpu=a100, rack=r2" in page.get(f"/jobs/{job.pk}/").content.decode()


def test_cuda_job_that_finds_no_cuda_is_retried_on_another_gpu_node(user, cpu_nodes, sent):
    beat("gpu-1", "10.0.0.8", 1, [gpu(0)])
    beat("gpu-2", "10.0.0.9", 1, [gpu(0)])
    job = submit(user, **CUDA_ONE)
    services.schedule_tick()
    first = job.attempts.get()
    node = first.allocations.get().node.name
    message = "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'"
    services.attempt_node_exit(first.pk, node_name=node, result={
        "node": node, "exit_code": 1, "stopped": False, "failures": [
            {"rank": 0, "timestamp": 1.0, "message": message, "traceback": f"Traceback ...\n{message}"}]})
    job.refresh_from_db()
    first.refresh_from_db()
    assert first.outcome == "failed:placement" and first.failure["exclude"] == [node]
    assert job.status == "QUEUED" and job.avoid_nodes == [node] and job.restarts == 1
    services.schedule_tick()
    second = job.attempts.get(number=2)
    assert second.allocations.get().node.name != node
    assert Node.objects.get(name=node).status == "READY"
