"""The live path with real processes (one Cluster for the module: redis, daphne, Celery control
worker + beat, relay, two node agents): a real websocket client (token auth, no Origin) gets the
telemetry of a real 2-rank job and its SUCCEEDED status; and a websocket client that never
reads delays neither another client nor the relay; /metrics scraped from the real processes."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

from pathlib import Path

import pytest
import redis

from tests.conftest import REPO
from tests.jobs.telemetry.test_prometheus import parse, value
from tests.test_entrypoint import pack_dir
from trainyard.keys import attempt_stream
from trainyard.sdk.reporter import Reporter

from .cluster import Cluster
from .test_user_code import upload

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]

METRICS_TOKEN = "live-test-scrape-token"
EXAMPLES = Path(REPO) / "examples"
SPEC = {"name": "ws", "model": {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 2, "seq_len": 64},
        "train": {"steps": 60, "global_batch": 16}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("live"))
    c.env["TRAINYARD_METRICS_TOKEN"] = METRICS_TOKEN
    try:
        c.start()
        yield c
    finally:
        c.stop()


class WsClient:
    """A websockets client in a background event loop thread: acks every message, records each
    message with its receive time."""

    def __init__(self, port: int, job_id: int, token: str):
        self.url = f"ws://127.0.0.1:{port}/ws/jobs/{job_id}/"
        self.token = token
        self.messages: list[tuple[float, dict]] = []
        self.closed: Exception | None = None
        self._loop = asyncio.new_event_loop()
        self._opened = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)
        self._thread.start()
        assert self._opened.wait(30), f"no snapshot from {self.url}: {self.closed}"

    async def _main(self):
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosedOK

        try:
            async with connect(self.url, additional_headers={"Authorization": f"Token {self.token}"},
                               max_size=None, open_timeout=30) as ws:
                self._ws = ws
                async for raw in ws:
                    now = time.time()
                    msg = json.loads(raw)
                    self.messages.append((now, msg))
                    if "seq" in msg:
                        await ws.send(json.dumps({"type": "ack", "seq": msg["seq"]}))
                    if msg["type"] == "snapshot":
                        self._opened.set()
        except ConnectionClosedOK as exc:
            # our own close() landing while an ack was being sent ends the loop this way
            self.closed = ConnectionError("closed by the client") if self._closing else exc
        except Exception as exc:  # recorded: the tests assert the socket stayed open
            self.closed = exc
        else:
            self.closed = ConnectionError("closed by the client" if self._closing else "closed by the server")
        self._opened.set()

    def of_type(self, kind: str) -> list[dict]:
        return [m for _, m in list(self.messages) if m["type"] == kind]

    def wait(self, cond, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return
            assert self.closed is None, f"socket closed while waiting for {what}: {self.closed!r}"
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; got {[m['type'] for _, m in self.messages][-20:]}")

    def close(self):
        self._closing = True
        if self.closed is None:  # the loop ends with _main, so wait for the thread, not the future
            asyncio.run_coroutine_threadsafe(self._ws.close(), self._loop)
        self._thread.join(15)
        assert not self._thread.is_alive(), "websocket did not close"


class SilentClient:
    """Completes the websocket handshake, then never reads a byte and never acks: its receive
    buffer (kept small) fills and the server's writes to it back up."""

    def __init__(self, port: int, job_id: int, token: str):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /ws/jobs/{job_id}/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                           f"Authorization: Token {token}\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)  # byte by byte: nothing past the handshake is read
        assert head.startswith(b"HTTP/1.1 101"), head

    def read_frames(self, timeout_s: float = 5.0) -> list[dict]:
        """Everything the server managed to send (read at the end): the text frames, parsed."""
        self.sock.settimeout(0.5)
        data, deadline = b"", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = self.sock.recv(1 << 20)
            except socket.timeout:
                break
            if not chunk:
                break
            data += chunk
        out, i, parts = [], 0, b""
        while i + 2 <= len(data):
            fin, op, ln, j = data[i] & 0x80, data[i] & 0x0F, data[i + 1] & 0x7F, i + 2
            if ln == 126:
                ln, j = int.from_bytes(data[j:j + 2], "big"), j + 2
            elif ln == 127:
                ln, j = int.from_bytes(data[j:j + 8], "big"), j + 8
            if j + ln > len(data):
                break  # a frame the server had not finished sending
            payload, i = data[j:j + ln], j + ln
            if op in (0, 1):  # text and its continuations; pings and the like are skipped
                parts += payload
                if fin:
                    out.append(json.loads(parts))
                    parts = b""
        return out

    def close(self):
        self.sock.close()


def emit(redis_url: str, job_id: int, attempt_id: int, ranks: int, rate: float, duration_s: float,
         first_step: int) -> int:
    """Ranks (threads with the runtime's Reporter) emitting `rate` samples/s in total."""
    per_rank = rate / ranks
    total = int(per_rank * duration_s)

    def rank_loop(rank):
        rep = Reporter(redis_url, attempt_stream(job_id, attempt_id), rank=rank, attempt=attempt_id)
        t0 = time.time()
        for n in range(total):
            wait = t0 + n / per_rank - time.time()
            if wait > 0:
                time.sleep(wait)
            rep.metric({"rank": rank, "step": first_step + n, "ts": time.time(), "loss": 1.0, "samples_per_s": 1.0,
                        "tokens_per_s": 1.0, "step_s": 0.01, "data_s": 0.0, "compute_s": 0.01, "comm_s": 0.0,
                        "optim_s": 0.0, "bytes_sent": 0, "mem_bytes": 0, "attempt": attempt_id})
        assert rep.close() is True

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total * ranks


def burst(r: redis.Redis, job_id: int, attempt_id: int, n_entries: int, per_entry: int, first_step: int) -> None:
    pipe = r.pipeline(transaction=False)
    for e in range(n_entries):
        pipe.xadd(attempt_stream(job_id, attempt_id), {"type": "metrics", "data": json.dumps([
            {"rank": 0, "step": first_step + e * per_entry + k, "ts": time.time(), "loss": 1.0, "attempt": attempt_id}
            for k in range(per_entry)])})
    pipe.execute()


def drain_time(r: redis.Redis, job_id: int, attempt_id: int, t0: float, timeout_s: float = 60) -> float:
    while r.xlen(attempt_stream(job_id, attempt_id)):
        assert time.monotonic() - t0 < timeout_s, "relay did not drain the burst"
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def live_job(cluster):
    """A real 2-rank job, watched from submission to the end by a token-authenticated client."""
    job = cluster.submit(SPEC)
    client = WsClient(cluster.port, job["id"], cluster.token)
    done = cluster.wait_status(job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
    client.wait(lambda: any(m["status"] in ("SUCCEEDED", "FAILED") for m in client.of_type("status")), 30,
                "the final status message")
    client.close()
    return done, client


def test_websocket_client_receives_a_real_jobs_telemetry_and_final_status(cluster, live_job):
    job, client = live_job
    assert job["status"] == "SUCCEEDED", cluster.logs()
    assert client.closed is None or isinstance(client.closed, ConnectionError)
    snapshot = client.of_type("snapshot")[0]
    assert snapshot["job"]["id"] == job["id"] and snapshot["job"]["owner"] == "admin"
    seen = {(s["rank"], s["step"]) for m in client.of_type("telemetry") + client.of_type("window")
            for s in m["samples"]} | {(s["rank"], s["step"]) for s in snapshot["samples"]}
    assert {r for r, _ in seen} == {0, 1}
    assert seen == {(r, s) for r in (0, 1) for s in range(1, 61)}  # every step of both ranks, live
    attempt = job["attempts"][0]["id"]
    assert all(s["attempt"] == attempt and s["loss"] > 0 for m in client.of_type("telemetry") for s in m["samples"])
    statuses = [m["status"] for m in client.of_type("status")]
    assert statuses[-1] == "SUCCEEDED" and "RUNNING" in statuses
    kinds = [m["type"] for _, m in client.messages]
    last_status = max(i for i, k in enumerate(kinds) if k == "status")
    assert any(k == "telemetry" for k in kinds[:last_status])
    seqs = [m["seq"] for _, m in client.messages if "seq" in m]
    assert seqs == list(range(1, len(seqs) + 1))


@pytest.fixture
def running_job(cluster):
    """A real 2-rank job that is still running: its attempt's stream is one the relay keeps reading.
    (An ended attempt's drained stream is forgotten and deleted by the relay's gc every 30 s, since
    its Redis user is gone and nothing more can arrive; the test, writing there with the admin's
    Redis URL, then waited up to a second for the relay to find the stream again, and that gap, not
    the silent client, was the 0.67 s p99 that failed CI once.) Light on the CPU: an SDK script
    that sleeps 0.5 s a step. Cancelled, and seen cancelled, before the next test."""
    status, body = upload(cluster, pack_dir(EXAMPLES / "sdk_ddp"))
    assert status == 201, body
    job = cluster.submit({"name": "ws-running", "code": {"bundle": body["bundle"]}, "entrypoint": {"script": "train.py"},
                          "config": {"hidden": 32, "batch": 16, "step_sleep_s": 0.5}, "train": {"steps": 100_000},
                          "resources": {"nodes": 1, "procs_per_node": 2}})
    job = cluster.wait_running_ranks(job["id"], 2)
    try:
        # past its start (imports, the process group: a burst of CPU the latencies must not include)
        cluster.wait_for(lambda: {r["rank"] for r in cluster.metrics(job["id"]) if r["step"] >= 3} == {0, 1}, 120,
                         "both ranks of the running job at step 3", job_id=job["id"])
        yield job
    finally:
        cluster.request("POST", f"/api/v1/jobs/{job['id']}/cancel/")
        cluster.wait_status(job["id"], {"CANCELLED", "FAILED", "SUCCEEDED"}, 120)


def test_a_client_that_never_reads_delays_neither_other_clients_nor_the_relay(cluster, running_job):
    job_id, attempt_id = running_job["id"], running_job["attempts"][-1]["id"]
    r = redis.Redis.from_url(cluster.redis.url)
    normal = WsClient(cluster.port, job_id, cluster.token)
    silent = SilentClient(cluster.port, job_id, cluster.token)
    step = 1_000_000  # far past the real run's steps: (attempt, rank, step) stays unique

    def phase(first_step: int) -> dict:
        start = len(normal.messages)
        sent = emit(cluster.redis.url, job_id, attempt_id, ranks=2, rate=1000, duration_s=5, first_step=first_step)
        want = {(rk, first_step + n) for rk in (0, 1) for n in range(sent // 2)}

        def got():
            return {(s["rank"], s["step"]) for _, m in normal.messages[start:] if m["type"] == "telemetry"
                    for s in m["samples"] if s["step"] >= first_step}
        normal.wait(lambda: want <= got(), 30, "every paced sample at the normal client")
        lat = sorted(t - s["ts"] for t, m in normal.messages[start:] if m["type"] == "telemetry"
                     for s in m["samples"] if s["step"] >= first_step)
        # Relay throughput: a burst of 10k samples XADDed at once, timed until committed and acked.
        b0 = first_step + 100_000
        burst(r, job_id, attempt_id, n_entries=500, per_entry=20, first_step=b0)
        drain_s = drain_time(r, job_id, attempt_id, time.monotonic())
        normal.wait(lambda: sum(1 for _, m in normal.messages[start:] if m["type"] == "telemetry"
                                for s in m["samples"] if s["step"] >= b0) >= 10_000, 30, "the burst at the client")
        return {"sent": sent, "p50": statistics.median(lat), "p99": lat[int(0.99 * (len(lat) - 1))],
                "drain_s": drain_s, "windows": len(normal.of_type("window"))}

    with_silent = phase(step)
    silent_frames = silent.read_frames()
    silent.close()
    time.sleep(0.5)
    alone = phase(step + 1_000_000)
    normal.close()
    print(f"\nwith a silent client: {with_silent}\nalone: {alone}")

    # The silent client got its snapshot and at most the flow-control window before the server
    # stopped sending it telemetry; it was never disconnected for being slow. (The running job's
    # own status and event messages are not held back: they are few, and a window cannot replace them.)
    assert silent_frames and silent_frames[0]["type"] == "snapshot"
    held_back = [f["type"] for f in silent_frames[1:] if f["type"] in ("telemetry", "log", "window")]
    assert 1 <= len(held_back) <= 32, [f["type"] for f in silent_frames]
    # The other client was not held back: every sample arrived, quickly, and never as a window.
    assert with_silent["windows"] == 0
    assert with_silent["p99"] < max(3 * alone["p99"], 0.5), (with_silent, alone)
    # And the relay drained the same burst about as fast as without the silent client.
    assert with_silent["drain_s"] < 2 * alone["drain_s"] + 1.0, (with_silent, alone)


def test_prometheus_scrape_of_the_real_processes(cluster, live_job):
    """/metrics on the real daphne with the scrape token: the relay's counters (written by the
    real relay process) cover the job's samples, and nodes and jobs are there."""
    job, _ = live_job
    req = urllib.request.Request(f"http://127.0.0.1:{cluster.port}/metrics",
                                 headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    deadline = time.monotonic() + 10
    while True:  # the relay writes its counters at most every 0.5 s
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            fams = parse(resp.read().decode())
        if value(fams, "trainyard_relay_samples_total") >= 120 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert value(fams, "trainyard_redis_up") == 1
    assert value(fams, "trainyard_relay_samples_total") >= 120  # 60 steps x 2 ranks at least
    assert value(fams, "trainyard_relay_batches_total") >= 1
    assert value(fams, "trainyard_relay_backlog_entries") == 0 and value(fams, "trainyard_relay_lag_seconds") == 0
    assert value(fams, "trainyard_jobs", status="SUCCEEDED") >= 1
    assert value(fams, "trainyard_node_status", node="node-a", status="READY") == 1
    assert value(fams, "trainyard_node_slots", node="node-b") == 2
    anon = urllib.request.Request(f"http://127.0.0.1:{cluster.port}/metrics")
    try:
        urllib.request.urlopen(anon, timeout=10)
        raise AssertionError("anonymous scrape allowed")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401
