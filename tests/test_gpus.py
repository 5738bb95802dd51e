"""The agent's GPUs through NVML (workers/gpus.py), with pynvml faked at the library boundary:
discovery, CUDA_VISIBLE_DEVICES mapping (indices and UUIDs), --slots refusal, Xid events, NVML
absent or failing -- and that the agent never touches torch.cuda (no CUDA context per GPU)."""
from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests import fake_pynvml
from workers import agent, gpus, launch_spec

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake_pynvml.node(4).install(monkeypatch)


def test_discovery_reports_each_gpu_with_the_old_fields_and_nvml_figures(nvml):
    nvml.gpus[2].ecc, nvml.gpus[3].util, nvml.gpus[3].temp = 2, None, None  # figures a GPU may not offer
    devices = agent.discover_devices("cuda", 4, agent.start_gpu_monitor("cuda", 4))
    assert [d["index"] for d in devices] == [0, 1, 2, 3] and [d["nvml_index"] for d in devices] == [0, 1, 2, 3]
    d0 = devices[0]
    assert {k: d0[k] for k in ("kind", "name", "memory_bytes", "memory_used_bytes", "utilization")} == {
        "kind": "cuda", "name": "NVIDIA H200", "memory_bytes": 141 * 2**30, "memory_used_bytes": 2**30,
        "utilization": 37}
    assert d0["uuid"] == nvml.gpus[0].uuid and d0["temperature_c"] == 41 and d0["ecc_uncorrected"] == 0
    assert d0["xid_supported"] is True and d0["xid_errors"] == 0 and d0["xid_events"] == []
    assert devices[2]["ecc_uncorrected"] == 2
    assert devices[3]["utilization"] is None and devices[3]["temperature_c"] is None
    json.dumps(devices)  # goes into the heartbeat as it is


@pytest.mark.parametrize("visible, nvml_indices", [
    ("2,3", [2, 3]),
    ("3,1", [3, 1]),
    (f"{fake_pynvml.node(4).gpus[3].uuid},{fake_pynvml.node(4).gpus[0].uuid}", [3, 0]),
    ("1,bogus,2", [1]),  # CUDA stops at the first invalid entry
    ("0,9,1", [0]),  # ... and at a GPU that is not there
    ("GPU-0,GPU-nothere", []),
    ("", []),
])
def test_slots_are_the_agents_own_visible_gpus(nvml, monkeypatch, visible, nvml_indices):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monitor = gpus.GpuMonitor(visible).start()
    devices = agent.discover_devices("cuda", 1, monitor)
    assert [d["nvml_index"] for d in devices] == nvml_indices
    assert [d["index"] for d in devices] == list(range(len(nvml_indices)))


def test_ranks_get_the_agents_visible_entries_in_pci_bus_order(tmp_path, monkeypatch):
    from tests.test_launcher import request

    req = dataclasses.replace(request(tmp_path, "node-a", nproc=2), slots=(0, 1), device="cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb,GPU-cccc")
    env = launch_spec.build_env(dataclasses.replace(req, slots=(1, 2)))
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb,GPU-cccc" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    # The job's own env cannot move the slots: the agent's variable decides.
    env = launch_spec.build_env(dataclasses.replace(req, slots=(0, 3), env={"CUDA_VISIBLE_DEVICES": "0"}))
    assert env["CUDA_VISIBLE_DEVICES"] == "4,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert launch_spec.build_env(req)["CUDA_VISIBLE_DEVICES"] == "0,1"
    with pytest.raises(ValueError, match="beyond the 2 GPUs"):
        gpus.slot_devices((0, 2), "4,5")
    assert "CUDA_DEVICE_ORDER" not in launch_spec.build_env(dataclasses.replace(req, device="cpu"), base={})


def test_more_slots_than_visible_gpus_is_refused_at_agent_start(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(SystemExit, match=r"--slots 3 but this agent sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1\)"):
        agent.start_gpu_monitor("cuda", 3)
    with pytest.raises(SystemExit, match=r"--slots 3 but this agent sees 2 GPU"):
        agent.main(["--name", "n", "--address", "127.0.0.1", "--slots", "3", "--device", "cuda"])
    assert agent.start_gpu_monitor("cuda", 2).count == 2
    assert agent.start_gpu_monitor("cpu", 64) is None  # a cpu agent does not look at GPUs


def test_xid_events_are_polled_without_blocking_and_reported_per_gpu(nvml):
    nvml.gpus[1].xid = False  # this GPU does not offer Xid events
    monitor = agent.start_gpu_monitor("cuda", 4)
    assert nvml.registered == {0, 2, 3}
    nvml.pending += [(2, 79), (2, 48), (1, 13)]
    devices = agent.discover_devices("cuda", 4, monitor)
    assert [e["xid"] for e in devices[2]["xid_events"]] == [79, 48] and devices[2]["xid_errors"] == 2
    assert devices[1]["xid_supported"] is False and devices[1]["xid_errors"] == 0
    assert devices[0]["xid_events"] == []
    nvml.pending.append((2, 79))
    assert agent.discover_devices("cuda", 4, monitor)[2]["xid_errors"] == 3  # cumulative since the agent started


@pytest.mark.parametrize("breakage", ["absent", "no driver"])
def test_a_cuda_agent_without_nvml_says_so_and_reports_no_gpus(monkeypatch, caplog, breakage):
    if breakage == "absent":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    else:
        fake = fake_pynvml.node(2)
        fake.init_error = fake_pynvml.NVML_ERROR_DRIVER_NOT_LOADED
        fake.install(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="trainyard.agent"):
        monitor = agent.start_gpu_monitor("cuda", 2)
    assert monitor is None and agent.discover_devices("cuda", 2, monitor) == []
    text = caplog.text
    assert "--device cuda but" in text and "reports no GPUs" in text
    assert ("nvidia-ml-py" in text) if breakage == "absent" else ("NVIDIA driver" in text)


def test_nvml_failing_mid_run_reports_no_gpus_instead_of_breaking_the_heartbeat(nvml, caplog):
    monitor = agent.start_gpu_monitor("cuda", 4)

    def fell_off_the_bus(handle):
        raise fake_pynvml.NVMLError(15)  # NVML_ERROR_GPU_IS_LOST

    sys.modules["pynvml"].nvmlDeviceGetMemoryInfo = fell_off_the_bus
    monitor.nvml = sys.modules["pynvml"]
    with caplog.at_level(logging.ERROR, logger="trainyard.agent.gpus"):
        assert agent.discover_devices("cuda", 4, monitor) == []
    assert "NVML query failed" in caplog.text


def test_the_heartbeat_never_calls_torch_cuda(nvml, monkeypatch, tmp_path):
    """In process: torch.cuda says there are 4 GPUs (a GPU node) and records any call that would
    create a context; today's agent called get_device_properties/mem_get_info per GPU per heartbeat."""
    torch = pytest.importorskip("torch")
    calls: list[str] = []

    def recording(name):
        def fn(*a, **k):
            calls.append(name)
            raise RuntimeError(f"the agent called torch.cuda.{name}")
        return fn

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("get_device_properties", "mem_get_info", "utilization", "init", "_lazy_init", "set_device",
                 "current_device", "memory_reserved", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, recording(name))
    a = agent.Agent("n", "127.0.0.1", 4, {}, "cuda", tmp_path, agent.start_gpu_monitor("cuda", 4))
    beat = a.heartbeat_payload()
    assert calls == [] and not torch.cuda.is_initialized()
    assert [d["uuid"] for d in beat.devices] == [g.uuid for g in nvml.gpus]


CHILD = r"""
import json, sys
import torch
from tests import fake_pynvml
calls = []
def recording(name):
    def fn(*a, **k):
        calls.append(name)
        raise RuntimeError(name)
    return fn
torch.cuda.device_count = lambda: 2
torch.cuda.is_available = lambda: True
for name in ("get_device_properties", "mem_get_info", "utilization", "init", "_lazy_init", "set_device",
             "current_device"):
    setattr(torch.cuda, name, recording(name))
sys.modules["pynvml"] = fake_pynvml.node(2).module()
from workers import agent
a = agent.Agent("n", "127.0.0.1", 2, {}, "cuda", __import__("pathlib").Path(sys.argv[1]))
start = getattr(agent, "start_gpu_monitor", None)  # absent before NVML: the agent asked torch.cuda
a.gpus = start("cuda", 2) if start else None
beats = [a.heartbeat_payload() for _ in range(3)]
print(json.dumps({"calls": calls, "initialized": torch.cuda.is_initialized(),
                  "devices": len(beats[-1].devices), "torch_cuda_loaded": "torch.cuda" in sys.modules}))
"""


@pytest.mark.procs
def test_a_fresh_agent_process_never_initialises_cuda(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"calls": [], "initialized": False, "devices": 2, "torch_cuda_loaded": True}


def test_a_sandbox_gets_only_its_slots_gpu_device_nodes_named_by_uuid(nvml, tmp_path, monkeypatch):
    """Issue 21 s1: a sandbox binds /dev/nvidia<minor> of its slots' GPUs alone, so CUDA inside
    renumbers them from 0; the ranks name them by UUID, which stays right."""
    from tests.test_launcher import request
    from workers import sandbox

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,2")
    monitor = gpus.GpuMonitor("3,1,2").start()
    uuids, nodes = monitor.slot_nodes((1, 2))
    fake = fake_pynvml.node(4)
    assert uuids == [fake.gpus[1].uuid, fake.gpus[2].uuid] and nodes == ["/dev/nvidia11", "/dev/nvidia12"]
    req = dataclasses.replace(request(tmp_path, "node-a", nproc=2), slots=(1, 2), device="cuda", gpu_ids=tuple(uuids))
    assert launch_spec.build_env(req)["CUDA_VISIBLE_DEVICES"] == ",".join(uuids)
    m = sandbox.Mounts(run_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "c"), data_root=str(tmp_path / "d"),
                       devices=tuple(nodes), cuda=True)
    args = sandbox.bwrap_args(sandbox.SandboxConfig(), m, uid=1, gid=1, env={}, argv=["x"], cwd="/")
    devs = [args[i + 1] for i, a in enumerate(args) if a == "--dev-bind-try"]
    assert [d for d in devs if d[len("/dev/nvidia"):].isdigit()] == nodes  # no other GPU's node
    assert "/dev/nvidiactl" in devs and "/dev/nvidia-uvm" in devs
    with pytest.raises(gpus.NvmlUnavailable):
        monitor.slot_nodes((5,))
