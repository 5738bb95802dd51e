"""Separate test hosts on one machine: one network namespace per host, each with its own address on
a Linux bridge, as a rack of machines on one switch (issue 16: agents on other hosts).

    with bridged_hosts(["cp", "gpu-1", "gpu-2"]) as net:   # needs root (CAP_NET_ADMIN) and iproute2
        net.address("gpu-1")                             # 10.X.Y.2
        net.exec_argv("gpu-1", [...])                    # ip netns exec <ns> ...
        net.partition("gpu-2"); net.heal("gpu-2")        # its cable pulled, and plugged back

Layout: a bridge tybr<id> in the test's own namespace holds 10.X.Y.254/24, so the test reaches
every host; host i (in the order given) is namespace ty<id>-<i> with veth ty<id>h<i> (inside,
10.X.Y.<i+1>/24) whose peer ty<id>p<i> is a port of the bridge; lo is up in each. partition() sets
the bridge port down: the host keeps its address but no packet leaves or reaches it (TCP waits and
times out, as on a dead link). Processes in every namespace share the file system (checkpoints,
artifacts, the SQLite file), as the hosts of a cluster share their file server. Every command is an
argument list (no shell); teardown always runs and deletes namespaces, veths and the bridge.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> tuple[bool, str]:
    """(True, "") if namespaces, veths and bridges can be made here; else (False, why)."""
    if shutil.which("ip") is None:
        return False, "ip (iproute2) is not installed: make test-deps installs it"
    if os.geteuid() != 0:
        return False, "not root: network namespaces need CAP_NET_ADMIN"
    probe = f"typrobe{secrets.token_hex(3)}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return False, f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


@dataclass
class Hosts:
    uid: str
    bridge: str
    gateway: str
    names: list[str]
    _ns: dict[str, str] = field(default_factory=dict)
    _addr: dict[str, str] = field(default_factory=dict)
    _port: dict[str, str] = field(default_factory=dict)

    def address(self, name: str) -> str:
        return self._addr[name]

    def namespace(self, name: str) -> str:
        return self._ns[name]

    def exec_argv(self, name: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self._ns[name], *argv]

    def partition(self, name: str) -> None:
        _ip("link", "set", self._port[name], "down")

    def heal(self, name: str) -> None:
        _ip("link", "set", self._port[name], "up")


@contextlib.contextmanager
def bridged_hosts(names: list[str]):
    uid = secrets.token_hex(2)
    x, y = 100 + secrets.randbelow(100), secrets.randbelow(250) + 1
    net = Hosts(uid=uid, bridge=f"tybr{uid}", gateway=f"10.{x}.{y}.254", names=list(names))
    made_ns: list[str] = []
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
        _ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
        _ip("link", "set", net.bridge, "up")
        for i, name in enumerate(names):
            ns, inside, port = f"ty{uid}-{i}", f"ty{uid}h{i}", f"ty{uid}p{i}"
            _ip("netns", "add", ns)
            made_ns.append(ns)
            _ip("link", "add", inside, "type", "veth", "peer", "name", port)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", port, "master", net.bridge)
            _ip("link", "set", port, "up")
            addr = f"10.{x}.{y}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            net._ns[name], net._addr[name], net._port[name] = ns, addr, port
        yield net
    finally:
        for ns in made_ns:
            _ip("netns", "del", ns, check=False)  # deletes its veth end, and so the pair
        _ip("link", "del", net.bridge, check=False)
