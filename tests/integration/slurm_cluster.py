"""A real Slurm cluster for tests: munged, slurmctld and one slurmd per test host (a network namespace
from tests/integration/hosts.py, or the test's own namespace), all under one work directory.

    with hosts.bridged_hosts(["n1", "n2"]) as net, slurm_cluster(
            tmp_path, [("n1", net.namespace("n1")), ("n2", net.namespace("n2"))],
            controller_addr=net.gateway) as sc:
        sc.run(["sbatch", "--parsable", "--wrap", "srun hostname"])

slurmctld and munged run in the caller's namespace; a slurmd in a namespace reaches slurmctld at
`controller_addr` (the bridge gateway, which the root namespace holds), slurmctld reaches it at its
namespace's address. Every slurmd is `slurmd -D -f <conf> -N <NodeName>` under `nsenter --net=`
(not `ip netns exec`, which makes a mount namespace and remounts /sys); each has its own port
(`Port=` per NodeName), spool, log and pid file, so several may share one namespace. No cgroups
(proctrack/linuxproc, task/none, jobacct_gather/none): nothing needs systemd or cgroup v2 delegation.
munged runs as root (`--force`) on its own socket under the work directory (AuthInfo=socket=...).
Teardown (also on an exception) cancels every job, SIGTERMs slurmd, slurmctld and munged, waits,
SIGKILLs, then kills every process left that carries this cluster's marker in its environment
(slurmstepd inherits slurmd's environment, job processes the submitter's `env`) or descends from
one of them.

Facts measured on this machine (Debian slurm-wlm 22.05.8, munge 0.5.15; KillWait=2, GraceTime=5,
PreemptMode=REQUEUE on `trainyard`, OFF on `urgent`) -- see test_slurm_cluster.py, which asserts them:

- Preemption of a `trainyard` job by an `urgent` one that needs its CPUs, on the next scheduling
  pass (0.5-0.9 s after the urgent sbatch): every task of every step gets SIGCONT + SIGTERM (the
  batch shell too); the job stays RUNNING through GraceTime. At the grace end -- measured 12.0 s
  after the first SIGTERM in 4 runs and 6.0 s in 1, never at 5 s: slurmctld notices it on a periodic
  pass -- the tasks get SIGTERM (srun forwarding the batch step's) then SIGCONT + SIGTERM (slurmstepd),
  the job is COMPLETING, and SIGKILL follows ~4.6 s later (KillWait=2 plus slurmd's own delay).
  ~7.3 s after COMPLETING began the job ends: with `--no-requeue`, JobState=PREEMPTED (Requeue=0,
  ExitCode=0:15); requeueable (the default, JobRequeue=1) it is requeued instead: PENDING,
  Reason=BeginTime, Restarts=1, EligibleTime = requeue time + cred_expire + 1 s (AuthInfo
  cred_expire, the fixture's `cred_expire_s=10`; Slurm's default is 120 s). The urgent job starts
  only once the preempted job's processes are gone (~20 s after its sbatch with GraceTime=5).
- `scancel --signal=TERM <id>`: every step task gets one SIGTERM at once (no SIGCONT), the batch
  shell none; a task that traps it keeps the job RUNNING. `scancel --full --signal=TERM` signals the
  batch shell too: bash dies, the job ends FAILED (Reason=JobLaunchFailure) at once and its tasks are
  killed without a SIGTERM reaching them -- not what a control plane wants.
- `scancel <id>`: every task gets SIGCONT + SIGTERM at once, the job is CANCELLED, SIGKILL ~4.7 s later.
- `scontrol update NodeName=<n> State=DOWN`: every job with a task on the node is killed at once:
  SIGCONT + SIGTERM within ~10 ms to all its tasks on all its nodes (an admin-DOWN node's slurmd still
  answers), SIGKILL ~4.7 s later; JobState COMPLETING at once and ~7.4 s later NODE_FAIL
  (`--no-requeue`) or requeued (PENDING, Restarts=1, Reason=BeginTime). With ReturnToService=1 the
  node stays DOWN until `State=RESUME` (with 2 it was IDLE again within a second, slurmd having
  answered: hence 1). RESUME of a node that is neither DOWN nor DRAINed is refused (resume_node skips it).
- Ended jobs: plain `squeue --jobs=<id>` prints nothing (rc 0); `squeue --states=all` shows them
  (CD, CA, F, PR, NF) for MinJobAge plus slurmctld's purge pass (MinJobAge=10: gone 17.3 s after the
  end); after that the id is unknown. `squeue --jobs=<unknown id>` (with or without --states=all)
  and `scontrol show job <unknown id>`: rc 1, stderr "slurm_load_jobs error: Invalid job id
  specified"; `scancel <unknown id>`: rc 0, silent. `sacct` without slurmdbd: rc 1, stderr "Slurm
  accounting storage is disabled".
- A task under srun gets the submitter's environment (sbatch's default --export=ALL, so PYTHONPATH,
  SLURM_CONF, ... pass through) and cwd (sbatch's cwd; --chdir to change), plus SLURM_JOB_ID,
  SLURM_STEP_ID (0, 1, ... per srun), SLURM_PROCID (global rank), SLURM_LOCALID, SLURM_NODEID (the
  node's 0-based index in the job), SLURMD_NODENAME (the NodeName: `hostname` is the same in every
  namespace, which share the UTS namespace), SLURM_NODELIST / SLURM_STEP_NODELIST in compressed
  form (`n[1-2]`), SLURM_STEP_NUM_NODES / _NUM_TASKS. Job ids count from 1 in every fresh cluster.
- Start-up (munged to every node IDLE) takes 1.1-1.5 s; the first job is allocated ~2 s after sbatch.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MARKER_VAR = "TRAINYARD_SLURM_FIXTURE"
DAEMONS = ("slurmctld", "slurmd", "munged")


def available() -> tuple[bool, str]:
    """(True, "") if the Slurm and munge daemons and clients are installed; else (False, why)."""
    import shutil
    missing = [p for p in ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged", "nsenter")
               if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if missing:
        return False, (f"{', '.join(missing)} not installed: scripts/ensure_system_deps.sh ... slurm "
                       "installs slurm-wlm and munge")
    if os.geteuid() != 0:
        return False, "not root: the fixture runs munged/slurmctld/slurmd as root (SlurmUser=root)"
    return True, ""


def _which(name: str) -> str:
    import shutil
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("0.0.0.0", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _ns_prefix(ns: str | None) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{ns}", "--"] if ns else []


def _ns_address(ns: str) -> str:
    out = subprocess.run(["ip", "-n", ns, "-4", "-o", "addr", "show", "scope", "global"],
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            return parts[parts.index("inet") + 1].split("/")[0]
    raise RuntimeError(f"namespace {ns} has no global IPv4 address")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"({e})"
    return "\n".join(text[-lines:])


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ppids() -> dict[int, int]:
    """{pid: ppid} of the live processes (zombies, already dead and waiting for a reaper, left out)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
            state, ppid = stat[stat.rindex(b")") + 2:].split()[:2]
            if state not in (b"Z", b"X"):
                out[int(d)] = int(ppid)
        except (OSError, ValueError, IndexError):
            continue
    return out


def cluster_pids(marker: str, roots: list[int] = ()) -> set[int]:
    """Processes that carry `marker` in their environment, the pids in `roots`, and their descendants."""
    ppids = _ppids()
    needle = f"{MARKER_VAR}={marker}".encode()
    found = {pid for pid in ppids if needle in _environ(pid).split(b"\0")}
    found |= {pid for pid in roots if pid in ppids}
    changed = True
    while changed:
        children = {pid for pid, ppid in ppids.items() if ppid in found} - found
        found |= children
        changed = bool(children)
    found.discard(os.getpid())
    return found


@dataclass
class SlurmCluster:
    workdir: Path
    conf: Path
    env: dict
    nodes: list[str]
    namespaces: dict[str, str | None]
    addresses: dict[str, str]
    marker: str
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    munge_socket: Path | None = None

    def run(self, argv: list[str], ns: str | None = None, check: bool = True,
            timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command with the cluster's env, in namespace `ns` (None: the caller's), in
        the work directory (so an sbatch job's cwd and default slurm-<id>.out are there)."""
        r = subprocess.run([*_ns_prefix(ns), *argv], env=self.env, capture_output=True, text=True,
                           timeout=timeout, cwd=self.workdir)
        if check and r.returncode != 0:
            raise RuntimeError(f"{argv} failed rc={r.returncode}: {r.stderr.strip()}\n{self.logs()}")
        return r

    def node_info(self, name: str) -> dict[str, str]:
        out = self.run(["scontrol", "-o", "show", "node", name]).stdout
        info = {}
        for tok in out.split():
            k, _, v = tok.partition("=")
            info[k] = v
        return info

    def node_state(self, name: str) -> str:
        """scontrol's State, e.g. IDLE, ALLOCATED, MIXED, DOWN, DOWN+NOT_RESPONDING, IDLE+DRAIN."""
        return self.node_info(name).get("State", "")

    def job_info(self, job_id: str | int) -> dict[str, str]:
        """scontrol show job's fields ({} once slurmctld has purged it, MinJobAge after its end)."""
        r = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        if r.returncode != 0:
            return {}
        info = {}
        for tok in r.stdout.split():
            k, _, v = tok.partition("=")
            info.setdefault(k, v)
        return info

    def job_state(self, job_id: str | int) -> str:
        return self.job_info(job_id).get("JobState", "")

    def wait_job_state(self, job_id: str | int, states: set[str] | str, timeout: float = 30) -> str:
        states = {states} if isinstance(states, str) else set(states)
        deadline, state = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} is {state!r}, not in {sorted(states)} after {timeout}s\n"
                           f"{self.job_info(job_id)}\n{self.logs()}")

    def set_node_down(self, name: str, reason: str = "test") -> None:
        self.run(["scontrol", "update", f"NodeName={name}", "State=DOWN", f"Reason={reason}"])

    def resume_node(self, name: str) -> None:
        """Undo set_node_down (or a drain); a no-op for a node that is neither DOWN nor DRAINed."""
        state = self.node_state(name)
        if "DOWN" in state or "DRAIN" in state:
            self.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"])

    def cancel_all(self) -> None:
        """scancel every job (not --full: that signals the batch shell too, see the docstring)."""
        self.run(["scancel", "--user=root"], check=False)

    def log_files(self) -> list[Path]:
        return [self.workdir / "slurmctld.log", *(self.workdir / f"slurmd-{n}.log" for n in self.nodes),
                self.workdir / "munged.out"]  # munged --foreground logs to stderr, not --log-file

    def logs(self, lines: int = 30) -> str:
        return "\n".join(f"--- {p.name} (last {lines} lines)\n{_tail(p, lines)}" for p in self.log_files())

    def wait_idle(self, timeout: float = 30) -> None:
        deadline, states = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            for name, p in self.processes.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited rc={p.returncode} while the cluster started\n{self.logs()}")
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=10)
            if r.returncode == 0:
                states = dict(line.split(None, 1) for line in r.stdout.splitlines() if line.strip())
                if all(states.get(n, "").rstrip("*") == "idle" for n in self.nodes):
                    return
            time.sleep(0.3)
        raise TimeoutError(f"Slurm nodes not all idle after {timeout}s: {states}\n{self.logs()}")

    def stop(self) -> None:
        """Cancel every job, stop the daemons (SIGTERM, wait, SIGKILL), kill whatever is left of them."""
        ctld = self.processes.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            with contextlib.suppress(Exception):
                self.cancel_all()
        roots = [p.pid for p in self.processes.values()]
        order = [n for n in self.processes if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            p = self.processes.get(name)
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for name in order:
            p = self.processes.get(name)
            if p is None:
                continue
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for _ in range(100):
            left = cluster_pids(self.marker, roots)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def leftover_pids(self) -> set[int]:
        return cluster_pids(self.marker, [p.pid for p in self.processes.values()])


def _write_conf(sc: SlurmCluster, *, controller_addr: str, ctld_port: int, node_ports: dict[str, int],
                cpus: int, grace_s: int, min_job_age_s: int, cred_expire_s: int) -> None:
    w = sc.workdir
    host = socket.gethostname().split(".")[0]
    node_lines = "\n".join(f"NodeName={n} NodeAddr={sc.addresses[n]} NodeHostname={host} Port={node_ports[n]} "
                           f"CPUs={cpus} State=UNKNOWN" for n in sc.nodes)
    nodes = ",".join(sc.nodes)
    sc.conf.write_text(f"""\
# generated by tests/integration/slurm_cluster.py
ClusterName=trainyard-test
SlurmctldHost={host}({controller_addr})
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sc.munge_socket},cred_expire={cred_expire_s}
CredType=cred/munge
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool/%n
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd-%n.pid
SlurmctldLogFile={w}/slurmctld.log
SlurmdLogFile={w}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=1
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MinJobAge={min_job_age_s}
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
KillWait=2
InactiveLimit=0
SlurmdTimeout=30
MessageTimeout=10
{node_lines}
PartitionName=trainyard Nodes={nodes} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime={grace_s} MaxTime=INFINITE State=UP
PartitionName=urgent Nodes={nodes} PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
""")
    (w / "cgroup.conf").write_text("# no cgroup plugin is configured (proctrack/linuxproc, task/none)\n"
                                   "CgroupAutomount=no\nConstrainCores=no\nConstrainRAMSpace=no\n")


@contextlib.contextmanager
def slurm_cluster(workdir: Path, hosts: list[tuple[str, str | None]], *, controller_addr: str = "127.0.0.1",
                  cpus: int = 2, grace_s: int = 5, min_job_age_s: int = 300,
                  extra_env: dict | None = None, cred_expire_s: int = 10) -> Iterator[SlurmCluster]:
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    os.chmod(workdir, 0o700)
    for sub in ("state", "spool", "munge"):
        (workdir / sub).mkdir(exist_ok=True)
    names = [n for n, _ in hosts]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate NodeName in {names}")
    for n in names:
        (workdir / "spool" / n).mkdir(exist_ok=True)
    namespaces = dict(hosts)
    addresses = {n: _ns_address(ns) if ns else controller_addr for n, ns in hosts}
    marker = secrets.token_hex(8)
    env = {**os.environ, **(extra_env or {}), "SLURM_CONF": str(workdir / "slurm.conf"), MARKER_VAR: marker}
    for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_"))]:
        if k != "SLURM_CONF":
            del env[k]
    sc = SlurmCluster(workdir=workdir, conf=workdir / "slurm.conf", env=env, nodes=names,
                      namespaces=namespaces, addresses=addresses, marker=marker,
                      munge_socket=workdir / "munge" / "munge.socket")
    ctld_port, *ports = _free_ports(1 + len(names))
    _write_conf(sc, controller_addr=controller_addr, ctld_port=ctld_port, node_ports=dict(zip(names, ports)),
                cpus=cpus, grace_s=grace_s, min_job_age_s=min_job_age_s, cred_expire_s=cred_expire_s)
    key = workdir / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    os.chmod(key, 0o400)
    os.chown(key, os.geteuid(), os.getegid())

    def start(name: str, argv: list[str]) -> None:
        out = open(workdir / f"{name}.out", "wb")  # noqa: SIM115 -- the daemon's stdout/stderr, closed with it
        try:
            sc.processes[name] = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                                  stderr=subprocess.STDOUT, start_new_session=True,
                                                  cwd=workdir)
        finally:
            out.close()

    try:
        m = workdir / "munge"
        start("munged", [_which("munged"), "--foreground", "--force", f"--socket={sc.munge_socket}",
                         f"--pid-file={m}/munged.pid", f"--key-file={key}", f"--log-file={workdir}/munged.log",
                         f"--seed-file={m}/munged.seed", "--num-threads=4"])
        deadline = time.monotonic() + 10
        while not sc.munge_socket.exists():
            if sc.processes["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start\n{_tail(workdir / 'munged.out')}\n{sc.logs()}")
            time.sleep(0.05)
        start("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(sc.conf)])
        for n, ns in hosts:
            start(f"slurmd-{n}", [*_ns_prefix(ns), _which("slurmd"), "-D", "-f", str(sc.conf), "-N", n])
        sc.wait_idle(30)
        yield sc
    finally:
        sc.stop()
