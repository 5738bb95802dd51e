"""Where the Slurm CLI runs: `LocalRunner` (subprocess, an argv list, never a shell) and
`SshRunner` (the same argv on a login node: `ssh ... host -- <argv, each word shell-quoted>`).

Both answer `run(argv, *, timeout, input=None) -> (rc, stdout, stderr)` and raise BackendError
when the command could not be asked at all (a timeout, a program that would not start, ssh's own
failure, rc 255); `write_private(path, data)` writes a file only its owner may read (parent 0700,
file 0600, renamed into place). `build_runner(settings)` picks one from a pool's settings.
"""
from __future__ import annotations

import os
import posixpath
import secrets
import shlex
import subprocess
from typing import Protocol, Sequence

from . import private
from .backends import BackendError
from .slurm_settings import SlurmSettings

Result = tuple[int, str, str]


class Runner(Protocol):
    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> Result: ...

    def write_private(self, path: str, data: str, *, timeout: float = 30.0) -> None: ...


def _program(bin_dir: str, argv: Sequence[str]) -> list[str]:
    if not argv:
        raise ValueError("an empty command")
    argv = [str(a) for a in argv]
    if bin_dir and "/" not in argv[0]:
        argv[0] = posixpath.join(bin_dir, argv[0])
    return argv


class LocalRunner:
    """The Slurm CLI on this host (the control plane's host is a submit host)."""

    def __init__(self, bin_dir: str = "", slurm_conf: str = ""):
        self.bin_dir = bin_dir
        self.slurm_conf = slurm_conf

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> Result:
        argv = _program(self.bin_dir, argv)
        env = dict(os.environ)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        try:
            done = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout, env=env,
                                  stdin=subprocess.DEVNULL if input is None else None, check=False)
        except subprocess.TimeoutExpired:
            raise BackendError(f"{argv[0]} did not answer within {timeout:g} s") from None
        except (OSError, ValueError) as e:
            raise BackendError(f"cannot run {argv[0]}: {e}") from None
        return done.returncode, done.stdout, done.stderr

    def write_private(self, path: str, data: str, *, timeout: float = 30.0) -> None:
        try:
            private.private_dir(os.path.dirname(path))
            private.write_private(path, data)
        except OSError as e:
            raise BackendError(f"cannot write {path}: {e}") from None


class SshRunner:
    """The Slurm CLI on a login node, over SSH with a key and no prompts (BatchMode)."""

    def __init__(self, login: str, ssh_key: str, *, port: int = 22, known_hosts: str = "", bin_dir: str = "",
                 slurm_conf: str = "", ssh: str = "ssh", connect_timeout_s: int = 10):
        if not login or login.startswith("-"):
            raise ValueError(f"bad login {login!r}")
        self.login, self.ssh_key, self.port = login, ssh_key, port
        self.known_hosts, self.bin_dir, self.slurm_conf = known_hosts, bin_dir, slurm_conf
        self.ssh, self.connect_timeout_s = ssh, connect_timeout_s

    def ssh_argv(self, remote: str) -> list[str]:
        """ssh's own argv around one remote command line (already quoted for the remote shell)."""
        if self.known_hosts:
            hosts = ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self.known_hosts}"]
        else:
            hosts = ["-o", "StrictHostKeyChecking=accept-new"]
        return [self.ssh, "-o", "BatchMode=yes", *hosts, "-o", f"ConnectTimeout={self.connect_timeout_s}",
                "-o", "IdentitiesOnly=yes", "-i", self.ssh_key, "-p", str(self.port), self.login, "--", remote]

    def remote_command(self, argv: Sequence[str]) -> str:
        words = [shlex.quote(a) for a in _program(self.bin_dir, argv)]
        if self.slurm_conf:
            words = ["env", shlex.quote(f"SLURM_CONF={self.slurm_conf}"), *words]
        return " ".join(words)

    def _ssh(self, remote: str, *, timeout: float, input: str | None) -> Result:
        argv = self.ssh_argv(remote)
        try:
            done = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL if input is None else None, check=False)
        except subprocess.TimeoutExpired:
            raise BackendError(f"ssh {self.login} did not answer within {timeout:g} s") from None
        except (OSError, ValueError) as e:
            raise BackendError(f"cannot run ssh: {e}") from None
        if done.returncode == 255:
            raise BackendError(f"ssh {self.login} failed: {done.stderr.strip()[:300] or 'rc 255'}")
        return done.returncode, done.stdout, done.stderr

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> Result:
        return self._ssh(self.remote_command(argv), timeout=timeout, input=input)

    def write_private(self, path: str, data: str, *, timeout: float = 30.0) -> None:
        folder = posixpath.dirname(path)
        tmp = f"{path}.tmp.{secrets.token_hex(6)}"
        q = shlex.quote
        remote = (f"umask 077 && mkdir -p {q(folder)} && chmod 700 {q(folder)} && cat > {q(tmp)} "
                  f"&& mv -f {q(tmp)} {q(path)}")
        rc, _, err = self._ssh(remote, timeout=timeout, input=data)
        if rc != 0:
            raise BackendError(f"cannot write {path} on {self.login}: {err.strip()[:300] or f'rc {rc}'}")


def build_runner(settings: SlurmSettings) -> LocalRunner | SshRunner:
    if settings.login:
        return SshRunner(settings.login, settings.ssh_key, port=settings.ssh_port, known_hosts=settings.known_hosts,
                         bin_dir=settings.bin_dir, slurm_conf=settings.slurm_conf)
    return LocalRunner(bin_dir=settings.bin_dir, slurm_conf=settings.slurm_conf)
