"""The sandbox an attempt's ranks run in: bubblewrap (Debian's `bwrap`) for the namespaces and the
file system, util-linux's `setpriv` for the identity (no Django, no torch).

Why bubblewrap: it is the sandbox Flatpak and most desktop distributions ship, a small C program
with one job (build a mount namespace from an explicit list of binds, plus PID/IPC namespaces, a
reaping init, die-with-parent); it needs no daemon, no image and no container runtime on the node,
and Debian packages it. Why run it as root (the agent's identity) and drop to the attempt's uid
inside with setpriv, rather than unprivileged bwrap in a user namespace: unprivileged bwrap opens
every bind source as the unprivileged user, so the agent's own 0700 directories (its run root,
the state directory) would have to be opened up to every local user for it to bind an attempt's
subdirectory out of them; run as root it binds exactly the attempt's paths and nothing is loosened.
The ranks then hold a real, distinct uid on the host (not only inside a namespace), no
capabilities (bounding and inheritable sets cleared), no_new_privs (a setuid binary cannot raise
them again) and an RLIMIT_NPROC of their own.

    agent (root) -> procwrap (root, outside: exit.json) -> bwrap (root: namespaces, binds)
        -> [pid 1: bwrap's reaper] -> setpriv + prlimit (drop to the attempt's uid:gid) -> torchrun -> ranks

Identity: uid = UID_BASE + attempt id (mod ID_RANGE), gid = GID_BASE + job id (mod ID_RANGE), the
same on every node (checkpoints are shared), so every attempt has its own uid and the attempts of
one job share a group: a job's checkpoint directory is root:<job gid> 2770, and an attempt resumes
from its predecessors' files through the group. Nothing else on the host has those ids.

The sandbox's file system holds only: /usr (and the /bin, /lib... links into it), a few files of
/etc (no secrets: name service, TLS roots, time zone) and a /etc/passwd naming the attempt's user,
a fresh /proc (its own PID namespace: no other process is visible or can be signalled), a minimal
/dev (+ a private /dev/shm; on cuda only the attempt's GPUs and the control devices), /sys
read-only, a private tmpfs /tmp, the Python environment and the SDK (read-only), the data root
(read-only), the operator's TRAINYARD_SANDBOX_RO paths (read-only), the attempt's config.json and
code/ (read-only), its home/, tmp/ (TMPDIR), logs/ and ranks/ (read-write), and its job's checkpoint
directory (read-write). The agent's files, the node credential, other attempts' directories,
other jobs' bundles and logs and the control plane's state directory are not there.
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

log = logging.getLogger("trainyard.agent.sandbox")

INSECURE_ENV = "TRAINYARD_INSECURE_NO_SANDBOX"
RO_ENV = "TRAINYARD_SANDBOX_RO"  # extra read-only paths (os.pathsep-separated): Python envs, datasets
PASS_ENV = "TRAINYARD_SANDBOX_PASS_ENV"  # agent variables the ranks get (names; NAME* for a prefix)
UID_BASE, GID_BASE, ID_RANGE = 200_000_000, 200_000_000, 100_000_000
NPROC = 16384  # processes and threads of one attempt on one node (torch starts many threads)
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
SHM_BYTES = 8 << 30  # the private /dev/shm (NCCL's intra-node buffers live there)
TMP_BYTES = 1 << 30  # the private /tmp (tmpfs; TMPDIR points at the attempt's disk tmp/)
PROBE_TIMEOUT_S = 20.0
SANDBOX_DIRS = ("home", "tmp", "logs", "ranks")  # per attempt, owned by its uid, bound read-write
REPO_ROOT = Path(__file__).resolve().parent.parent
# Files of /etc a Python process needs (name resolution for the rendezvous, TLS roots, time zone);
# never the whole of /etc (an operator's secrets, the agent's own environment file).
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "hosts", "host.conf", "resolv.conf",
       "nsswitch.conf", "gai.conf", "protocols", "services", "localtime", "timezone", "ssl", "ca-certificates",
       "ca-certificates.conf", "os-release", "mime.types", "debian_version", "machine-id")
NVIDIA_CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")


class SandboxUnavailable(RuntimeError):
    """This node cannot make the sandbox; the message says what is missing."""


@dataclass(frozen=True)
class SandboxConfig:
    """The agent's sandbox settings (from its environment, `from_env`)."""

    enabled: bool = True
    bwrap: str = "bwrap"
    setpriv: str = "setpriv"
    prlimit: str = "prlimit"
    ro_paths: tuple[str, ...] = ()
    pass_env: tuple[str, ...] = ()
    uid_base: int = UID_BASE
    gid_base: int = GID_BASE
    id_range: int = ID_RANGE
    nproc: int = NPROC

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SandboxConfig":
        env = os.environ if environ is None else environ

        def num(name: str, default: int) -> int:
            raw = env.get(name, "").strip()
            try:
                value = int(raw) if raw else default
            except ValueError:
                raise SandboxUnavailable(f"{name}={raw!r} is not an integer") from None
            if value < 1:
                raise SandboxUnavailable(f"{name} must be at least 1, got {value}")
            return value

        ro = tuple(os.path.abspath(p) for p in env.get(RO_ENV, "").split(os.pathsep) if p.strip())
        return cls(enabled=env.get(INSECURE_ENV, "") != "1",
                   bwrap=env.get("TRAINYARD_BWRAP", "bwrap"), ro_paths=ro,
                   pass_env=tuple(env.get(PASS_ENV, "").replace(",", " ").split()),
                   uid_base=num("TRAINYARD_SANDBOX_UID_BASE", UID_BASE),
                   gid_base=num("TRAINYARD_SANDBOX_GID_BASE", GID_BASE),
                   id_range=num("TRAINYARD_SANDBOX_ID_RANGE", ID_RANGE),
                   nproc=num("TRAINYARD_SANDBOX_NPROC", NPROC))

    def ids(self, job_id: int, attempt_id: int) -> tuple[int, int]:
        """(uid, gid) of an attempt: its own uid, its job's gid."""
        return (self.uid_base + int(attempt_id) % self.id_range,
                self.gid_base + int(job_id) % self.id_range)

    def passes(self, name: str) -> bool:
        """Whether an agent variable `name` is one the operator passes to the ranks."""
        return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in self.pass_env)


@dataclass(frozen=True)
class Mounts:
    """What one attempt's sandbox binds, beyond the system paths every sandbox has."""

    run_dir: str
    checkpoint_dir: str
    data_root: str
    code_dir: str = ""
    python_prefixes: tuple[str, ...] = ()  # the interpreter's environment (read-only)
    extra_rw: tuple[str, ...] = ()  # test-only: the chaos directory (TRAINYARD_CHAOS_DIR)
    extra_ro: tuple[str, ...] = ()  # the Redis CA file a rediss:// URL names
    devices: tuple[str, ...] = ()  # /dev/nvidia<minor> of the attempt's GPUs
    cuda: bool = False


def _tools(cfg: SandboxConfig) -> dict[str, str]:
    found = {name: shutil.which(getattr(cfg, name)) for name in ("bwrap", "setpriv", "prlimit")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        pkgs = {"bwrap": "bubblewrap", "setpriv": "util-linux", "prlimit": "util-linux"}
        raise SandboxUnavailable(
            f"{', '.join(missing)} not found on PATH: install Debian's "
            f"{' and '.join(sorted({pkgs[m] for m in missing}))} (scripts/ensure_system_deps.sh does), "
            f"or set {INSECURE_ENV}=1 to run jobs unsandboxed with the agent's identity (insecure)")
    return found  # type: ignore[return-value]


def _system_args() -> list[str]:
    """The read-only system part every sandbox has: /usr and its links, a few files of /etc."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--perms", "0755", "--dir", "/etc"]  # bwrap 0.8 would make it 0700 (see _parents)
    for name in ETC:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return args


def _parents(paths: list[str]) -> list[str]:
    """Every ancestor of `paths` (outermost first), to be made 0755 before the binds: bwrap 0.8
    creates missing mount points' parents 0700 (root), which the attempt's uid could not enter."""
    out: list[str] = []
    for p in paths:
        parts = Path(p).parts
        for i in range(2, len(parts)):
            parent = str(Path(*parts[:i]))
            if parent not in out and parent not in ("/usr", "/proc", "/dev", "/sys", "/etc", "/tmp"):
                out.append(parent)
    return out


def bwrap_args(cfg: SandboxConfig, m: Mounts, *, uid: int, gid: int, env: Mapping[str, str],
               argv: list[str], cwd: str) -> list[str]:
    """bubblewrap's options for one attempt: the mounts and the environment (--clearenv, then
    exactly `env`); then `--` and `argv` run as uid:gid. procwrap passes the options through
    `--args FD` (bwrap reads only options there), so neither the environment nor the binds show
    in `ps`; the command (torchrun's argv, visible as torchrun's own anyway) follows `--`."""
    run = os.path.abspath(m.run_dir)
    rw = [os.path.join(run, d) for d in SANDBOX_DIRS] + [m.checkpoint_dir, *m.extra_rw]
    ro = ([os.path.join(run, "config.json")] + ([m.code_dir] if m.code_dir else [])
          + [str(REPO_ROOT / "trainyard"), str(REPO_ROOT / "workers"), m.data_root]
          + [p for p in (*m.python_prefixes, *cfg.ro_paths) if not _under_usr(p)] + list(m.extra_ro))
    ro = [p for p in dict.fromkeys(ro) if os.path.exists(p)]
    # The hostname stays the node's: NCCL tells peers on one host from peers on others by it.
    args = ["--unshare-pid", "--unshare-ipc", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            *_system_args(),
            "--ro-bind", os.path.join(run, "sandbox-passwd"), "/etc/passwd",
            "--ro-bind", os.path.join(run, "sandbox-group"), "/etc/group",
            "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm",
            "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
            "--ro-bind", "/sys", "/sys"]
    for dev in (*m.devices, *(f"/dev/{d}" for d in NVIDIA_CONTROL if m.cuda)):
        args += ["--dev-bind-try", dev, dev]
    if m.cuda:
        args += ["--dev-bind-try", "/dev/nvidia-caps", "/dev/nvidia-caps"]
    for parent in _parents(rw + ro):
        args += ["--perms", "0755", "--dir", parent]
    for path in ro:
        args += ["--ro-bind", path, path]
    for path in rw:
        args += ["--bind", path, path]
    args += ["--chdir", cwd, "--clearenv"]
    for key, value in sorted(env.items()):
        args += ["--setenv", key, value]
    return args + ["--", *_drop(cfg, uid, gid), *argv]


def _drop(cfg: SandboxConfig, uid: int, gid: int) -> list[str]:
    """Inside the sandbox, before the job's code: its process limit, then its uid:gid with no
    capabilities left in any set and no_new_privs."""
    return [shutil.which(cfg.prlimit) or cfg.prlimit, f"--nproc={cfg.nproc}:{cfg.nproc}", "--",
            shutil.which(cfg.setpriv) or cfg.setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def _under_usr(path: str) -> bool:
    p = os.path.abspath(path)
    return p == "/usr" or p.startswith("/usr/")


def encode_args(args: list[str]) -> bytes:
    """bwrap's `--args FD` format: NUL-terminated arguments. A NUL inside one cannot be passed."""
    if any("\0" in a for a in args):
        raise ValueError("a sandbox argument contains a NUL byte")
    return b"".join(a.encode() + b"\0" for a in args)


def passwd_files(uid: int, gid: int, *, home: str, name: str) -> tuple[str, str]:
    """/etc/passwd and /etc/group for the sandbox: root, nobody and the attempt's user (getpass,
    `id`, and torch's cache directories look the running uid up)."""
    passwd = (f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
              f"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
              f"{name}:x:{uid}:{gid}:trainyard job:{home}:/bin/sh\n")
    group = f"root:x:0:\nnogroup:x:65534:\n{name}:x:{gid}:\n"
    return passwd, group


def prepare_run_dir(run_dir: str | Path, *, uid: int, gid: int, user: str) -> None:
    """The attempt's sandbox-writable directories (owned by its uid, 0700) and the sandbox's
    passwd/group files. The run directory itself stays the agent's (0700): the agent's files in
    it (launched, supervisor.json, exit.json, torchrun's own logs) are not in the sandbox."""
    run = Path(run_dir)
    for name in SANDBOX_DIRS:
        d = run / name
        d.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise SandboxUnavailable(f"{d} is not a directory")
        os.chown(d, uid, gid, follow_symlinks=False)
        os.chmod(d, 0o700)
    passwd, group = passwd_files(uid, gid, home=str(run / "home"), name=user)
    for name, text in (("sandbox-passwd", passwd), ("sandbox-group", group)):
        tmp = run / f".{name}.tmp"
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, run / name)
    config = run / "config.json"
    if config.exists():  # the attempt's own credentials: readable by its uid alone
        os.chown(config, uid, gid, follow_symlinks=False)
        os.chmod(config, 0o400)


def prepare_checkpoint_dir(path: str | Path, *, gid: int) -> None:
    """The job's checkpoint directory: root:<job gid>, 2770 (new files and directories inherit
    the group, so every attempt of the job can resume from the others' checkpoints; the control
    plane, root, verifies and deletes them). Made if missing."""
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise SandboxUnavailable(f"the checkpoint directory {p} is not a directory")
    if st.st_gid != gid:
        os.chown(p, 0, gid, follow_symlinks=False)
    if stat.S_IMODE(st.st_mode) != 0o2770:
        os.chmod(p, 0o2770)


def prepare_shared_rw(path: str | Path) -> None:
    """A test-only directory several attempts write (the chaos directory): sticky, world-writable."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    os.chmod(p, 0o1777)


def probe(cfg: SandboxConfig) -> str:
    """Make one sandbox and run `id -u` in it as an attempt's uid: '' when it works, else raise
    SandboxUnavailable naming what is missing. The agent calls this at start."""
    tools = _tools(cfg)
    uid, gid = cfg.ids(0, 0)
    args = ["--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session", *_system_args(),
            "--proc", "/proc", "--dev", "/dev", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
            "--", *_drop(cfg, uid, gid), "/usr/bin/id", "-u"]
    try:
        out = subprocess.run([tools["bwrap"], *args], capture_output=True, text=True,
                             timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(f"bwrap could not run: {exc}") from None
    if out.returncode != 0 or out.stdout.strip() != str(uid):
        said = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        need = "" if os.geteuid() == 0 else (
            " (the agent runs as uid %d: it needs root, or CAP_SYS_ADMIN, CAP_SETUID, CAP_SETGID, CAP_SETPCAP "
            "and CAP_CHOWN, see deploy/systemd/trainyard-agent.service)" % os.geteuid())
        raise SandboxUnavailable(f"cannot make the job sandbox: bwrap said {said!r}{need}; or set "
                                 f"{INSECURE_ENV}=1 to run jobs unsandboxed with the agent's identity (insecure)")
    return ""


# ------------------------------------------------------------ the sandbox's processes, from outside

def ns_pids(pid: int) -> list[int]:
    """A process's pid in each PID namespace it is in, outermost first (/proc/<pid>/status NSpid)."""
    try:
        with open(f"/proc/{int(pid)}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def outer_pid(inner: int, candidates: list[int]) -> int | None:
    """The host pid of the sandboxed process whose pid inside its namespace is `inner`, among
    `candidates` (the wrapper's descendants: only this attempt's own processes can be named, so a
    rank that reports a made-up pid names at most one of its own attempt's processes)."""
    for pid in candidates:
        nspids = ns_pids(pid)
        if len(nspids) >= 2 and nspids[-1] == inner:
            return pid
    return None


def agent_python_prefixes() -> tuple[str, ...]:
    """The agent's own interpreter's environment (a virtualenv: sys.prefix; the base under /usr)."""
    return tuple(dict.fromkeys(os.path.abspath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix)))


@dataclass(frozen=True)
class SandboxPlan:
    """One attempt's sandbox on this node: the agent's settings, what it binds, its identity.
    `cfg.enabled` false (TRAINYARD_INSECURE_NO_SANDBOX=1): the ranks run as the agent, with the
    allow-listed environment only."""

    cfg: SandboxConfig
    mounts: Mounts
    uid: int
    gid: int
    user: str

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    @classmethod
    def for_attempt(cls, cfg: SandboxConfig, mounts: Mounts, *, job_id: int, attempt_id: int) -> "SandboxPlan":
        uid, gid = cfg.ids(job_id, attempt_id)
        return cls(cfg, mounts, uid, gid, f"job-{int(job_id)}")

    def prepare(self) -> None:
        """Directories and files the sandbox binds, owned as it needs them (agent side, as root)."""
        prepare_run_dir(self.mounts.run_dir, uid=self.uid, gid=self.gid, user=self.user)
        prepare_checkpoint_dir(self.mounts.checkpoint_dir, gid=self.gid)
        for path in self.mounts.extra_rw:
            prepare_shared_rw(path)

    def command(self, env: Mapping[str, str], argv: list[str], cwd: str) -> tuple[str, list[str], list[str]]:
        """(bwrap's path, its options, the command after `--`) to run `argv` in this sandbox."""
        tools = _tools(self.cfg)
        args = bwrap_args(self.cfg, self.mounts, uid=self.uid, gid=self.gid, env=env, argv=argv, cwd=cwd)
        cut = args.index("--")
        return tools["bwrap"], args[:cut], args[cut + 1:]

    def ro_roots(self) -> tuple[str, ...] | None:
        """The read-only paths programs the job names must lie under (None: no sandbox)."""
        if not self.enabled:
            return None
        return ("/usr", *self.mounts.python_prefixes, *self.cfg.ro_paths)

    def run(self, env: Mapping[str, str], argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        """Run a short command in this sandbox (the job's python probe), its output captured as
        text. Raises subprocess.TimeoutExpired."""
        from trainyard.private import write_private

        bwrap, options, command = self.command(env, argv, "/")
        path = os.path.join(self.mounts.run_dir, f"probe.args.{os.getpid()}.{threading.get_ident()}")
        write_private(path, encode_args(options).decode())
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            done = subprocess.run([bwrap, "--args", str(fd), "--", *command], pass_fds=(fd,), capture_output=True,
                                  text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"})
        finally:
            os.close(fd)
            os.unlink(path)
        return done
