"""GPU checks for the ranks' NCCL set-up (issue 14, finding 5): workers/launch_spec.py builds the
rank environment (NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME from the node's address, the flight
recorder), trainyard/sdk/run.py passes the control plane's collective timeout.

- nccl_bootstrap_interface (1 GPU): one rank initialises NCCL (eager, device_id bound) and
  all-reduces, under the environment the launcher builds for a node advertising 127.0.0.1, with
  NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=INIT,NET. Reported: the interface we set, the ones
  NCCL's "Bootstrap : Using" and "NET/Socket : Using" lines name, and (for contrast) what NCCL
  picks with neither variable set. ok: NCCL's bootstrap (and its socket transport, when it logs
  one) used the interface we set. Two ranks on one GPU are not possible (NCCL refuses two ranks
  per device), so this is a 1-rank init.
- nccl_timeout_flight_recorder (2 GPUs): torchrun with 2 ranks over NCCL, the launcher's
  environment and a 10 s collective timeout through the SDK's init_process_group; rank 1 never
  joins rank 0's all-reduce. ok: rank 0's watchdog times the collective out well before torch's
  10-minute default, and the flight recorder writes its dump to <run_dir>/logs/nccl_trace_rank_<r>
  (TORCH_FR_DUMP_TEMP_FILE), whose entries name the all-reduce.

Run as a script with `--worker ...` it is the ranks' code of these checks.
"""
from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

COLLECTIVE_TIMEOUT_S = 10
# "NCCL INFO Bootstrap : Using lo:127.0.0.1<0>", "NET/Socket : Using [0]lo:127.0.0.1<0>" (the
# spacing around ':' differs between NCCL versions)
_USING = re.compile(r"(Bootstrap|NET/Socket)\s*:\s*Using\s+(.*)$")
_IFACE = re.compile(r"(?:\[\d+\])?([A-Za-z0-9_.\-]+):[^\s<]+<\d+>")


def _launch_env(nproc: int, run_dir: str) -> dict[str, str]:
    from workers.launch_spec import LaunchRequest, build_env

    req = LaunchRequest(job_id=0, attempt_id=0, node="gpu-check", node_rank=0, nnodes=1, nproc=nproc,
                        slots=tuple(range(nproc)), device="cuda", rdzv_host="127.0.0.1", rdzv_port=29400,
                        local_addr="127.0.0.1", config={}, run_dir=run_dir)
    base = {k: v for k, v in os.environ.items()
            if k not in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES")}
    for name in ("home", "tmp", "logs"):  # what an agent makes for every attempt (HOME, TMPDIR, the dumps)
        os.makedirs(os.path.join(run_dir, name), exist_ok=True)
    # The ranks' environment is an allow-list (issue 21); a GPU host's driver libraries may need
    # LD_LIBRARY_PATH, which an operator passes on with TRAINYARD_SANDBOX_PASS_ENV.
    return build_env(req, base, passes=lambda name: name == "LD_LIBRARY_PATH")


def _free_port() -> int:
    from workers.launch_spec import pick_free_port
    return pick_free_port("127.0.0.1")


def parse_nccl_interfaces(text: str) -> dict[str, list[str]]:
    """{"Bootstrap": [ifnames], "NET/Socket": [ifnames]} from NCCL_DEBUG=INFO output."""
    found: dict[str, list[str]] = {"Bootstrap": [], "NET/Socket": []}
    for line in text.splitlines():
        m = _USING.search(line)
        if m:
            found[m.group(1)] += [i for i in _IFACE.findall(m.group(2)) if i not in found[m.group(1)]]
    return found


def _one_rank_init(env: dict[str, str], timeout_s: float = 90) -> tuple[int, str]:
    env = dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "init"],
                          env=env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, proc.stdout + proc.stderr


def check_bootstrap_interface() -> dict:
    with tempfile.TemporaryDirectory(prefix="nccl-iface-") as run_dir:
        env = _launch_env(1, run_dir)
        ours = env["NCCL_SOCKET_IFNAME"]
        rc, out = _one_rank_init(env)
        picked = parse_nccl_interfaces(out)
        bare = {k: v for k, v in env.items() if k not in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
        rc_default, out_default = _one_rank_init(bare)
    boot, sock = picked["Bootstrap"], picked["NET/Socket"]
    ok = rc == 0 and boot == [ours] and all(i == ours for i in sock)
    return {"ok": ok, "set_ifname": ours, "gloo_ifname": env["GLOO_SOCKET_IFNAME"],
            "bootstrap_ifnames": boot, "net_socket_ifnames": sock, "rc": rc,
            "default_pick": parse_nccl_interfaces(out_default), "rc_default": rc_default,
            "log_tail": [] if ok else out.splitlines()[-25:]}


def check_timeout_flight_recorder() -> dict:
    with tempfile.TemporaryDirectory(prefix="nccl-fr-") as run_dir:
        env = dict(_launch_env(2, run_dir), CHECK_TIMEOUT_S=str(COLLECTIVE_TIMEOUT_S))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
               "--max-restarts", "0", str(Path(__file__).resolve()), "--worker", "timeout"]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=100)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        elapsed = time.monotonic() - started
        dumps = {p.name: _summarise_dump(p) for p in sorted((Path(run_dir) / "logs").glob("nccl_trace_rank_*"))}
    timed_out = bool(re.search(r"Watchdog caught collective operation timeout|timed out|Timeout", out))
    rank0 = dumps.get("nccl_trace_rank_0", {})
    ok = (proc.returncode != 0 and timed_out and elapsed < 90
          and any("all_reduce" in name for name in rank0.get("ops", [])))
    return {"ok": ok, "collective_timeout_s": COLLECTIVE_TIMEOUT_S, "elapsed_s": round(elapsed, 1),
            "torchrun_rc": proc.returncode, "watchdog_timeout_seen": timed_out, "dumps": dumps,
            "log_tail": out.splitlines()[-30:]}


def _summarise_dump(path: Path) -> dict:
    """The flight recorder's dump (a pickle torch wrote in this check): entry count, operations."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            data = pickle.load(f)  # our own ranks' file, written seconds ago
        entries = data.get("entries", []) if isinstance(data, dict) else []
        return {"bytes": size, "entries": len(entries),
                "ops": [str(e.get("profiling_name")) for e in entries[-5:]],
                "states": [str(e.get("state")) for e in entries[-5:]]}
    except Exception as exc:  # report what the file is, not a crash of the check
        return {"bytes": size, "error": repr(exc)}


# ---- the ranks' code (run as `nccl_setup.py --worker init|timeout`) ------------------------------

def _worker(kind: str) -> None:
    import torch
    import torch.distributed as dist

    from trainyard.sdk.groups import apply_collective_timeout
    from trainyard.sdk.run import DistEnv, init_process_group

    env = DistEnv.from_environ()
    device = torch.device("cuda", env.local_rank)
    torch.cuda.set_device(device)
    init_process_group(env, device, float(os.environ.get("CHECK_TIMEOUT_S", "60")))
    apply_collective_timeout()  # as Run.log does after the first step
    t = torch.ones(1024, device=device)
    if kind == "init":
        dist.all_reduce(t)
        torch.cuda.synchronize()
        dist.destroy_process_group()
        return
    if env.rank == 1:
        time.sleep(80)  # never joins: rank 0's watchdog must time the all-reduce out
        return
    dist.all_reduce(t)
    torch.cuda.synchronize()  # blocks here until the watchdog aborts the communicator
    time.sleep(80)


CHECKS = [
    ("nccl_bootstrap_interface", 1, check_bootstrap_interface),
    ("nccl_timeout_flight_recorder", 2, check_timeout_flight_recorder),
]

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        import json
        for name, _, fn in CHECKS:
            print(json.dumps({"check": name, **fn()}))
