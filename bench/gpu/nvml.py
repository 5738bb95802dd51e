"""GPU check for issue 14 finding 4: the node agent discovers and monitors its GPUs through NVML
and holds no CUDA context.

The agent's discovery (workers.agent.start_gpu_monitor + discover_devices, three heartbeats'
worth) runs in a child process that then stays alive; while it does, `nvidia-smi
--query-compute-apps=pid` must not list it and the number of compute apps must not grow. A
positive control child that calls torch.cuda.mem_get_info (what the agent did before) must be
seen by the same query, so a "not listed" is not an artefact of PID namespaces. The discovered
UUIDs must be nvidia-smi's, and CUDA_VISIBLE_DEVICES=<a GPU's UUID> must map slot 0 to that GPU.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

AGENT_CHILD = r"""
import json, os, sys
from workers import agent
gpus = agent.start_gpu_monitor("cuda", 1)
devices = [agent.discover_devices("cuda", 1, gpus) for _ in range(3)][-1]
print(json.dumps({"pid": os.getpid(), "devices": devices,
                  "torch_cuda_initialized": sys.modules["torch"].cuda.is_initialized()
                  if "torch" in sys.modules else None}), flush=True)
sys.stdin.read()  # stay alive until the check closes stdin
"""

CONTROL_CHILD = r"""
import json, os, sys
import torch
torch.cuda.mem_get_info(0)  # what the agent did before: creates a context on GPU 0
print(json.dumps({"pid": os.getpid()}), flush=True)
sys.stdin.read()
"""


def _smi(*query: str) -> list[str]:
    out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=30, check=True)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def _compute_pids() -> list[int]:
    return [int(x) for x in _smi("--query-compute-apps=pid") if x.isdigit()]


def _spawn(code: str, env: dict | None = None) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # the child prints one line when it is ready
    if not line:
        proc.kill()
        raise RuntimeError(f"child exited early: {proc.stderr.read()[-2000:]}")
    return proc, json.loads(line)


def _end(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=20)
    except Exception:
        proc.kill()
        proc.wait(timeout=10)


def _held(code: str, env: dict | None = None) -> tuple[dict, list[int], float]:
    """Start a child, and while it is alive: its report, the compute-app pids, and GPU 0's used MiB."""
    proc, report = _spawn(code, env)
    try:
        time.sleep(1.0)  # let a context (if any) show up
        return report, _compute_pids(), float(_smi("--query-gpu=memory.used")[0])
    finally:
        _end(proc)


def agent_holds_no_cuda_context() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {"ok": False, "error": "nvidia-smi not found"}
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    smi_uuids = [row.split(",")[1].strip() for row in _smi("--query-gpu=index,uuid")]
    baseline_pids, baseline_mib = _compute_pids(), float(_smi("--query-gpu=memory.used")[0])
    agent, agent_pids, agent_mib = _held(AGENT_CHILD, env)
    control, control_pids, control_mib = _held(CONTROL_CHILD, env)
    one = dict(env, CUDA_VISIBLE_DEVICES=smi_uuids[-1])
    mapped, _, _ = _held(AGENT_CHILD, one)
    devices = agent["devices"]
    control_seen = control["pid"] in control_pids or len(control_pids) > len(baseline_pids)
    result = {
        "agent_pid": agent["pid"], "agent_pid_listed": agent["pid"] in agent_pids,
        "compute_apps": {"baseline": len(baseline_pids), "agent_alive": len(agent_pids),
                         "control_alive": len(control_pids)},
        "gpu0_used_mib": {"baseline": baseline_mib, "agent_alive": agent_mib, "control_alive": control_mib},
        "control_pid_listed": control["pid"] in control_pids, "control_seen": control_seen,
        "torch_cuda_initialized_in_agent": agent["torch_cuda_initialized"],
        "smi_uuids": smi_uuids, "discovered": [
            {k: d.get(k) for k in ("index", "nvml_index", "uuid", "name", "memory_bytes", "memory_used_bytes",
                                   "utilization", "temperature_c", "ecc_uncorrected", "xid_supported",
                                   "xid_errors")} for d in devices],
        "uuid_mapping": [(d.get("index"), d.get("nvml_index"), d.get("uuid")) for d in mapped["devices"]],
    }
    result["ok"] = bool(
        not result["agent_pid_listed"] and len(agent_pids) == len(baseline_pids) and control_seen
        and [d.get("uuid") for d in devices] == smi_uuids
        and [u for _, _, u in result["uuid_mapping"]] == [smi_uuids[-1]]
        and result["uuid_mapping"][0][0] == 0 and result["uuid_mapping"][0][1] == len(smi_uuids) - 1)
    return result


CHECKS = [("nvml_agent_no_cuda_context", 1, agent_holds_no_cuda_context)]


if __name__ == "__main__":
    print(json.dumps(agent_holds_no_cuda_context()))
