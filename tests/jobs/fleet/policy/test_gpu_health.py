"""jobs/fleet/policy/gpu_health.py: which GPU faults an agent reported count against its node."""
from __future__ import annotations

from jobs.fleet.policy.gpu_health import GpuFault, gpu_faults, quarantine_due


def gpu(index, *, xids=(), ecc=0, uuid="GPU-x"):
    return {"kind": "cuda", "index": index, "nvml_index": index + 4, "uuid": uuid, "ecc_uncorrected": ecc,
            "xid_events": [{"xid": x, "at": at} for x, at in xids]}


def test_hardware_xids_in_the_window_and_standing_ecc_errors_count():
    devices = [gpu(0, xids=[(79, 100.0), (48, 50.0)]), gpu(1, ecc=3, uuid="GPU-y"), {"kind": "cpu", "index": 0}]
    assert gpu_faults(devices, since=60.0) == [GpuFault("GPU 4 (GPU-x)", "Xid 79", 100.0),
                                               GpuFault("GPU 5 (GPU-y)", "3 uncorrected ECC errors", None)]


def test_xids_user_code_or_a_killed_rank_cause_do_not_count():
    # 13/31/43: the app's kernel faulted; 45: a CUDA process was killed (every stopped rank)
    assert gpu_faults([gpu(0, xids=[(13, 1.0), (31, 1.0), (43, 1.0), (45, 1.0)])], since=0.0) == []


def test_old_heartbeats_and_agents_without_nvml_fields_have_no_faults():
    old = [{"kind": "cuda", "index": 0, "name": "A100", "memory_bytes": 1, "utilization": None}]
    assert gpu_faults(old, since=0.0) == [] and gpu_faults([], since=0.0) == [] and gpu_faults(None, since=0.0) == []
    assert gpu_faults([gpu(0, ecc=None), {"kind": "cuda", "xid_events": [{"xid": "?"}]}], since=0.0) == []


def test_faults_add_to_the_attempt_failures_toward_the_threshold():
    one = [GpuFault("GPU 0", "Xid 79", 1.0)]
    assert not quarantine_due(0, one, 2) and quarantine_due(1, one, 2) and quarantine_due(0, one * 2, 2)
