"""The ephemeral agent on a Slurm-allocated node (issue 27): the Slurm job's `srun` runs this once per
node; it takes its seat (the SLURM_NODEID-th of the allocation's seats), its credential and Redis
user from the 0600 file the control plane wrote for this allocation only, finds the address the
node reaches the control plane from, and becomes an ordinary node agent (workers.agent) for the
one attempt: it registers, heartbeats, launches torchrun in the job sandbox, reports, and exits when
its attempt has ended here (workers.agent's once mode), so the Slurm job ends with it.

    python -m workers.slurm_agent <state_dir>/trainyard-<job>-a<attempt>/agents.json

Nothing secret travels in argv or the batch script: the file is read here, the credential goes to a
0600 file in the agent's run directory, the Redis URL to the agent's environment."""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

from trainyard import keys
from trainyard.private import private_dir, write_private

SLURM_JOB_VAR = "TRAINYARD_SLURM_JOB_ID"  # workers.agent puts it in its heartbeats (Heartbeat.allocation)
ONCE_VAR = "TRAINYARD_AGENT_ONCE"         # workers.agent: exit once its attempt ended here


def route_address(redis_url: str) -> str:
    """The local address this node reaches Redis (the control plane) from: the address of the route
    to it, which is the interface its peers on the same network reach it on. No packet is sent."""
    parts = urlsplit(redis_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def read_allocation(path: str) -> dict:
    """The allocation's file, refused when others may read it or it is not a regular file we own."""
    st = os.lstat(path)
    if not os.path.isfile(path) or os.path.islink(path):
        raise SystemExit(f"{path}: not a regular file")
    if st.st_mode & 0o077 or st.st_uid != os.geteuid():
        raise SystemExit(f"{path}: must be 0600 and ours (mode {oct(st.st_mode & 0o777)}, uid {st.st_uid})")
    return json.loads(Path(path).read_text())


def agent_argv(data: dict, node_index: int, *, address: str, credential_file: str, run_dir: str) -> list[str]:
    seat = data["seats"][node_index]
    return [sys.executable, "-m", "workers.agent", "--name", seat["name"], "--address", address,
            "--slots", str(int(data["slots"])), "--device", data.get("device", "cpu"), "--run-dir", run_dir,
            "--credential-file", credential_file, "--labels", f"pool={data['pool']}"]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m workers.slurm_agent <allocation file>")
    data = read_allocation(args[0])
    index = int(os.environ.get("SLURM_NODEID") or os.environ.get("SLURM_PROCID") or 0)
    if not 0 <= index < len(data["seats"]):
        raise SystemExit(f"SLURM_NODEID {index}: the allocation has {len(data['seats'])} seat(s)")
    slurm_job = os.environ.get("SLURM_JOB_ID", "")
    seat = data["seats"][index]
    run_root = keys.run_root()
    private_dir(run_root)
    credential_file = run_root / f"{seat['name']}.credential"
    credential_file.unlink(missing_ok=True)
    write_private(credential_file, seat["credential"] + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_NODE_")}
    env.update({"REDIS_URL": seat["redis_url"], SLURM_JOB_VAR: slurm_job, ONCE_VAR: str(int(data["attempt"]))})
    address = route_address(seat["redis_url"])
    os.execve(sys.executable, agent_argv(data, index, address=address, credential_file=str(credential_file),
                                         run_dir=str(run_root)), env)


if __name__ == "__main__":
    main()
