"""Two network namespaces joined by a rate-limited veth pair: a slow "inter-node" link on one
machine, for benchmarks that are about communication (bench/compression.py, bench/localsgd.py).

    with netns_link(rate="50mbit") as link:       # needs root (CAP_NET_ADMIN)
        procs = [launch_rank(link, r, 2, ...) for r in (0, 1)]

Layout: namespaces trainyard-a-<id> and trainyard-b-<id>, veth ends tya<id> (10.X.Y.1) and
tyb<id> (10.X.Y.2), lo up in both, and on both ends a tc token bucket filter
(`tbf rate R burst B latency L`): each direction is limited to R. Rank r runs in namespace r
(`ip netns exec NS argv`) as a plain torch.distributed process (RANK, WORLD_SIZE,
MASTER_ADDR=10.X.Y.1, ...): rank 0's TCPStore and gloo's pairs go over the veth
(GLOO_SOCKET_IFNAME names each side's end). Telemetry does not: the runtime's Redis is reached
through a unix socket (a file, visible in every namespace), so it never competes with the link.

Every command is an argument list (no shell). Teardown always runs: deleting a namespace
deletes its veth end, which deletes the pair and its qdisc.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Link:
    namespaces: tuple[str, str]
    interfaces: tuple[str, str]
    addresses: tuple[str, str]
    rate: str

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    def exec_argv(self, side: int, argv: list[str]) -> list[str]:
        """`argv` run inside namespace `side` (0: a, 1: b)."""
        return ["ip", "netns", "exec", self.namespaces[side], *argv]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def link_job_args(*, steps: int, start_step: int) -> argparse.ArgumentParser:
    """The options the slow-link benchmarks share: link rate, run length, the ~10.8M-param GPT."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--start-step", type=int, default=start_step)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    return ap


def netns_available() -> tuple[bool, str]:
    """(True, "") if namespaces, veth and tbf can be made here; else (False, why)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "ip or tc (iproute2) is not installed"
    if os.geteuid() != 0:
        return False, "not root: creating network namespaces needs CAP_NET_ADMIN"
    probe = f"trainyard-probe-{secrets.token_hex(3)}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return False, f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


@contextlib.contextmanager
def netns_link(rate: str = "50mbit", burst: str = "32kbit", latency: str = "50ms"):
    """Create the two namespaces and the limited link; yields a Link; always tears down."""
    uid = secrets.token_hex(3)
    ns = (f"trainyard-a-{uid}", f"trainyard-b-{uid}")
    ifs = (f"tya{uid}", f"tyb{uid}")  # <= 15 characters (IFNAMSIZ)
    x, y = 100 + secrets.randbelow(100), secrets.randbelow(250) + 1
    addrs = (f"10.{x}.{y}.1", f"10.{x}.{y}.2")
    made: list[str] = []
    try:
        for name in ns:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", ifs[0], "netns", ns[0], "type", "veth", "peer", "name", ifs[1],
            "netns", ns[1])
        for side in (0, 1):
            run = ["ip", "netns", "exec", ns[side]]
            subprocess.run([*run, "ip", "link", "set", "lo", "up"], check=True, capture_output=True)
            subprocess.run([*run, "ip", "addr", "add", f"{addrs[side]}/24", "dev", ifs[side]],
                           check=True, capture_output=True)
            subprocess.run([*run, "ip", "link", "set", ifs[side], "up"], check=True,
                           capture_output=True)
            subprocess.run([*run, "tc", "qdisc", "add", "dev", ifs[side], "root", "tbf",
                            "rate", rate, "burst", burst, "latency", latency],
                           check=True, capture_output=True)
        yield Link(ns, ifs, addrs, rate)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{' '.join(e.cmd)} failed: {e.stderr}") from e
    finally:
        for name in made:
            _ip("netns", "del", name, check=False)


def rank_env(link: Link, rank: int, world: int, port: int, base: dict | None = None) -> dict:
    """Environment of a plain torch.distributed rank in namespace `rank` (one rank per side)."""
    env = dict(base if base is not None else os.environ)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR=link.master_addr, MASTER_PORT=str(port),
               GLOO_SOCKET_IFNAME=link.interfaces[rank])
    return env


def launch_rank(link: Link, rank: int, world: int, port: int, argv: list[str], *, cwd: Path,
                env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start `argv` as rank `rank` of `world` inside namespace `rank` (world must be 2)."""
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(link.exec_argv(rank, argv), cwd=cwd,
                                env=rank_env(link, rank, world, port, env),
                                stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log is not None:
            out.close()


def measure_throughput(link: Link, nbytes: int = 2_000_000, port: int = 29999) -> float:
    """Bytes/s of one TCP transfer from side b to side a (a sanity check of the limit)."""
    server = ("import socket,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,"
              "socket.SO_REUSEADDR,1);s.bind(('0.0.0.0',%d));s.listen(1);print('ready',flush=True)\n"
              "c,_=s.accept();n=0\nwhile True:\n  b=c.recv(1<<16)\n  if not b: break\n  n+=len(b)\n"
              "print(n,flush=True)\n" % port)
    client = ("import socket,time\nfor _ in range(100):\n  try:\n    c=socket.create_connection("
              "('%s',%d));break\n  except OSError: time.sleep(0.05)\nc.sendall(b'x'*%d);c.close()\n"
              % (link.addresses[0], port, nbytes))
    srv = subprocess.Popen(link.exec_argv(0, [sys.executable, "-c", server]),
                           stdout=subprocess.PIPE, text=True)
    try:
        srv.stdout.readline()
        t0 = time.perf_counter()
        subprocess.run(link.exec_argv(1, [sys.executable, "-c", client]), check=True, timeout=120)
        got = int(srv.stdout.readline())
        return got / (time.perf_counter() - t0)
    finally:
        srv.kill()
        srv.wait()


def _free_port() -> int:
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


# ---- running a 2-rank Trainyard job over the link (or loopback) ------------------------------
REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def unix_redis(workdir: Path):
    """A redis-server on a unix socket only (reachable from every namespace); yields its URL."""
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    sock = Path(workdir) / "redis.sock"
    proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "777",
                             "--dir", str(workdir), "--save", "", "--appendonly", "no",
                             "--daemonize", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis
        url = f"unix://{sock}?db=0"
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis.from_url(url).ping():
                    break
            except (redis.RedisError, OSError):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def run_job(link: Link | None, spec: dict, work: Path, redis_url: str, job_id: int,
            timeout_s: float, port: int = 29500) -> list[dict]:
    """Train `spec` with 2 ranks (one per namespace, or both on loopback when `link` is None)
    to completion; returns the job's metric samples. Exits with the ranks' logs on failure."""
    import json

    import redis

    stream = f"trainyard:job:{job_id}"
    procs, logs = [], []
    for rank in (0, 1):
        run_dir = Path(work) / f"job{job_id}" / f"rank{rank}"  # each rank its own ranks/0.json
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({
            "job_id": job_id, "attempt_id": 1, "node": f"node-{rank}", "run_dir": str(run_dir),
            "redis_url": redis_url, "stream": stream, "data_root": str(work),
            "checkpoint_dir": str(Path(work) / f"job{job_id}" / "ckpt"), "spec": spec}))
        argv = [sys.executable, "-m", "workers.runtime", "--config", str(run_dir / "config.json")]
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        logs.append(run_dir / "log.txt")
        if link is not None:
            procs.append(launch_rank(link, rank, 2, port, argv, cwd=REPO, env=env, log=logs[-1]))
        else:
            if rank == 0:
                port = _free_port()
            env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        tails = "\n".join(f"--- {log}\n{log.read_text()[-2000:]}" for log in logs)
        sys.exit(f"job {job_id} failed (exit codes {[p.returncode for p in procs]}):\n{tails}")
    client = redis.Redis.from_url(redis_url)
    try:
        return [s for _, f in client.xrange(stream) if f[b"type"] == b"metrics"
                for s in json.loads(f[b"data"])]
    finally:
        client.close()


def job_val_loss(work: Path, job_id: int, rank: int = 0) -> float | None:
    """The finished rank's loss on fixed held-out windows of the corpus, from its log line
    "rank R finished steps N final_loss X val_loss Y wall_s W" (None: no held-out data)."""
    for line in (Path(work) / f"job{job_id}" / f"rank{rank}" / "log.txt").read_text().splitlines():
        words = line.split()
        if words[:4] == ["rank", str(rank), "finished", "steps"] and "val_loss" in words:
            v = words[words.index("val_loss") + 1]
            return None if v == "None" else float(v)
    return None


if __name__ == "__main__":  # python bench/netns.py [rate]: make a link, measure it, tear it down
    ok, why = netns_available()
    if not ok:
        sys.exit(f"network namespaces unavailable: {why}")
    with netns_link(rate=sys.argv[1] if len(sys.argv) > 1 else "50mbit") as lk:
        print(lk, f"{measure_throughput(lk) * 8 / 1e6:.1f} Mbit/s")
