"""What torchrun is asked to run: the launch request, its validation, argv and environment.

Pure construction (no processes): `workers.launcher` spawns and supervises what this builds.

Two kinds of launch share one argv shape, `<python> -m torch.distributed.run <torchrun args> ...`:
- the built-in trainer: `... -m workers.runtime --config <run_dir>/config.json` (the default);
- user code (a JobSpec `entrypoint`, `user_code=True`): `... <code_dir>/<script> <args>` or
  `... -m <module> <args>`, run in `code_dir` (the extracted bundle) with `code_dir` and the
  directory holding the `trainyard` package first on PYTHONPATH, under the job's `python`.
Every rank of either kind gets TRAINYARD_RUN_CONFIG=<run_dir>/config.json: what the SDK
(`trainyard.init()`) reads.
"""
from __future__ import annotations

import ipaddress
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import psutil

from .gpus import slot_devices

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
MONITOR_INTERVAL_S = 0.1  # torchrun's own worker check
# After one local rank fails, torchrun SIGTERMs its local peers and SIGKILLs them after this;
# its 30 s default would hold the node's slots for half a minute after every failure.
SHUTDOWN_TIMEOUT_S = 5
# "0": every rank of the built-in runtime starts as a fresh interpreter (benchmarks' baseline).
WARM_VAR = "TRAINYARD_WARM_RANKS"
_MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_HOST_RE = re.compile(r"^[A-Za-z0-9_.:\[\]]([A-Za-z0-9_.:\[\]-]*)$")  # never starts with "-"


@dataclass(frozen=True)
class LaunchRequest:
    job_id: int
    attempt_id: int
    node: str  # this node's name, e.g. "node-a"
    node_rank: int  # 0 hosts the rendezvous store
    nnodes: int
    nproc: int  # processes on this node
    slots: tuple[int, ...]  # slot indices on this node (len == nproc)
    device: str  # "cpu" | "cuda"
    rdzv_host: str  # advertised address of the node_rank-0 node
    rdzv_port: int
    local_addr: str  # this node's advertised address
    config: dict  # written to <run_dir>/config.json, passed as --config <path>
    run_dir: str
    module: str = "workers.runtime"  # user code: the entrypoint's module (when no script)
    cores_per_slot: int = 1  # OMP_NUM_THREADS
    env: dict = field(default_factory=dict)  # on top of the agent's environment (user code: the spec's env)
    user_code: bool = False  # a JobSpec entrypoint rather than the built-in runtime
    script: str = ""  # user code: absolute path of the entrypoint script (under code_dir with a bundle)
    args: tuple[str, ...] = ()  # user code: the entrypoint's arguments, passed as they are
    python: str = ""  # absolute path of the interpreter for torchrun and the ranks; "" = the agent's own
    code_dir: str = ""  # the extracted bundle (read-only): cwd and first on PYTHONPATH; "" = none
    gpu_ids: tuple[str, ...] = ()  # cuda in a sandbox: the slots' GPU UUIDs (CUDA_VISIBLE_DEVICES)
    warm: bool = True  # the built-in runtime: ranks forked from a launcher that imported it (workers.warmrun)

    @property
    def interpreter(self) -> str:
        return self.python or sys.executable

    @property
    def config_path(self) -> str:
        """The launch config the agent writes and every rank reads (TRAINYARD_RUN_CONFIG)."""
        return os.path.join(os.path.abspath(self.run_dir), "config.json")

    @property
    def cwd(self) -> str:
        """User code runs in its bundle, anything else in its home (<run_dir>/home)."""
        return self.code_dir or os.path.join(os.path.abspath(self.run_dir), "home")


def warm_ranks(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this agent forks the built-in runtime's ranks from a warm launcher (WARM_VAR)."""
    return (os.environ if environ is None else environ).get(WARM_VAR, "1") != "0"


def validate(req: LaunchRequest) -> None:
    """Reject requests that would build a wrong or option-injecting torchrun argv."""
    problems = []
    if req.nproc < 1 or len(req.slots) != req.nproc:
        problems.append(f"nproc={req.nproc} needs exactly that many slots, got {req.slots}")
    if not 0 <= req.node_rank < req.nnodes:
        problems.append(f"node_rank {req.node_rank} outside 0..{req.nnodes - 1}")
    if req.device not in ("cpu", "cuda"):
        problems.append(f"device {req.device!r} is not cpu|cuda")
    if not 0 < req.rdzv_port < 65536:
        problems.append(f"rdzv_port {req.rdzv_port} out of range")
    if not _MODULE_RE.match(req.module):
        problems.append(f"module {req.module!r} is not a dotted module name")
    for name in ("rdzv_host", "local_addr"):
        if not _HOST_RE.match(getattr(req, name)):
            problems.append(f"{name} {getattr(req, name)!r} is not a host name or address")
    if req.cores_per_slot < 1:
        problems.append("cores_per_slot must be >= 1")
    problems += _user_code_problems(req)
    if problems:
        raise ValueError("; ".join(problems))


def _user_code_problems(req: LaunchRequest) -> list[str]:
    problems = []
    for name in ("python", "code_dir", "script"):
        value = getattr(req, name)
        if value and not os.path.isabs(value):  # an absolute path never starts with "-"
            problems.append(f"{name} {value!r} is not an absolute path")
    if not req.user_code:
        if req.script or req.args or req.code_dir:
            problems.append("script, args and code_dir are for user code (user_code=True)")
        return problems
    if req.script and req.code_dir:
        inside = os.path.commonpath([os.path.normpath(req.script), os.path.normpath(req.code_dir)])
        if inside != os.path.normpath(req.code_dir):
            problems.append(f"script {req.script!r} is outside the code directory {req.code_dir!r}")
    if not all(isinstance(a, str) for a in req.args):
        problems.append("args must be strings")
    return problems


def build_argv(req: LaunchRequest, config_path: str, log_dir: str) -> list[str]:
    # No --node-rank: torch 2.13 ignores it for c10d (and warns); c10d orders nodes by
    # (local_addr, pid), which is why the runtime reports its own global rank.
    if not req.user_code:
        entry = ["-m", req.module, "--config", config_path]
    elif req.script:  # torchrun runs it with `<python> -u <script>`; what follows is the script's
        entry = [req.script, *req.args]
    else:
        entry = ["-m", req.module, *req.args]
    # The built-in runtime's ranks are forks of a launcher that imported it already (workers/warmrun.py).
    warm = req.warm and not req.user_code and req.module == "workers.runtime"
    launcher = "workers.warmrun" if warm else "torch.distributed.run"
    return [
        req.interpreter, "-m", launcher,
        "--nnodes", str(req.nnodes),
        "--nproc-per-node", str(req.nproc),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{req.rdzv_host}:{req.rdzv_port}",
        "--rdzv-id", f"attempt-{req.attempt_id}",
        # Explicit: with loopback addresses torchrun's hostname heuristic makes every node
        # on this machine think it hosts the store.
        "--rdzv-conf", f"is_host={1 if req.node_rank == 0 else 0}",
        "--local-addr", req.local_addr,
        "--max-restarts", "0",  # restarts are the control plane's decision, on fresh nodes
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        "--log-dir", log_dir,
        "--redirects", "3",
        "--monitor-interval", str(MONITOR_INTERVAL_S),
        *entry,
    ]


class InterfaceError(ValueError):
    """No network interface of this node holds the address it advertises."""


def interface_for(addr: str) -> str:
    """The interface that carries `addr` (an IP address, or a host name resolved here).

    gloo and NCCL pick an interface by their own heuristics (the hostname's address, the first
    non-loopback one); a wrong pick leaves init_process_group connecting to nowhere, outside
    NCCL's watchdog. Binding both to the interface that holds the node's advertised address
    makes the transport use the path the rendezvous already proved."""
    try:
        wanted = {str(ipaddress.ip_address(addr.strip("[]")))}
    except ValueError:  # a host name: every address it resolves to here
        try:
            wanted = {str(ipaddress.ip_address(info[4][0].split("%")[0]))
                      for info in socket.getaddrinfo(addr, None)}
        except (OSError, ValueError) as exc:
            raise InterfaceError(f"cannot resolve local_addr {addr!r}: {exc}") from None
    ifaces = sorted(psutil.net_if_addrs().items())
    for name, addrs in ifaces:
        if any(_ip(a) in wanted for a in addrs):
            return name
    # Linux routes all of 127.0.0.0/8 to lo although lo lists only 127.0.0.1/8: a loopback
    # address is on the interface whose loopback network holds it (two agents on one machine).
    for name, addrs in ifaces:
        nets = [_loopback_net(a) for a in addrs]
        if any(net and ipaddress.ip_address(w) in net for net in nets for w in wanted):
            return name
    raise InterfaceError(
        f"no network interface of this node has the address {addr!r} it advertises "
        f"(local_addr); gloo and NCCL would bind elsewhere and hang at init. Start the agent "
        f"with its address set to one of this node's addresses, or set GLOO_SOCKET_IFNAME and "
        f"NCCL_SOCKET_IFNAME in its environment")


def _ip(snic) -> str | None:
    """An interface address as a canonical IP string; None for link-layer and odd entries."""
    if snic.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return str(ipaddress.ip_address(snic.address.split("%")[0]))
    except ValueError:
        return None


def _loopback_net(snic):
    ip = _ip(snic)
    if ip is None or not snic.netmask or not ipaddress.ip_address(ip).is_loopback:
        return None
    try:
        return ipaddress.ip_network(f"{ip}/{snic.netmask}", strict=False)
    except ValueError:  # an IPv6 netmask psutil spells as an address
        return None


# NCCL's flight recorder: the last collectives of each process group, dumped when the watchdog
# times a collective out. torch 2.13's names (TORCH_NCCL_TRACE_BUFFER_SIZE and
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE still work but are deprecated aliases).
TRACE_BUFFER_ENTRIES = "2000"
TRACE_FILE_PREFIX = "nccl_trace_rank_"  # in the run dir; torch appends the global rank


def _comm_env(req: LaunchRequest, env: dict[str, str], agent_env: Mapping[str, str]) -> None:
    """Interface binding and flight recorder. What the job sets wins, then what the operator set in
    the agent's environment for the fabric (e.g. NCCL_SOCKET_IFNAME=ib0, always honoured for these
    two names), then the interface holding the node's address."""
    for name in IFNAME_VARS:
        if name not in env and agent_env.get(name):
            env[name] = agent_env[name]
    if not all(name in env for name in IFNAME_VARS):
        ifname = interface_for(req.local_addr)
        for name in IFNAME_VARS:
            env.setdefault(name, ifname)
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        env.setdefault("TORCH_FR_BUFFER_SIZE", TRACE_BUFFER_ENTRIES)
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env:
        env.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(os.path.abspath(req.run_dir), "logs", TRACE_FILE_PREFIX))
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOCALE_VARS = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# Test-only fault injection (workers/runtime/chaos.py): passed on when the agent was started with it.
CHAOS_VAR = "TRAINYARD_CHAOS_DIR"


def build_env(req: LaunchRequest, base: Mapping[str, str] | None = None, *,
              passes: Callable[[str], bool] = lambda name: False, user: str = "") -> dict[str, str]:
    """The ranks' whole environment, by allow-list (issue 21): a minimal PATH, HOME and TMPDIR in
    the run directory, the locale, the job's own `env`, what torchrun and Trainyard set per rank,
    the CUDA/NCCL/GLOO variables set here, and the agent variables the operator named
    (`passes`, from TRAINYARD_SANDBOX_PASS_ENV). Nothing else of the agent's environment (`base`,
    default os.environ): never its REDIS_URL, credentials, TRAINYARD_VAR_DIR or a TORCHELASTIC_*/
    PET_* left by a launcher above it."""
    agent_env = os.environ if base is None else base
    run_dir = os.path.abspath(req.run_dir)
    env = {name: agent_env[name] for name in agent_env
           if passes(name) and not name.startswith(("TORCHELASTIC_", "PET_", "TRAINYARD_"))}
    env.update({name: agent_env[name] for name in LOCALE_VARS if agent_env.get(name)})
    env.setdefault("LANG", "C.UTF-8")
    env.update({"PATH": os.pathsep.join([os.path.dirname(req.interpreter), SYSTEM_PATH]),
                "HOME": os.path.join(run_dir, "home"), "TMPDIR": os.path.join(run_dir, "tmp")})
    if user:
        env["USER"] = env["LOGNAME"] = user
    if agent_env.get(CHAOS_VAR):
        env[CHAOS_VAR] = agent_env[CHAOS_VAR]
    # The bundle first (the script's own imports), then the directory holding `trainyard` (the SDK,
    # in any interpreter; and the runtime).
    env["PYTHONPATH"] = os.pathsep.join(([req.code_dir] if req.code_dir else []) + [REPO_ROOT])
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = str(req.cores_per_slot)
    # The job's own variables (JobSpec `env`; the spec refuses TRAINYARD_*, torchrun's and
    # PYTHONPATH/LD_* names), under what Trainyard sets below.
    env.update({str(k): str(v) for k, v in req.env.items()})
    env["TRAINYARD_RUN_CONFIG"] = req.config_path
    if agent_env.get("TRAINYARD_AGENT_ONCE"):  # an agent in a Slurm allocation: SIGTERM means preemption
        env["TRAINYARD_SIGTERM_PREEMPTS"] = "1"
    env["TRAINYARD_NODE"] = req.node
    env["TRAINYARD_RUN_DIR"] = run_dir
    env["TRAINYARD_JOB_ID"] = str(req.job_id)
    env["TRAINYARD_ATTEMPT_ID"] = str(req.attempt_id)
    env["TRAINYARD_LOCAL_ADDR"] = req.local_addr  # for a runtime that binds gloo/NCCL to it
    if req.device == "cuda":
        # Slot i is the agent's i-th visible GPU (its own CUDA_VISIBLE_DEVICES: Slurm, containers),
        # numbered in PCI bus order as NVML numbers them, which is how the agent counted them; in a
        # sandbox, by UUID (only the attempt's GPUs' device nodes are there: CUDA renumbers them).
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(req.gpu_ids or slot_devices(req.slots, agent_env.get("CUDA_VISIBLE_DEVICES")))
    _comm_env(req, env, agent_env)
    return env


def pick_free_port(host: str) -> int:
    """A port free on `host` right now (another process may still take it before use)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
